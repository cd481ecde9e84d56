"""Per-step statistics (``StepStats``): the sums of the per-call events, built at boundaries, and the only thing a
sink that reads them costs per call (no per-call event is built or delivered for it)."""

from __future__ import annotations

import pytest
import torch

from exporters.prometheus import PrometheusExporter
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc import events as ev
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from instrumented_alloc.sim import build_engine
from instrumented_alloc.stepstats import SWA_ONLY_OPS, StepAccumulator
from tests.engine_model import Req, decode_args, extend_args, split_extend, t

F16 = torch.float16
PS = 4
PER_CALL = (ev.Alloc, ev.Free, ev.AllocFailed, ev.SwaEvict)


class Batches:
    """A sink that keeps every batch it is handed; ``event_types`` as given (None: every kind)."""

    def __init__(self, name: str, types=None):
        self.name = name
        if types is not None:
            self.event_types = frozenset(types)
        self.batches: list[list] = []

    def __call__(self, batch):
        self.batches.append(list(batch))

    @property
    def events(self) -> list:
        return [e for b in self.batches for e in b]


def _calls(w, k: int) -> None:
    """Round ``k`` on a paged allocator of 16 pages: an extend (3 pages), a decode (no page opened), a refusal,
    the frees of both requests (3 pages); no request released."""
    a, b = Req(f"a{k}"), Req(f"b{k}")
    with w.batch([a.rid, b.rid]):
        split_extend([a, b], [5, 3], w.alloc_extend(*extend_args([a, b], [5, 3])))
    with w.batch([a.rid, b.rid]):
        out = w.alloc_decode(*decode_args([a, b]))
    a.row.append(int(out[0]))
    b.row.append(int(out[1]))
    assert w.alloc(PS * 64) is None  # refused: more than the pool
    w.free(t(a.row))
    w.free(t(b.row))


# -- what a StepStats reader costs per call -----------------------------------------------------------------------
def test_a_stepstats_reader_gets_one_batch_per_step_and_no_per_call_event():
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, PS, F16, "cpu"), mode="record")
    stats = Batches("stats", {ev.StepStats})
    w.subscribe(stats)
    for step in range(3):
        seq, k = w._w_st.seq, step
        _calls(w, k)
        assert len(stats.batches) == step  # nothing delivered per call
        assert w._w_st.seq == seq  # and nothing built
        w.step()
        assert len(stats.batches) == step + 1
        assert [type(e) for e in stats.batches[-1]] == [ev.StepStats]
        assert w._w_st.seq == seq + 1
    # A sink that reads Alloc gets its per-call events while subscribed, and only then.
    allocs = Batches("allocs", {ev.Alloc})
    w.subscribe(allocs)
    _calls(w, 3)
    assert [e.op for e in allocs.events if type(e) is ev.Alloc] == ["alloc_extend", "alloc_decode"]
    n = len(stats.batches)
    w.unsubscribe(allocs)
    _calls(w, 4)
    assert len(stats.batches) == n  # the per-call batches went to every sink; none now
    w.step()
    assert [type(e) for e in stats.batches[-1]] == [ev.StepStats]
    s = stats.batches[-1][0]
    assert s.allocated == {"full": 6} and s.freed == {"full": 6}  # both rounds' pages
    assert s.failures == {("full", "alloc"): 2} and len(s.durations["alloc_decode"]) == 2


def test_prometheus_alone_builds_no_per_call_event_and_its_sink_runs_once_per_step():
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, PS, F16, "cpu"), mode="record")
    exp = PrometheusExporter(w, multiprocess=False)
    calls = []
    sink = exp.sink

    def counted(batch):
        calls.append([type(e) for e in batch])
        return sink(batch)

    counted.name, counted.event_types = sink.name, sink.event_types
    w.unsubscribe(sink)
    w.subscribe(counted)
    try:
        seq = w._w_st.seq
        for k in range(4):
            _calls(w, k)
            w.step()
        assert calls == [[ev.StepStats]] * 4
        assert w._w_st.seq == seq + 4
        reg = exp.registry
        assert reg.get_sample_value("kvalloc_pages_allocated_total", {"pool": "full"}) == 4 * 3
        assert reg.get_sample_value("kvalloc_pages_freed_total", {"pool": "full"}) == 4 * 3
        assert reg.get_sample_value("kvalloc_alloc_failures_total", {"pool": "full", "op": "alloc"}) == 4
        assert reg.get_sample_value("kvalloc_op_duration_seconds_count", {"op": "alloc_decode"}) == 4
    finally:
        w.unsubscribe(counted)
        exp.close()


