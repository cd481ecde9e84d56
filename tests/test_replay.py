"""``instrumented_alloc.replay`` on hand-made events: page and ledger updates, the base/seq rule, ``state_at``'s
choice of base and end, lost events, and one round trip through a real wrapper's events and snapshots."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from instrumented_alloc import InstrumentedAllocator, Violation
from instrumented_alloc import events as ev
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from instrumented_alloc.replay import (
    EventsLost,
    IncompleteHistory,
    LedgerRow,
    ReplayState,
    apply,
    initial_owner,
    initial_state,
    state_at,
    state_from_snapshots,
)
from instrumented_alloc.shadow import FREE, PRISTINE, RESERVED, STAGED
from tests.engine_model import Req, decode_args, extend_args, t


def page(seq, pages, owners, pool="full", step=0):
    return ev.PageUpdate(
        seq=seq, ts=0.0, step=step, op="x", pool=pool, pages=np.asarray(pages, np.int64), owners=np.asarray(owners)
    )


def ledger(seq, rows, step=0):
    """rows: (rid, slot, allocated, committed, evicted)."""
    rids, slots, a, c, e = zip(*rows)
    arr = lambda x: np.asarray(x, np.int64)  # noqa: E731
    return ev.LedgerUpdate(
        seq=seq,
        ts=0.0,
        step=step,
        op="x",
        rids=rids,
        slots=arr(slots),
        allocated=arr(a),
        committed=arr(c),
        evicted=arr(e),
    )


def boundary(seq, step):
    return ev.StepBoundary(seq=seq, ts=0.0, step=step)


def test_initial_owner_is_a_cleared_pool():
    o = initial_owner(5)
    assert o.dtype == np.int32 and o.shape == (6,)
    assert o[0] == RESERVED and (o[1:] == PRISTINE).all()
    assert initial_owner(0).tolist() == [RESERVED]
    with pytest.raises(ValueError, match="num_pages"):
        initial_owner(-1)
    s = initial_state({"full": 3, "swa": 2}, step=4, seq=9)
    assert (
        s.step == 4
        and s.seq == 9
        and s.ledger == {}
        and {k: v.size for k, v in s.owners.items()} == {"full": 4, "swa": 3}
    )


def test_page_updates_apply_in_order_and_do_not_touch_the_input():
    base = initial_state({"full": 6, "swa": 6})
    evs = [page(1, [1, 2, 3], 0), page(2, [2], FREE), page(3, [2, 5], [1, 1]), page(4, [1], 7, pool="swa")]
    s = apply(base, evs)
    assert s.owners["full"].tolist() == [RESERVED, 0, 1, 0, PRISTINE, 1, PRISTINE]
    assert s.owners["swa"].tolist() == [RESERVED, 7, *[PRISTINE] * 5]
    assert s.seq == 4
    assert base.seq == 0 and (base.owners["full"][1:] == PRISTINE).all()  # not mutated
    same = apply(base, evs, inplace=True)
    assert same is base and base.seq == 4


def test_events_at_or_before_the_base_seq_are_skipped():
    base = initial_state({"full": 4}, seq=2)
    s = apply(base, [page(1, [1], 0), page(2, [2], 0), page(3, [3], STAGED)])
    assert s.owners["full"].tolist() == [RESERVED, PRISTINE, PRISTINE, STAGED, PRISTINE]


def test_ledger_updates_writes_and_releases():
    s = apply(
        initial_state({"full": 4}),
        [
            ledger(1, [("a", 0, 8, 5, 0), ("b", 1, 4, 4, 0)]),
            ev.LedgerWrite(seq=2, ts=0.0, step=0, rid="a", field="swa_evicted_seqlen", old=0, new=4),
            ev.LedgerWrite(seq=3, ts=0.0, step=0, rid="c", field="kv_allocated_len", old=0, new=12),
            ev.RequestReleased(seq=4, ts=0.0, step=0, rid="b", pages_held=0),
            boundary(5, 1),
        ],
    )
    assert s.ledger == {"a": LedgerRow(8, 5, 4), "c": LedgerRow(12, 0, 0)}
    assert s.slot_rids == {0: "a", 1: "b"}  # a released slot keeps its name until reused
    assert s.step == 1 and s.seq == 5
    s2 = apply(s, [ledger(6, [("d", 1, 4, 1, 0)])])
    assert s2.slot_rids[1] == "d" and s2.ledger["d"] == (4, 1, 0)


def test_other_events_leave_the_state_alone():
    base = initial_state({"full": 3})
    viol = ev.ViolationEvent(seq=2, ts=0.0, step=0, violation=Violation("double_free", "m"))
    s = apply(base, [ev.Alloc(seq=1, ts=0.0, step=0, op="alloc", pool="full", n_slots=4, n_pages=1), viol])
    assert s.seq == 2 and (s.owners["full"] == base.owners["full"]).all() and s.ledger == {}


def test_a_page_update_of_every_page_is_a_clear_or_resize():
    s = apply(initial_state({"full": 4}), [page(1, [1, 2], 0), ledger(2, [("a", 0, 8, 7, 0)])])
    cleared = initial_owner(4)
    s = apply(s, [page(3, np.arange(5), cleared)])
    assert s.owners["full"].tolist() == cleared.tolist()
    assert s.ledger == {"a": (0, 0, 0)}  # live requests keep their rows, zeroed (as the wrapper's clear() does)
    resized = initial_owner(7)
    s = apply(s, [page(4, np.arange(8), resized), page(5, [7], 0)])
    assert s.owners["full"].size == 8 and s.owners["full"][7] == 0
    # Not every page (page 0 missing): an ordinary update.
    s = apply(s, [page(6, np.arange(1, 8), FREE)])
    assert s.owners["full"].size == 8 and s.owners["full"][0] == RESERVED


def test_bad_events_are_refused():
    base = initial_state({"full": 3})
    with pytest.raises(ValueError, match="unknown pool 'swa'"):
        apply(base, [page(1, [1], 0, pool="swa")])
    with pytest.raises(ValueError, match="outside pool"):
        apply(base, [page(1, [4], 0)])
    with pytest.raises(ValueError, match="unknown ledger field"):
        apply(base, [ev.LedgerWrite(seq=1, ts=0.0, step=0, rid="a", field="nope", old=0, new=1)])


def test_lost_events_stop_replay():
    lost = EventsLost(seq=9, ts=0.0, step=3, first_seq=5, last_seq=9, n_events=5)
    with pytest.raises(IncompleteHistory, match="5 events"):
        apply(initial_state({"full": 3}), [page(1, [1], 0), lost])
    # A base after the marker is not affected.
    assert apply(initial_state({"full": 3}, seq=9), [lost, page(10, [1], 0)]).owners["full"][1] == 0


def test_wrapper_snapshot_event_replaces_pool_and_ledger():
    owner = np.array([RESERVED, 3, FREE], np.int32)
    snap = ev.Snapshot(
        seq=3,
        ts=0.0,
        step=1,
        pool="full",
        page_size=4,
        num_pages=2,
        owner=owner.astype("<i4").tobytes(),
        rids=((3, "z"),),
        ledger=(("z", 4, 3, 0),),
    )
    s = apply(apply(initial_state({"full": 2}), [ledger(1, [("a", 0, 4, 4, 0)])]), [snap])
    assert s.owners["full"].tolist() == owner.tolist() and s.ledger == {"z": (4, 3, 0)} and s.slot_rids[3] == "z"


def test_snapshot_events_of_two_pools_keep_both_pools_slot_names():
    """The wrapper's Snapshot events of an SWA allocator, one per pool, replayed in turn: the swa pool's does not
    drop the names of slots only the full pool holds (b, whose SWA pages were all released)."""
    w = InstrumentedAllocator(
        SWATokenToKVPoolAllocator(128, 128, 4, torch.float16, "cpu"), sliding_window=4, snapshot_every=1
    )
    seen: list = []
    w.subscribe(seen.extend)
    a, b = Req("a"), Req("b")
    with w.batch(["a"]):
        a.row = w.alloc_extend(*extend_args([a], [8])).tolist()
    with w.batch(["b"]):
        b.row = w.alloc_extend(*extend_args([b], [8])).tolist()
    w.free_swa(t(b.row))  # all of b's SWA KV released; its full pages stay with it
    w.step()
    snaps = [e for e in seen if isinstance(e, ev.Snapshot)]
    assert [(e.pool, e.rids) for e in snaps] == [("full", ((0, "a"), (1, "b"))), ("swa", ((0, "a"),))]
    s = apply(initial_state({"full": 32, "swa": 32}), snaps)
    assert s.slot_rids == {0: "a", 1: "b"}
    assert s.rids_in("full") == {0: "a", 1: "b"} and s.rids_in("swa") == {0: "a"}
    assert s.ledger == {"a": (8, 8, 0), "b": (8, 8, 0)}
    live = w.snapshot()
    assert (s.owners["full"] == live["full"].owner).all() and (s.owners["swa"] == live["swa"].owner).all()


def test_state_at_uses_the_newest_base_and_stops_at_the_boundary():
    b0 = initial_state({"full": 4})
    evs = [page(1, [1], 0, step=0), boundary(2, 1), page(3, [2], 0, step=1), boundary(4, 2), page(5, [3], 0, step=2)]
    b2 = apply(b0, evs[:4])  # a snapshot taken at step 2's boundary (seq 4)
    b2.owners["full"][4] = 42  # marks which base was used
    s1 = state_at([b0, b2], evs, 1)
    assert s1.step == 1 and s1.seq == 2 and s1.owners["full"].tolist() == [RESERVED, 0, PRISTINE, PRISTINE, PRISTINE]
    s2 = state_at([b0, b2], evs, 2)
    assert s2.owners["full"][4] == 42 and s2.owners["full"][3] == PRISTINE  # seq 5 is after step 2's boundary
    assert state_at([b0, b2], evs, 0).seq == 0  # a base of that step, no boundary needed
    with pytest.raises(ValueError, match="step 3"):
        state_at([b0, b2], evs, 3)
    late = ReplayState(step=1, seq=2, owners={"full": initial_owner(4)})
    with pytest.raises(ValueError, match="no base"):
        state_at([b2], evs, 1)
    assert state_at([late], evs, 1).seq == 2


def _wrapper_with_two_requests(verify: str = "auto"):
    """A wrapper publishing into a list, its base state, and requests a (5 tokens) and b (9) extended at step 1."""
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu", None, False), verify=verify)
    seen: list = []
    w.subscribe(seen.extend)
    base = state_from_snapshots(w.snapshot(), seq=0)
    a, b = Req("a"), Req("b")
    with w.batch(["a", "b"]):
        out = w.alloc_extend(*extend_args([a, b], [5, 9]))
    a.row, b.row = out[:5].tolist(), out[5:].tolist()
    w.step()
    return w, seen, base, a, b


def test_round_trip_through_a_wrapper():
    """A base from alloc.snapshot() plus the wrapper's published events reproduces every later snapshot."""
    w, seen, base, a, b = _wrapper_with_two_requests()
    with w.batch(["a", "b"]):
        out = w.alloc_decode(*decode_args([a, b]))
    a.row.append(int(out[0]))
    w.step()
    snap2 = w.snapshot()
    w.free(t(b.row))
    w.release_request("b")
    w.step()
    snap3 = w.snapshot()
    for snap, step in ((snap2, 2), (snap3, 3)):
        s = state_at([base], seen, step)
        assert (s.owners["full"] == snap["full"].owner).all()
        led = snap["full"].ledger
        assert s.ledger == {
            r: (int(x), int(y), int(z)) for r, x, y, z in zip(led.rids, led.allocated, led.committed, led.evicted)
        }
        assert s.rids_in("full") == snap["full"].slot_rids
    again = state_from_snapshots(snap3, seq=seen[-1].seq)
    assert again.step == 3 and again.ledger == {"a": (8, 6, 0)}


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
def test_round_trip_through_a_leak_freed_later(verify):
    """A request released while holding pages (request_leak), whose pages the engine frees afterwards: the free
    publishes no ledger row for it (it has none any more), so replay does not bring the released request back."""
    w, seen, base, a, _ = _wrapper_with_two_requests(verify)
    w.release_request("a")  # a's pages leaked
    w.step()
    w.free(t(a.row))  # and freed later
    w.step()
    assert [v.invariant for v in w.violations] == ["request_leak"]
    released = next(e.seq for e in seen if isinstance(e, ev.RequestReleased) and e.rid == "a")
    assert not [e for e in seen if isinstance(e, ev.LedgerUpdate) and e.seq > released and "a" in e.rids]
    snap = w.snapshot()
    s = state_at([base], seen, 3)
    assert (s.owners["full"] == snap["full"].owner).all()
    led = snap["full"].ledger
    assert s.ledger == {
        r: (int(x), int(y), int(z)) for r, x, y, z in zip(led.rids, led.allocated, led.committed, led.evicted)
    } == {"b": (12, 9, 0)}


