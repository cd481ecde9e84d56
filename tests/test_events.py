"""The event bus (delivery, refusal and failure accounting) and the events a wrapped allocator publishes:
exact types, order and fields of a scripted scenario, gap-free ``seq``, ``step`` at emission, SWA eviction
events, and that no sink means no events at all and a failing sink never changes what the caller sees.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from instrumented_alloc import InstrumentedAllocator, InvariantViolation
from instrumented_alloc import events as ev
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from instrumented_alloc.events import EventBus, sink_name
from tests.engine_model import Req, allocator_state, decode_args, extend_args, split_extend, t

F16 = torch.float16
PS = 4


def paged():
    return PagedTokenToKVPoolAllocator(64, PS, F16, "cpu", None, False)  # 16 pages


def swa():
    return SWATokenToKVPoolAllocator(64, 64, PS, F16, "cpu", None, False)


def counting_clock(start: float = 1000.0):
    c = itertools.count()
    return lambda: start + next(c)


class Collector:
    """A sink that keeps every batch, and the wrapper's step_count when it was delivered."""

    name = "collector"

    def __init__(self):
        self.batches: list[list] = []
        self.steps: list[int] = []
        self.alloc = None

    def __call__(self, batch):
        self.batches.append(list(batch))
        self.steps.append(self.alloc.step_count if self.alloc is not None else -1)

    @property
    def events(self) -> list:
        return [e for b in self.batches for e in b]


def _ev(seq=1, step=0):
    return ev.StepBoundary(seq=seq, ts=0.0, step=step)


# -- EventBus ----------------------------------------------------------------------------------------------------
def test_bus_raising_sink_is_dropped_counted_and_never_propagates():
    got = []

    class Bad:
        name = "bad"

        def __call__(self, batch):
            raise RuntimeError("boom")

    def good(batch):
        got.append(list(batch))

    bus = EventBus([Bad(), good])
    assert bus.active is True
    assert bus.dropped == {"bad": 0, "good": 0}
    batch = [_ev(1), _ev(2), _ev(3)]
    bus.deliver(batch)  # no exception
    assert bus.dropped == {"bad": 3, "good": 0}
    assert bus.errors == {"bad": "RuntimeError: boom"}
    assert got == [batch]  # a later sink still gets the batch
    bus.deliver([_ev(4)])
    assert bus.dropped["bad"] == 4


def test_bus_refusing_sink_counted_without_error_text():
    bus = EventBus()

    def refuse(batch):
        return False

    bus.subscribe(refuse)
    bus.deliver([_ev(1), _ev(2)])
    assert bus.dropped == {"refuse": 2}
    assert bus.errors == {}


@pytest.mark.parametrize("answer", [None, True])
def test_bus_none_or_true_is_accepted(answer):
    calls = []

    def sink(batch):
        calls.append(len(batch))
        return answer

    bus = EventBus([sink])
    bus.deliver([_ev(1), _ev(2)])
    assert calls == [2]
    assert bus.dropped == {"sink": 0}
    assert bus.errors == {}


def test_bus_loss_counters_add_to_drop_counts():
    bus = EventBus()

    def refuse(batch):
        return False

    refuse.name = "otel"
    bus.subscribe(refuse)
    bus.deliver([_ev(1), _ev(2)])
    lost = [5]
    bus.add_loss_counter("otel", lambda: lost[0])
    bus.add_loss_counter("otel", lambda: 3)
    bus.add_loss_counter("elsewhere", lambda: 1)

    def broken():
        raise RuntimeError("gone")

    bus.add_loss_counter("elsewhere", broken)  # counts 0, never breaks the others
    assert bus.drop_counts() == {"otel": 2 + 5 + 3, "elsewhere": 1}
    lost[0] = 7
    assert bus.drop_counts() == {"otel": 12, "elsewhere": 1}
    assert bus.dropped == {"otel": 2}  # the bus's own count is unchanged
    with pytest.raises(TypeError):
        bus.add_loss_counter("x", 3)


def test_bus_loss_counters_with_one_key_count_once():
    bus = EventBus()
    part, whole = [2], [5]
    src, other = object(), object()
    bus.add_loss_counter("otel", lambda: whole[0], key=src)
    bus.add_loss_counter("otel", lambda: whole[0], key=src)  # a second sink around the same component
    bus.add_loss_counter("otel", lambda: part[0], key=src)  # one that counts part of it
    bus.add_loss_counter("otel", lambda: 1, key=other)
    bus.add_loss_counter("otel", lambda: 1)  # no key: counted on its own, as before
    bus.add_loss_counter("recorder", lambda: whole[0], key=src)  # another name: its own count
    assert bus.drop_counts() == {"otel": 5 + 1 + 1, "recorder": 5}
    whole[0], part[0] = 9, 3
    assert bus.drop_counts() == {"otel": 9 + 1 + 1, "recorder": 9}


