"""What the instrumentation costs the engine's thread (``selfcost``): charged at the boundaries, to the right part,
never the inner allocator's time; published on each step boundary and as Prometheus metrics."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from exporters.prometheus import OVERHEAD_BUCKETS, PrometheusExporter
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc import events as ev
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from instrumented_alloc.selfcost import PARTS, SelfCost
from tests.engine_model import Req, decode_args, extend_args, split_extend

PS = 4


class Clock:
    """A clock that moves only when told (``advance``), or by ``tick`` on every read."""

    def __init__(self, tick: float = 0.0):
        self.now = 100.0
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SlowInner(PagedTokenToKVPoolAllocator):
    """Our paged allocator whose calls take ``clock`` time: the engine's time, never the wrapper's."""

    clock: Clock

    def alloc_extend(self, *args, **kwargs):
        self.clock.advance(1000.0)
        return super().alloc_extend(*args, **kwargs)

    def alloc_decode(self, *args, **kwargs):
        self.clock.advance(1000.0)
        return super().alloc_decode(*args, **kwargs)

    def free(self, free_index):
        self.clock.advance(1000.0)
        return super().free(free_index)


def _wrapped(clock: Clock, **kw) -> InstrumentedAllocator:
    inner = SlowInner(256, PS, torch.float16, "cpu", None, False)
    inner.clock = clock
    return InstrumentedAllocator(inner, mode="record", cost_clock=clock, **kw)


def _extend(w, reqs, lens):
    with w.batch([r.rid for r in reqs]):
        out = w.alloc_extend(*extend_args(reqs, lens))
    split_extend(reqs, lens, out)


def _decode(w, reqs):
    with w.batch([r.rid for r in reqs]):
        out = w.alloc_decode(*decode_args(reqs))
    for r, slot in zip(reqs, out.tolist()):
        r.row.append(slot)


def test_stretches_switch_and_close():
    clock = Clock()
    c = SelfCost(clock)
    c.start()
    clock.advance(2.0)
    c.stop_hooks()  # 2 s of hooks; the next stretch starts now
    clock.advance(3.0)
    c.stop_checks()
    clock.advance(0.5)
    c.end_ledger()
    assert not c.open
    clock.advance(100.0)  # the engine's time: no stretch open
    c.start()
    clock.advance(0.25)
    c.end_checks()
    assert c.totals() == (2.0, 0.5, 3.25, 0.0)
    assert c.as_dict() == {"iterations": 0, "seconds": dict(zip(PARTS, c.totals())), "aside": 0.0}
    assert c.close_iteration() == 5.75
    c.start()
    clock.advance(1.0)
    c.end_hooks()
    c.set_aside()  # idle work: in the totals, in no iteration
    c.start()
    clock.advance(0.5)
    c.end_checks()
    assert c.close_iteration() == 0.5
    assert c.iterations == 2
    assert c.total() == 7.25
    assert c.aside == 1.0


def test_the_inner_allocators_time_is_never_charged():
    clock = Clock()
    w = _wrapped(clock)
    reqs = [Req("a"), Req("b")]
    _extend(w, reqs, [PS, PS + 1])
    for _ in range(3):
        _decode(w, reqs)
        w.step()
    with w.batch(["a"]):
        w.free(torch.tensor(reqs[0].row, dtype=torch.int64))
    w.release_request("a")
    assert clock.now >= 100.0 + 5 * 1000.0  # the inner's calls took their time
    assert w.cost.totals() == (0.0, 0.0, 0.0, 0.0)  # none of it ours
    assert w.cost.iterations == 3


def test_each_boundary_read_is_charged_to_its_part():
    # Every clock read moves it 1 s: a stretch is charged the reads it spans, so each part's total is exact.
    clock = Clock(tick=1.0)
    got = []

    def sink(batch):
        clock.advance(7.0)  # the sink's own work on the engine's thread
        got.extend(batch)

    sink.event_types = frozenset({ev.StepBoundary})
    w = _wrapped(clock, sinks=[sink])
    reqs = [Req("a")]
    _extend(w, reqs, [PS])
    before = w.cost.totals()
    assert before[2] > 0 and before[3] == 0.0  # the extend's checks; no event the sink reads
    w.ledger["a"].kv_committed_len = PS - 1  # a checked write: one stretch, two reads
    assert w.cost.ledger - before[1] == 1.0
    w.step()
    (b,) = [e for e in got if type(e) is ev.StepBoundary]
    # The boundary carries the totals as of its step's start and what the iteration cost since the last one.
    assert b.overhead[:2] == w.cost.totals()[:2]
    assert b.iteration_seconds == pytest.approx(sum(b.overhead))  # the first iteration: everything so far
    assert w.cost.exporters >= 7.0  # delivering the boundary ran the sink inside the step's stretch


def test_a_subscribe_outside_any_call_charges_nothing():
    clock = Clock()
    got = []
    w = _wrapped(clock, sinks=[got.extend])
    reqs = [Req("a"), Req("b")]
    _extend(w, reqs, [PS, PS])
    _decode(w, reqs)
    clock.advance(50.0)  # the engine runs on
    w.subscribe(lambda batch: None)  # outside any charged call
    assert sum(w.cost.totals()) == 0.0


def test_swa_pool_views_nested_in_the_inner_call_are_charged_once():
    clock = Clock(tick=1.0)
    inner = SWATokenToKVPoolAllocator(256, 256, PS, torch.float16, "cpu", None, False)
    w = InstrumentedAllocator(inner, mode="record", sliding_window=2 * PS, cost_clock=clock)
    reqs = [Req("a")]
    _extend(w, reqs, [3 * PS])
    t0 = clock.now
    checks0 = w.cost.checks
    with w.batch(["a"]):
        # SGLang's SWA free calls its sub-allocators, which the wrapper checks through views: calls nested in the
        # inner's call, each charged its own stretch, the inner's time between them to nobody.
        w.free_swa(torch.tensor(reqs[0].row[:PS], dtype=torch.int64))
    spent = clock.now - t0
    assert 0 < w.cost.checks - checks0 < spent


def test_prometheus_exports_the_cost_per_part_and_per_iteration():
    clock = Clock(tick=1e-6)
    w = _wrapped(clock)
    reg = CollectorRegistry()
    prom = PrometheusExporter(w, registry=reg)
    reqs = [Req("a"), Req("b")]
    _extend(w, reqs, [PS, PS])
    for _ in range(5):
        _decode(w, reqs)
        before = w.cost.totals()  # what the step's boundary carries (its own stretch is the next iteration's)
        w.step()
    assert before[2] > 0 and before[3] > 0  # checks, and the Prometheus sink's own work
    # The counters hold the totals as of the last step boundary, part by part.
    for part, total in zip(PARTS, before):
        assert reg.get_sample_value("kvalloc_overhead_seconds_total", {"part": part}) == pytest.approx(total)
    # One observation per iteration; together they are everything charged up to the last boundary.
    assert reg.get_sample_value("kvalloc_overhead_iteration_seconds_count") == 5
    assert reg.get_sample_value("kvalloc_overhead_iteration_seconds_sum") == pytest.approx(sum(before))
    top = str(OVERHEAD_BUCKETS[-1])
    assert reg.get_sample_value("kvalloc_overhead_iteration_seconds_bucket", {"le": top}) == 5
    prom.close()


def test_off_mode_charges_nothing():
    clock = Clock(tick=1.0)
    inner = PagedTokenToKVPoolAllocator(256, PS, torch.float16, "cpu", None, False)
    w = InstrumentedAllocator(inner, mode="off", cost_clock=clock)
    reqs = [Req("a")]
    with w.batch(["a"]):
        out = w.alloc_extend(*extend_args(reqs, [PS]))
    split_extend(reqs, [PS], out)
    w.step()
    assert w.cost.totals() == (0.0, 0.0, 0.0, 0.0)