def test_decodes_updates_set_the_rows_they_list():
    """A run of decodes of one batch (one ``LedgerUpdate`` each) and a free, replayed, give the live ledger and
    the page owners."""
    inner = PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu", None, False)
    w = InstrumentedAllocator(inner, mode="record")
    base = state_from_snapshots(w.snapshot(), seq=0)
    seen: list = []

    class Ledger:
        name = "ledger"
        event_types = frozenset({ev.PageUpdate, ev.LedgerUpdate, ev.RequestReleased, ev.StepBoundary})

        def __call__(self, batch):
            seen.extend(batch)

    w.subscribe(Ledger())
    a, b = Req("a"), Req("b")
    with w.batch(["a", "b"]):
        rows = w.alloc_extend(*extend_args([a, b], [5, 7])).tolist()
    a.row, b.row = rows[:5], rows[5:]
    for _ in range(6):
        with w.batch(["a", "b"]):
            out = w.alloc_decode(*decode_args([a, b])).tolist()
        a.row.append(out[0])
        b.row.append(out[1])
        w.step()
    assert sum(type(e) is ev.LedgerUpdate and e.op == "alloc_decode" for e in seen) == 6
    w.free(t(b.row))
    s = apply(base, seen)
    led = w.snapshot()["full"].ledger
    live = zip(led.rids, led.allocated, led.committed, led.evicted)
    assert s.ledger == {r: (int(x), int(y), int(z)) for r, x, y, z in live}
    assert s.ledger["a"] == (12, 11, 0) and s.ledger["b"] == (0, 0, 0)
    assert (s.owners["full"] == w.snapshot()["full"].owner).all()