def test_bus_empty_batch_not_delivered():
    calls = []
    bus = EventBus([calls.append])
    bus.deliver([])
    assert calls == []


def test_bus_subscribe_unsubscribe_toggles_active():
    bus = EventBus()
    assert bus.active is False and bus.sinks == ()

    def a(batch):
        return None

    def b(batch):
        return None

    bus.subscribe(a)
    bus.subscribe(b)
    assert bus.active is True and bus.sinks == (a, b)
    bus.unsubscribe(a)
    assert bus.active is True and bus.sinks == (b,)
    bus.unsubscribe(b)
    assert bus.active is False and bus.sinks == ()
    with pytest.raises(ValueError):
        bus.unsubscribe(b)


def test_sink_name():
    class Named:
        name = "exporter"

        def __call__(self, batch):
            return None

    class Plain:
        def __call__(self, batch):
            return None

    def fn(batch):
        return None

    assert sink_name(Named()) == "exporter"
    assert sink_name(Plain()) == "Plain"
    assert sink_name(fn) == "fn"
    assert sink_name(lambda b: None) == "<lambda>"


# -- no sink, no events ------------------------------------------------------------------------------------------
def _shadow_deltas(w):
    return [p.shadow.deltas for p in w._w_pools.values()]


def _scenario(w):
    a, b = Req("a"), Req("b")
    with w.batch(["a", "b"]):
        split_extend([a, b], [8, 9], w.alloc_extend(*extend_args([a, b], [8, 9])))
    with w.batch(["a", "b"]):
        out = w.alloc_decode(*decode_args([a, b]))
    for r, s in zip((a, b), out.tolist()):
        r.row.append(s)
    return a, b


def test_no_sinks_publishes_nothing_and_collects_no_deltas():
    for make in (paged, swa):
        w = InstrumentedAllocator(make(), mode="record", sliding_window=8)
        assert w.bus.active is False
        assert _shadow_deltas(w) == [None] * len(w.pools)
        a, _b = _scenario(w)
        w.free(t(a.row))
        w.release_request("a")
        w.ledger["b"].kv_committed_len = 1
        w.free(t(a.row))  # a double free: a violation, still no event
        w.step()
        assert [v.invariant for v in w.violations] == ["double_free"]
        assert w._w_st.events == []
        assert _shadow_deltas(w) == [None] * len(w.pools)
        # Nothing was built while no one listened: the first event published afterwards has seq 1.
        c = Collector()
        w.subscribe(c)
        w.step()
        assert [(type(e).__name__, e.seq, e.step) for e in c.events] == [("StepBoundary", 1, 2)]


def test_subscribe_unsubscribe_toggles_wrapper_collection():
    w = InstrumentedAllocator(swa(), mode="record")
    c1, c2 = Collector(), Collector()
    w.subscribe(c1)
    assert w.bus.active is True
    assert _shadow_deltas(w) == [[], []]
    w.subscribe(c2)
    w.unsubscribe(c1)
    assert w.bus.active is True and _shadow_deltas(w) == [[], []]
    w.unsubscribe(c2)
    assert w.bus.active is False and _shadow_deltas(w) == [None, None]
    _scenario(w)
    w.step()
    assert c1.batches == [] and c2.batches == []
    w.subscribe(c1)
    w.step()
    assert [type(e).__name__ for e in c1.events] == ["StepBoundary"]  # no stale page deltas from before
    assert c2.batches == []