def test_counters_move_at_step_boundaries_and_flush_publishes_the_rest():
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, PS, F16, "cpu"), mode="record")
    exp = PrometheusExporter(w, multiprocess=False)
    reg = exp.registry
    try:
        _calls(w, 0)
        assert reg.get_sample_value("kvalloc_pages_allocated_total", {"pool": "full"}) == 0  # not yet
        w.flush()  # a caller that never steps publishes with flush()
        assert reg.get_sample_value("kvalloc_pages_allocated_total", {"pool": "full"}) == 3
        assert reg.get_sample_value("kvalloc_overhead_iteration_seconds_count") == 0  # flush closes none
        _calls(w, 1)
        w.check_consistency()  # a sweep is a boundary too
        assert reg.get_sample_value("kvalloc_pages_allocated_total", {"pool": "full"}) == 6
    finally:
        exp.close()


def test_a_caller_that_never_steps_publishes_when_an_op_holds_max_pending_durations(monkeypatch):
    # The pending durations are bounded: at MAX_PENDING calls of one op the wrapper publishes them mid-step.
    monkeypatch.setattr("instrumented_alloc.stepstats.MAX_PENDING", 5)
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, PS, F16, "cpu"), mode="record")
    stats = Batches("stats", {ev.StepStats})
    w.subscribe(stats)
    for k in range(6):
        _calls(w, k)  # one alloc_extend, one alloc_decode, one refused alloc, two frees per round
    published = stats.events
    # The frees (two a round; a refusal has no duration) reach 5 at round 3's first free, then at round 5's second.
    assert [sorted((op, len(xs)) for op, xs in e.durations.items()) for e in published] == [
        [("alloc_decode", 3), ("alloc_extend", 3), ("free", 5)],
        [("alloc_decode", 2), ("alloc_extend", 2), ("free", 5)],
    ]
    assert all(e.overhead == () for e in published)  # none closes an iteration
    w.flush()
    rest = stats.events[len(published):]
    assert sum(len(xs) for e in published + rest for xs in e.durations.values()) == 6 * 4
    assert sum(e.allocated.get("full", 0) for e in published + rest) == 6 * 3


def test_the_accumulator_counts_what_the_events_carry():
    acc = StepAccumulator()
    acc.alloc("alloc_extend", "full", 3, 0.5)
    acc.alloc("alloc_extend", "swa", 3, 0.0)  # the SWA side of a two-pool call: no second duration
    acc.free("free_swa", "swa", 2, 0.25)  # an SWA-only op: its duration counts
    acc.free("free", "full", 0, 0.125)  # no page, one call
    acc.failure("full", "alloc")
    acc.failure("full", "alloc")
    acc.evict(0, 8)
    acc.evict(8, 4)  # a decrease evicts nothing
    allocated, freed, durations, failures, evicted = acc.take()
    assert allocated == {"full": 3, "swa": 3}
    assert freed == {"swa": 2}
    assert durations == {"alloc_extend": [0.5], "free_swa": [0.25], "free": [0.125]}
    assert failures == {("full", "alloc"): 2}
    assert evicted == 8
    assert acc.take() == ({}, {}, {}, {}, 0)  # handed over: the accumulator starts empty
    assert allocated == {"full": 3, "swa": 3}  # and never writes what it handed over


# -- StepStats equal the per-call events' sums ------------------------------------------------------------------
class Sums:
    """The per-call events' sums since the last StepStats, in StepStats' shape."""

    def __init__(self):
        self.allocated, self.freed, self.durations, self.failures, self.evicted = {}, {}, {}, {}, 0

    def add(self, e) -> None:
        t = type(e)
        if t is ev.Alloc or t is ev.Free:
            if e.n_pages:
                d = self.allocated if t is ev.Alloc else self.freed
                d[e.pool] = d.get(e.pool, 0) + e.n_pages
            if e.pool == "full" or e.op in SWA_ONLY_OPS:
                self.durations.setdefault(e.op, []).append(e.duration)
        elif t is ev.AllocFailed:
            self.failures[e.pool, e.op] = self.failures.get((e.pool, e.op), 0) + 1
        elif t is ev.SwaEvict and e.new > e.old:
            self.evicted += e.new - e.old

    def fields(self) -> tuple:
        return self.allocated, self.freed, self.durations, self.failures, self.evicted