def test_a_request_named_again_at_another_slot_is_read_at_its_new_slot():
    # Slot 5 is first named by x; a is named at slot 7, released, and prefilled again at slot 5 (a retraction, its
    # old slot's name left behind in slot_rids). The request's slot is where it was last named: to_snapshots gives
    # a slot 5 (the dict of names read backwards gave the stale 7, and the figures then counted a's pages wrong).
    from instrumented_alloc.replay import to_snapshots

    st = initial_state({"full": 8})
    events = [
        ledger(1, [("x", 5, 4, 4, 0)]),
        ev.RequestReleased(seq=2, ts=0.0, step=0, rid="x", pages_held=0),
        ledger(3, [("a", 7, 4, 4, 0)]),
        ev.RequestReleased(seq=4, ts=0.0, step=0, rid="a", pages_held=0),
        ledger(5, [("a", 5, 8, 6, 0)]),
        page(6, [1, 2], [5, 5]),
    ]
    st = apply(st, events)
    assert st.slot_rids == {5: "a", 7: "a"} and st.rid_slots == {"a": 5}
    snap = to_snapshots(st, page_size=4)["full"]
    assert snap.ledger.rids == ("a",) and snap.ledger.slots.tolist() == [5]
    assert st.copy().rid_slots == {"a": 5}