# -- the scripted scenario ---------------------------------------------------------------------------------------
def test_paged_scenario_exact_events():
    c = Collector()
    w = InstrumentedAllocator(paged(), mode="record", sinks=[c], clock=counting_clock())
    c.alloc = w
    a, b = _scenario(w)  # a: 8 tokens (2 pages) then decode opens page 3; b: 9 tokens (3 pages) + 1 in place
    assert a.row[:4] == [4, 5, 6, 7] and b.row[:4] == [12, 13, 14, 15]
    w.step()
    w.free(t(a.row))
    w.release_request("a")
    w.step()

    events = c.events
    assert [type(e).__name__ for e in events] == [
        "LedgerUpdate",
        "Alloc",
        "PageUpdate",
        "LedgerUpdate",
        "Alloc",
        "PageUpdate",
        "StepBoundary",
        "Free",
        "LedgerUpdate",
        "PageUpdate",
        "RequestReleased",
        "StepBoundary",
    ]
    # One batch per call, in call order.
    assert [len(b_) for b_ in c.batches] == [3, 3, 1, 3, 1, 1]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    # step at emission == the wrapper's step_count when the batch was delivered.
    for batch, step in zip(c.batches, c.steps):
        assert {e.step for e in batch} == {step}
    assert c.steps == [0, 0, 1, 1, 1, 2]
    ts = [e.ts for e in events]
    assert ts == sorted(ts) and min(ts) >= 1000.0  # the injected clock

    lu, al, pu = events[0:3]
    assert (lu.op, lu.rids, lu.slots.tolist()) == ("alloc_extend", ("a", "b"), [0, 1])
    assert (lu.allocated.tolist(), lu.committed.tolist(), lu.evicted.tolist()) == ([8, 12], [8, 9], [0, 0])
    assert (al.op, al.pool, al.n_slots, al.n_pages, al.rids) == ("alloc_extend", "full", 17, 5, ("a", "b"))
    assert al.duration > 0
    assert (pu.op, pu.pool) == ("alloc_extend", "full")
    # One entry per page (not per slot): each page's owner changed once.
    assert pu.pages.tolist() == [1, 2, 3, 4, 5]
    assert pu.owners.tolist() == [0, 0, 1, 1, 1]

    lu, al, pu, sb = events[3:7]
    assert (lu.op, lu.rids, lu.slots.tolist()) == ("alloc_decode", ("a", "b"), [0, 1])
    assert (lu.allocated.tolist(), lu.committed.tolist(), lu.evicted.tolist()) == ([12, 12], [9, 10], [0, 0])
    assert (al.op, al.pool, al.n_slots, al.n_pages, al.rids) == ("alloc_decode", "full", 2, 1, ("a", "b"))
    # Only a's opened page: b continues page 5, which it owned already (no entry for an unchanged owner).
    assert (pu.op, pu.pool, pu.pages.tolist(), pu.owners.tolist()) == ("alloc_decode", "full", [6], [0])
    assert (a.row[-1], b.row[-1]) == (24, 21)
    assert sb.available == {"full": 10}

    fr, lu, pu, rr, sb = events[7:12]
    assert (fr.op, fr.pool, fr.n_pages, fr.rids) == ("free", "full", 3, ("a",))
    assert (lu.op, lu.rids, lu.slots.tolist()) == ("free", ("a",), [0])
    assert (lu.allocated.tolist(), lu.committed.tolist(), lu.evicted.tolist()) == ([0], [0], [0])
    assert pu.pool == "full"
    assert sorted(pu.pages.tolist()) == [1, 2, 6] and pu.owners.tolist() == [-6, -6, -6]
    assert (rr.rid, rr.pages_held, rr.pages_peak) == ("a", 0, 3)
    assert sb.available == {"full": 13}
    assert list(w.violations) == []


def test_page_update_of_a_free_names_the_free():
    c = Collector()
    w = InstrumentedAllocator(paged(), mode="record", sinks=[c])
    a = Req("a")
    with w.batch(["a"]):
        split_extend([a], [5], w.alloc_extend(*extend_args([a], [5])))
    w.free(t(a.row))
    (pu,) = [e for e in c.batches[-1] if isinstance(e, ev.PageUpdate)]
    assert pu.op == "free"