def _check_stream(events) -> dict:
    """Each StepStats against the per-call events since the previous one; returns the per-call totals."""
    pending, totals, n_stats = Sums(), Sums(), 0
    for e in events:
        if type(e) is ev.StepStats:
            n_stats += 1
            assert (e.allocated, e.freed, e.durations, e.failures, e.evicted) == pending.fields(), e.step
            pending = Sums()
        elif type(e) in PER_CALL:
            pending.add(e)
            totals.add(e)
    assert pending.fields() == Sums().fields()  # nothing left unpublished after the final flush
    assert n_stats > 0
    return {"allocated": totals.allocated, "freed": totals.freed, "durations": totals.durations,
            "failures": totals.failures, "evicted": totals.evicted}


CASES = [
    ("dense", 1, ["double-free@120", "leak@150"]),
    ("dense", 16, ["duplicate-alloc@120", "leak@150"]),
    ("swa-128", 1, ["duplicate-alloc@120", "leak@150"]),
    ("swa-128", 16, ["segment-unaligned@120", "swa-inside-window@150"]),
    ("pd-decode", 16, ["swa-misaligned@120", "alloc-len-misaligned@150"]),
]


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize(("preset", "page_size", "faults"), CASES)
def test_step_stats_equal_the_per_call_sums_and_the_exposition(preset, page_size, faults, verify):
    steps = 400
    both = Batches("both", (*PER_CALL, ev.StepStats))
    eng = build_engine(preset, seed=3, page_size=page_size, inject=faults, steps=steps, sinks=[both],
                       verify=verify)
    exp = PrometheusExporter(eng.alloc, multiprocess=False)
    try:
        eng.run(steps)
        # A refusal (the scheduler itself never asks for more than is free).
        if eng.ps == 1:
            assert eng.alloc.alloc(1 << 20) is None
        else:
            assert eng.alloc.alloc_extend(*extend_args([Req("huge")], [eng.ps << 20])) is None
        eng.shutdown()
        eng.alloc.flush()
        assert eng.fired and eng.alloc.violation_counts  # the faults happened
        sums = _check_stream(both.events)
        assert sums["allocated"] and sums["freed"] and sums["durations"] and sums["failures"]
        if preset != "dense":
            assert "swa" in sums["allocated"] and sums["evicted"]
        # The exposition's counters equal the per-call sums.
        reg = exp.registry
        for name, key in (("kvalloc_pages_allocated_total", "allocated"), ("kvalloc_pages_freed_total", "freed")):
            for pool, n in sums[key].items():
                assert reg.get_sample_value(name, {"pool": pool}) == n
        for (pool, op), n in sums["failures"].items():
            assert reg.get_sample_value("kvalloc_alloc_failures_total", {"pool": pool, "op": op}) == n
        assert reg.get_sample_value("kvalloc_swa_evicted_tokens_total") == sums["evicted"]
        for op, xs in sums["durations"].items():
            assert reg.get_sample_value("kvalloc_op_duration_seconds_count", {"op": op}) == len(xs)
            assert reg.get_sample_value("kvalloc_op_duration_seconds_sum", {"op": op}) == pytest.approx(sum(xs))
    finally:
        exp.close()


def test_step_stats_on_an_swa_allocator_count_both_pools_and_evictions():
    w = InstrumentedAllocator(SWATokenToKVPoolAllocator(64, 64, PS, F16, "cpu", None, False), mode="record",
                              sliding_window=8)
    both = Batches("both", (*PER_CALL, ev.StepStats))
    w.subscribe(both)
    a = Req("a")
    with w.batch(["a"]):
        w.alloc_extend(*extend_args([a], [20]))
    w.ledger["a"].swa_evicted_seqlen = 8
    w.step()
    s = both.events[-1]
    assert type(s) is ev.StepStats
    assert s.allocated == {"full": 5, "swa": 5} and s.evicted == 8
    assert list(s.durations) == ["alloc_extend"] and len(s.durations["alloc_extend"]) == 1
    _check_stream(both.events)