def test_a_decode_page_delta_reaches_a_pages_only_sink_with_its_own_call():
    # A sink that reads PageUpdate alone (no LedgerUpdate or Alloc built): a decode's page delta is its own batch,
    # named for the decode, not carried by the next call's batch.
    class Pages:
        event_types = frozenset({ev.PageUpdate})

        def __init__(self):
            self.batches = []

        def __call__(self, batch):
            self.batches.append([(e.op, e.pages.tolist()) for e in batch])

    sink = Pages()
    w = InstrumentedAllocator(paged(), mode="record", sinks=[sink])
    a = Req("a")
    with w.batch(["a"]):
        split_extend([a], [PS], w.alloc_extend(*extend_args([a], [PS])))
    for _ in range(2):
        with w.batch(["a"]):
            a.row.append(int(w.alloc_decode(*decode_args([a]))[0]))
    w.step()
    # The second decode continues the page the first opened: no delta, no batch.
    assert sink.batches == [[("alloc_extend", [a.row[0] // PS])], [("alloc_decode", [a.row[PS] // PS])]]


def test_free_duration_is_this_calls_duration():
    c = Collector()
    w = InstrumentedAllocator(paged(), mode="record", sinks=[c], clock=counting_clock())
    a = Req("a")
    with w.batch(["a"]):
        split_extend([a], [5], w.alloc_extend(*extend_args([a], [5])))
    w.free(t(a.row))
    (fr,) = [e for e in c.events if isinstance(e, ev.Free)]
    assert fr.duration > 0  # the clock advanced during the call (Alloc.duration is > 0 for the same clock)
    # Each Free carries its own call's duration, not the previous free's.
    b = Req("b")
    with w.batch(["b"]):
        split_extend([b], [5], w.alloc_extend(*extend_args([b], [5])))
    w.free(t(b.row))
    first, second = [e for e in c.events if isinstance(e, ev.Free)]
    # The counting clock ticks once at the start and once at the end of the inner call.
    assert (first.duration, second.duration) == (1.0, 1.0)


def test_alloc_failed_event():
    c = Collector()
    w = InstrumentedAllocator(paged(), mode="record", sinks=[c])
    r = Req("big")
    with w.batch(["big"]):
        assert w.alloc_extend(*extend_args([r], [65])) is None  # 17 pages, 16 exist
    (failed,) = c.events
    assert isinstance(failed, ev.AllocFailed)
    assert (failed.op, failed.pool, failed.requested, failed.available, failed.rids) == (
        "alloc_extend",
        "full",
        65,
        64,
        ("big",),
    )
    assert failed.seq == 1 and failed.step == 0


def test_swa_events_both_pools_and_eviction_pair():
    c = Collector()
    w = InstrumentedAllocator(swa(), mode="record", sliding_window=8, sinks=[c], clock=counting_clock())
    c.alloc = w
    a = Req("a")
    with w.batch(["a"]):
        split_extend([a], [20], w.alloc_extend(*extend_args([a], [20])))
    first = c.batches[-1]
    assert [type(e).__name__ for e in first] == ["LedgerUpdate", "Alloc", "Alloc", "PageUpdate", "PageUpdate"]
    allocs = [(e.op, e.pool, e.n_slots, e.n_pages, e.rids) for e in first if isinstance(e, ev.Alloc)]
    assert allocs == [("alloc_extend", "full", 20, 5, ("a",)), ("alloc_extend", "swa", 20, 5, ("a",))]
    assert [e.pool for e in first if isinstance(e, ev.PageUpdate)] == ["full", "swa"]

    with w.batch(["a"]):
        out = w.alloc_decode(*decode_args([a]))
    a.row.append(int(out[0]))
    dec = [(e.op, e.pool, e.n_slots, e.n_pages) for e in c.batches[-1] if isinstance(e, ev.Alloc)]
    assert dec == [("alloc_decode", "full", 1, 1), ("alloc_decode", "swa", 1, 1)]

    w.free_swa_segment(t(a.row[0:8]), start_pos=0)
    fr = [e for e in c.batches[-1] if isinstance(e, ev.Free)]
    assert [(e.op, e.pool, e.n_pages, e.rids) for e in fr] == [("free_swa_segment", "swa", 2, ("a",))]

    w.ledger["a"].swa_evicted_seqlen = 8
    batch = c.batches[-1]
    assert [type(e).__name__ for e in batch] == ["LedgerWrite", "SwaEvict"]
    lw, se = batch
    assert (lw.rid, lw.field, lw.old, lw.new) == ("a", "swa_evicted_seqlen", 0, 8)
    assert (se.rid, se.old, se.new, se.n_pages) == ("a", 0, 8, 2)
    assert se.seq == lw.seq + 1 and lw.step == se.step == w.step_count == 0

    n = len(c.batches)
    w.ledger["a"].swa_evicted_seqlen = 8  # unchanged: no event
    assert len(c.batches) == n
    w.ledger["a"].kv_committed_len = 20  # another field: a LedgerWrite only
    assert [(type(e).__name__, e.field, e.old, e.new) for e in c.batches[-1]] == [
        ("LedgerWrite", "kv_committed_len", 21, 20)
    ]
    w.ledger["a"].swa_evicted_seqlen = 10  # rejected: a ViolationEvent, no LedgerWrite, no SwaEvict
    assert [type(e).__name__ for e in c.batches[-1]] == ["ViolationEvent"]
    assert c.batches[-1][0].violation.invariant == "swa_evicted_seqlen_page_aligned"

    w.step()
    (sb,) = c.batches[-1]
    assert sb.step == 1 and sb.available == {"full": 16 - 6, "swa": 16 - 4}
    events = c.events
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    for batch, step in zip(c.batches, c.steps):
        assert {e.step for e in batch} == {step}


# -- a failing sink never changes what the caller sees ------------------------------------------------------------
def _drive(w, bare):
    """The same engine calls on the wrapped allocator and a bare twin; returns every result pair."""
    results = []

    def both(name, *args, **kwargs):
        rw = getattr(w, name)(*args, **kwargs)
        rb = getattr(bare, name)(*args, **kwargs)
        results.append((rw, rb))
        return rw

    reqs = [Req(f"r{i}") for i in range(4)]
    with w.batch([r.rid for r in reqs]):
        split_extend(reqs, [5, 8, 1, 12], both("alloc_extend", *extend_args(reqs, [5, 8, 1, 12])))
    for _ in range(6):
        with w.batch([r.rid for r in reqs]):
            out = both("alloc_decode", *decode_args(reqs))
        for r, s in zip(reqs, out.tolist()):
            r.row.append(s)
        w.step()
    both("free_segment", t(reqs[3].row[8:]), start_pos=8)
    del reqs[3].row[8:]
    both("free_group_begin")
    for r in reqs[:2]:
        both("free", t(r.row))
    both("free_group_end")
    w.release_request("r0")
    w.release_request("r1")
    big = Req("big")
    with w.batch(["big"]):
        assert both("alloc_extend", *extend_args([big], [200])) is None
    w.release_request("big")
    w.step()
    return results


@pytest.mark.parametrize("mode", ["record", "raise"])
def test_raising_sink_never_changes_results(mode):
    class Broken:
        name = "broken"

        def __call__(self, batch):
            raise ValueError("sink is down")

    c = Collector()
    inner, bare = paged(), paged()
    w = InstrumentedAllocator(inner, mode=mode, sinks=[Broken(), c])
    results = _drive(w, bare)
    for rw, rb in results:
        assert (rw is None and rb is None) or torch.equal(rw, rb)
    assert allocator_state(inner) == allocator_state(bare)
    assert list(w.violations) == []
    n_events = len(c.events)
    assert n_events > 20
    assert w.bus.dropped == {"broken": n_events, "collector": 0}
    assert w.bus.errors == {"broken": "ValueError: sink is down"}


def test_raising_sink_does_not_mask_an_invariant_violation():
    def broken(batch):
        raise RuntimeError("down")

    w = InstrumentedAllocator(paged(), mode="raise", sinks=[broken])
    a = Req("a")
    with w.batch(["a"]):
        split_extend([a], [5], w.alloc_extend(*extend_args([a], [5])))
    w.free(t(a.row))
    with pytest.raises(InvariantViolation) as info:
        w.free(t(a.row))
    assert info.value.invariant == "double_free"
    assert w.bus.errors == {"broken": "RuntimeError: down"}
    # alloc: LedgerUpdate, Alloc, PageUpdate; free: Free, LedgerUpdate, PageUpdate; double free: ViolationEvent.
    assert w.bus.dropped == {"broken": 7}


def test_refusing_sink_counts_every_event():
    c = Collector()
    w = InstrumentedAllocator(paged(), mode="record", sinks=[lambda batch: False, c])
    _scenario(w)
    w.step()
    assert w.bus.dropped == {"<lambda>": len(c.events), "collector": 0}
    assert len(c.events) == 7
    assert np.array_equal(c.events[0].slots, [0, 1])


# -- how events are built ----------------------------------------------------------------------------------------
def _kinds():
    return [c for c in vars(ev).values() if isinstance(c, type) and issubclass(c, ev.Event) and c is not ev.Event]


def _sample_fields(cls):
    import dataclasses

    out = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        if f.name in ("seq", "ts", "step"):
            continue
        out[f.name] = (f"v{i}", i)  # a distinct value per field
    return out


@pytest.mark.parametrize("cls", _kinds(), ids=lambda c: c.__name__)
def test_make_and_builder_build_what_the_constructor_builds(cls):
    import dataclasses
    import pickle

    names = [f.name for f in dataclasses.fields(cls)]
    fields = _sample_fields(cls)
    want = cls(seq=7, ts=1.5, step=3, **fields)
    built = [ev.make(cls, 7, 1.5, 3, dict(fields)), ev.builder(cls)(7, 1.5, 3, *fields.values())]
    # Only the fields without a default (the defaults as the constructor gives them).
    required = {
        f.name: fields[f.name]
        for f in dataclasses.fields(cls)
        if f.name in fields and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    want_d = cls(seq=7, ts=1.5, step=3, **required)
    built_d = [ev.make(cls, 7, 1.5, 3, dict(required)), ev.builder(cls)(7, 1.5, 3, *required.values())]
    for w, got in [(want, g) for g in built] + [(want_d, g) for g in built_d]:
        assert type(got) is cls
        assert got == w and repr(got) == repr(w)
        assert list(vars(got)) == names  # field order, as the constructor's __init__ leaves it
        assert vars(got) == vars(w)
        assert pickle.loads(pickle.dumps(got)) == w
        with pytest.raises(dataclasses.FrozenInstanceError):
            got.seq = 8


def test_step_boundary_default_is_fresh_per_event():
    a, b = ev.make(ev.StepBoundary, 1, 0.0, 0, {}), ev.builder(ev.StepBoundary)(2, 0.0, 0)
    c = ev.StepBoundary(seq=3, ts=0.0, step=0)
    assert a.available == b.available == c.available == {}
    assert a.available is not b.available and a.available is not c.available


class Keeper(Collector):
    """Keeps every event and, at delivery, a copy of every array it holds."""

    def __init__(self, event_types=None):
        super().__init__()
        self.copies: list = []
        if event_types is not None:
            self.event_types = frozenset(event_types)

    def __call__(self, batch):
        super().__call__(batch)
        for e in batch:
            self.copies.append({k: v.copy() for k, v in vars(e).items() if isinstance(v, np.ndarray)})


def _churn(w):
    """Batches that reuse request slots, decode (pages opened and continued), free, release and step."""
    for rnd in range(3):
        reqs = [Req(f"r{rnd}-{i}") for i in range(3)]
        rids = [r.rid for r in reqs]
        with w.batch(rids):
            split_extend(reqs, [3, 4, 5], w.alloc_extend(*extend_args(reqs, [3, 4, 5])))
        with w.batch(rids):  # several decodes in one block (they share the binding's slots), then one each
            for _ in range(3):
                out = w.alloc_decode(*decode_args(reqs))
                for r, s in zip(reqs, out.tolist()):
                    r.row.append(s)
                w.step()
        for _ in range(3):
            with w.batch(rids):
                out = w.alloc_decode(*decode_args(reqs))
            for r, s in zip(reqs, out.tolist()):
                r.row.append(s)
            w.step()
        w.free(t(reqs[0].row))
        w.free_group_begin()
        for r in reqs[1:]:
            w.free(t(r.row))
        w.free_group_end()
        for r in rids:
            w.release_request(r)
        w.step()


@pytest.mark.parametrize("make", [paged, swa], ids=["paged", "swa"])
def test_kept_events_never_change_and_share_only_read_only_arrays(make):
    """A sink may keep events: later calls (the same slots reused, ledger columns and page owners rewritten)
    must not change them. Arrays the wrapper shares between events (a batch's slots) are read-only; every
    writable array belongs to one event alone."""
    k = Keeper()
    w = InstrumentedAllocator(make(), mode="record", sliding_window=8, sinks=[k])
    k.alloc = w
    _churn(w)
    events = k.events
    kinds = {type(e).__name__ for e in events}
    assert {"LedgerUpdate", "PageUpdate", "Alloc", "Free", "RequestReleased", "StepBoundary"} <= kinds
    holders: dict[int, list] = {}
    for e, copies in zip(events, k.copies):
        for name, want in copies.items():
            got = getattr(e, name)
            assert got.dtype == want.dtype and np.array_equal(got, want), (e, name)
            holders.setdefault(id(got), []).append((got, e))
    for arrs in holders.values():
        if len(arrs) > 1:
            assert not arrs[0][0].flags.writeable, arrs[0][1]
        arr = arrs[0][0]
        # None of them is a view of the wrapper's own state.
        for p in w._w_pools.values():
            assert not np.shares_memory(arr, p.shadow.owner)
        for col in (w.ledger.allocated, w.ledger.committed, w.ledger.evicted):
            assert not np.shares_memory(arr, col)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))


def test_only_wanted_kinds_are_built_and_seq_stays_gap_free():
    k = Keeper(event_types={ev.LedgerUpdate, ev.RequestReleased})
    w = InstrumentedAllocator(paged(), mode="record", sinks=[k])
    k.alloc = w
    _churn(w)
    events = k.events
    assert {type(e) for e in events} == {ev.LedgerUpdate, ev.RequestReleased}
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    # The same run with a sink reading everything: the same LedgerUpdate/RequestReleased contents, in order.
    full = Keeper()
    w2 = InstrumentedAllocator(paged(), mode="record", sinks=[full])
    full.alloc = w2
    _churn(w2)

    def strip(es):
        return [
            (
                type(e).__name__,
                e.step,
                *[
                    (v.tolist() if isinstance(v, np.ndarray) else v)
                    for k_, v in vars(e).items()
                    if k_ not in ("seq", "ts")
                ],
            )
            for e in es
            if type(e) in (ev.LedgerUpdate, ev.RequestReleased)
        ]

    assert strip(events) == strip(full.events)


def test_a_sink_subscribed_on_the_bus_directly_gets_every_kind():
    c = Collector()
    w = InstrumentedAllocator(paged(), mode="record")
    w.bus.subscribe(c)
    c.alloc = w
    a, _b = _scenario(w)
    w.free(t(a.row))
    w.release_request("a")
    w.step()
    kinds = {type(e).__name__ for e in c.events}
    assert kinds == {"LedgerUpdate", "Alloc", "PageUpdate", "Free", "RequestReleased", "StepBoundary"}
    w.bus.unsubscribe(c)
    assert _shadow_deltas(w) == [None]


def test_a_refused_decode_is_timed_for_alloc_failed_alone():
    """No sink reads Alloc, one reads AllocFailed: a refused ``alloc_decode`` is still timed (the clock ticks once
    per reading: the call's duration is exactly one tick)."""
    k = Keeper(event_types={ev.AllocFailed})
    w = InstrumentedAllocator(paged(), mode="record", sinks=[k], clock=counting_clock())
    k.alloc = w
    a, b = Req("a"), Req("b")
    with w.batch(["a", "b"]):
        split_extend([a, b], [32, 32], w.alloc_extend(*extend_args([a, b], [32, 32])))  # every page
    with w.batch(["a", "b"]):
        assert w.alloc_decode(*decode_args([a, b])) is None  # both open a page: none is free
    failed = [e for e in k.events if type(e) is ev.AllocFailed]
    assert [(e.op, e.requested, e.available, e.duration) for e in failed] == [("alloc_decode", 2, 0, 1.0)]
    assert [e.seq for e in k.events] == list(range(1, len(k.events) + 1))


# -- RequestReleased: the per-request record at a request's end ---------------------------------------------------
_RECORD_OPS = ("alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail", "alloc_logical_only")


def _records_from_the_stream(events) -> dict:
    """What a consumer reading every event would keep per request: its record as the latest allocation's
    ``LedgerUpdate`` or checked ``LedgerWrite`` left it (a free's update does not count), and its decode
    allocations (``alloc_decode`` updates naming it)."""
    rec: dict = {}
    for e in events:
        if type(e) is ev.LedgerUpdate and e.op in _RECORD_OPS:
            for rid, a, c, x in zip(e.rids, e.allocated.tolist(), e.committed.tolist(), e.evicted.tolist()):
                r = rec.setdefault(rid, [0, 0, 0, 0])
                r[:3] = [a, c, x]
                r[3] += e.op == "alloc_decode"
        elif type(e) is ev.LedgerWrite:
            r = rec.setdefault(e.rid, [0, 0, 0, 0])
            r[("kv_allocated_len", "kv_committed_len", "swa_evicted_seqlen").index(e.field)] = e.new
    return rec


@pytest.mark.parametrize("make", [paged, swa], ids=["paged", "swa"])
def test_request_released_carries_the_record_its_allocations_left_and_its_decode_steps(make):
    """Requests torn down by frees before their release: ``RequestReleased`` carries the record as their
    allocations left it (not the zeros the frees left) and every decode that included them."""
    k = Keeper()
    w = InstrumentedAllocator(make(), mode="record", sliding_window=8, sinks=[k])
    k.alloc = w
    _churn(w)
    released = [e for e in k.events if type(e) is ev.RequestReleased]
    assert len(released) == 9
    want = _records_from_the_stream(k.events)
    for e in released:
        assert [e.allocated, e.committed, e.evicted, e.decode_steps] == want[e.rid], e
        assert e.decode_steps == 6 and e.committed > 0
    # A sink reading RequestReleased alone gets the same records (nothing else need be built for them).
    only = Keeper(event_types={ev.RequestReleased})
    w2 = InstrumentedAllocator(make(), mode="record", sliding_window=8, sinks=[only])
    _churn(w2)
    assert _strip(only.events) == _strip(released)


@pytest.mark.parametrize("make", [paged, swa], ids=["paged", "swa"])
def test_records_are_kept_through_frees_only_while_a_sink_reads_request_released(make):
    """With no sink reading ``RequestReleased`` the frees save no record (nothing would read it); a sink that
    subscribes later gets the records of the requests torn down from then on."""
    w = InstrumentedAllocator(make(), mode="record", sliding_window=8)
    _churn(w)
    assert w.ledger.keep_records is False and w.ledger.kept == {}
    k = Keeper(event_types={ev.RequestReleased})
    w.subscribe(k)
    assert w.ledger.keep_records is True
    _churn(w)
    released = [e for e in k.events if type(e) is ev.RequestReleased]
    assert len(released) == 9
    assert all(e.decode_steps == 6 and e.committed > 0 for e in released)
    w.unsubscribe(k)
    assert w.ledger.keep_records is False and w.ledger.kept == {}


def _strip(es) -> list:
    """Events without seq and their clock readings (``CLOCK_FIELDS``), arrays as lists."""
    return [
        (
            type(e).__name__,
            *[
                (v.tolist() if isinstance(v, np.ndarray) else v)
                for k, v in vars(e).items()
                if k != "seq" and k not in ev.CLOCK_FIELDS
            ],
        )
        for e in es
    ]


def test_a_retracted_request_keeps_counting_and_its_record_is_its_latest_allocations():
    """A request retracted (every page freed), prefilled again and torn down: its record is the second
    prefill's and decodes' values, its decode steps those of both lives; a checked write made after the
    teardown frees is part of the record, a decode after a partial free replaces what the free saved."""
    k = Keeper(event_types={ev.RequestReleased})
    w = InstrumentedAllocator(paged(), mode="record", sinks=[k])
    a = Req("a")

    def decode(n):
        for _ in range(n):
            with w.batch(["a"]):
                a.row += w.alloc_decode(*decode_args([a])).tolist()

    with w.batch(["a"]):
        split_extend([a], [6], w.alloc_extend(*extend_args([a], [6])))
    decode(3)  # 9 tokens, 3 pages
    w.free(t(a.row))  # retracted: the ledger row is zeroed
    assert w.ledger["a"].kv_allocated_len == 0
    a.row = []
    with w.batch(["a"]):
        split_extend([a], [10], w.alloc_extend(*extend_args([a], [10])))  # re-prefill: 10 tokens, 3 pages
    decode(2)  # 12 tokens
    w.free(t(a.row[8:]))  # the last page: the lengths shrink to 8
    a.row = a.row[:8]
    assert (w.ledger["a"].kv_allocated_len, w.ledger["a"].kv_committed_len) == (8, 8)
    decode(1)  # 9 tokens again: a third page; the decode's values are the record now (12, 9)
    w.free(t(a.row[8:]))
    a.row = a.row[:8]
    w.ledger["a"].kv_committed_len = 7  # a checked write after a free: part of the record
    w.free(t(a.row))
    w.release_request("a")
    (e,) = k.events
    assert (e.rid, e.pages_held, e.allocated, e.committed, e.evicted, e.decode_steps) == ("a", 0, 12, 7, 0, 6)


def test_plain_allocs_of_one_slot_per_request_count_as_decode_steps():
    """Page size 1 (SGLang decodes with a plain ``alloc``): one slot for a request already holding KV is a decode
    step; a request's first slot, or a share of several slots, is not."""
    from instrumented_alloc.allocators import TokenToKVPoolAllocator

    k = Keeper(event_types={ev.RequestReleased})
    w = InstrumentedAllocator(TokenToKVPoolAllocator(64, F16, "cpu", None, False), mode="record", sinks=[k])
    with w.batch(["a", "b", "c"], lens=[3, 1, 2]):
        w.alloc(6)  # prefills (c's share of two slots included)
    for _ in range(2):
        with w.batch(["a", "b", "c"]):
            w.alloc(3)  # a decode of each
    with w.batch(["a", "b", "d"], lens=[1, 2, 1]):
        w.alloc(4)  # a: a decode; b: two slots; d: its first slot
    with w.batch(["d"]):
        w.alloc(1)  # d: a decode
    for rid in "abcd":
        w.release_request(rid)  # still holding their pages: leaks (record mode), the records as they are
    steps = {e.rid: (e.decode_steps, e.allocated, e.committed) for e in k.events}
    assert steps == {"a": (3, 6, 6), "b": (2, 5, 5), "c": (2, 4, 4), "d": (1, 2, 2)}
