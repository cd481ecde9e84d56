"""Threads and deferred verification.

Threads: every instrumented call holds the wrapper's lock, so calls from several threads are serialised and
keep working; ``batch()`` binding belongs to the calling thread (``batch()`` docstring: "calls from another
thread are not attributed to it"), so two threads may bind at once, each to its own requests, and an unbound
call from one thread is never attributed to another thread's binding. Binding still does not nest within one
thread (RuntimeError "already inside a batch() block").

Deferred (``verify="deferred"``, the accelerator path forced on the CPU): slot-tier faults are not reported at
the call but at the next ``step()`` / ``flush()`` / ``check_consistency()``, with the same id and message as in
immediate mode, from copies taken at the call (the caller may reuse its index tensor).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading

import pytest
import torch

from instrumented_alloc import InstrumentedAllocator, InvariantViolation
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from tests.engine_model import Req, allocator_state, decode_args, extend_args, split_extend, t

F16 = torch.float16
PS = 4
ITERATIONS = 200


def paged(pages: int = 64):
    return PagedTokenToKVPoolAllocator(pages * PS, PS, F16, "cpu", None, False)


def run_threads(*targets, timeout: float = 60.0) -> None:
    errors: list[BaseException] = []

    def wrap(fn):
        def body():
            try:
                fn()
            except BaseException as exc:  # reported in the main thread
                errors.append(exc)

        return body

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
        assert not th.is_alive(), "thread did not finish"
    if errors:
        raise errors[0]


# -- threads -----------------------------------------------------------------------------------------------------
@pytest.fixture
def fast_switching():
    """Switch threads every few microseconds so that the two engines' calls really interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


def test_unbound_calls_from_two_threads_are_serialised_and_clean(fast_switching):
    inner = paged()
    w = InstrumentedAllocator(inner, mode="raise", verify="immediate")
    total = inner.available_size()
    done = []
    order = []
    start = threading.Barrier(2)

    def engine(tag: str):
        def loop():
            start.wait(10)
            for i in range(ITERATIONS):
                order.append(tag)
                r = Req(f"{tag}{i}")
                n = 1 + (i % 7)
                split_extend([r], [n], w.alloc_extend(*extend_args([r], [n])))
                for _ in range(1 + i % 3):
                    out = w.alloc_decode(*decode_args([r]))
                    r.row.append(int(out[0]))
                assert len(r.row) == n + 1 + i % 3
                w.free(t(r.row))
                if i % 50 == 0:
                    w.step()
            done.append(tag)

        return loop

    run_threads(engine("x"), engine("y"))
    assert sorted(done) == ["x", "y"]
    switches = sum(1 for p, q in itertools.pairwise(order) if p != q)
    assert switches >= 2, "the two engines did not interleave"
    w.step()
    assert w.check_consistency() == []
    assert list(w.violations) == []
    assert inner.available_size() == total
    assert len(w.ledger) == 0  # unbound: nothing attributed


@pytest.mark.parametrize("serialised", [False, True], ids=["free-running", "engine-lock"])
def test_bound_calls_from_two_threads(fast_switching, serialised):
    """Each call inside its own ``with alloc.batch([rid])`` on two threads at once (binding is per thread), or
    with the engine serialising its own batch() blocks: requests, ledgers and releases stay per thread, clean."""
    inner = paged()
    w = InstrumentedAllocator(inner, mode="raise", verify="immediate")
    total = inner.available_size()
    engine_lock = threading.Lock() if serialised else contextlib.nullcontext()
    peaks = {}

    def engine(tag: str):
        def loop():
            for i in range(ITERATIONS):
                rid = f"{tag}{i}"
                r = Req(rid)
                n = 1 + (i % 9)
                with engine_lock, w.batch([rid]):
                    split_extend([r], [n], w.alloc_extend(*extend_args([r], [n])))
                with engine_lock, w.batch([rid]):
                    r.row.append(int(w.alloc_decode(*decode_args([r]))[0]))
                kv = w.ledger[rid]
                assert (kv.kv_allocated_len, kv.kv_committed_len) == (-(-(n + 1) // PS) * PS, n + 1)
                w.free(t(r.row))
                assert w.ledger[rid].kv_allocated_len == 0
                w.release_request(rid)
                if i % 40 == 0:
                    w.step()
            peaks[tag] = True

        return loop

    run_threads(engine("p"), engine("q"))
    assert sorted(peaks) == ["p", "q"]
    w.step()
    assert w.check_consistency() == []
    assert list(w.violations) == []
    assert inner.available_size() == total
    assert len(w.ledger) == 0


def test_two_threads_bind_at_once_each_to_its_own_requests():
    inner = paged()
    w = InstrumentedAllocator(inner, mode="record")
    a_bound, b_done = threading.Event(), threading.Event()
    outcome = {}
    a, b = Req("a"), Req("b")

    def first():
        with w.batch(["a"]):
            a_bound.set()
            assert b_done.wait(10)
            split_extend([a], [5], w.alloc_extend(*extend_args([a], [5])))

    def second():
        assert a_bound.wait(10)
        try:
            with w.batch(["b"]):  # while the first thread is inside its own batch() block
                outcome["bound"] = True
                split_extend([b], [3], w.alloc_extend(*extend_args([b], [3])))
        except RuntimeError as exc:
            outcome["error"] = str(exc)
        finally:
            b_done.set()

    run_threads(first, second)
    assert outcome == {"bound": True}
    assert (w.ledger["a"].kv_allocated_len, w.ledger["a"].kv_committed_len) == (8, 5)
    assert (w.ledger["b"].kv_allocated_len, w.ledger["b"].kv_committed_len) == (4, 3)
    snap = w.snapshot()["full"]
    assert snap.owner[1:4].tolist() == [w.ledger["b"].slot, w.ledger["a"].slot, w.ledger["a"].slot]
    w.step()
    assert list(w.violations) == []


def test_binding_still_does_not_nest_within_one_thread():
    w = InstrumentedAllocator(paged(), mode="record")
    outcome = {}

    def body():
        with w.batch(["a"]):
            try:
                with w.batch(["b"]):
                    outcome["nested"] = True
            except RuntimeError as exc:
                outcome["error"] = str(exc)

    run_threads(body)
    assert outcome == {"error": "batch(): already inside a batch() block (binding does not nest)"}


@pytest.mark.parametrize("bound", [("a",), ("a", "b")])
def test_unbound_call_from_another_thread_ignores_a_foreign_binding(bound):
    inner = paged()
    w = InstrumentedAllocator(inner, mode="record")
    inside, release = threading.Event(), threading.Event()
    outcome = {}

    def first():
        with w.batch(list(bound)):
            inside.set()
            assert release.wait(10)

    def second():
        assert inside.wait(10)
        try:
            c = Req("c")
            outcome["out"] = w.alloc_extend(*extend_args([c], [5])).tolist()
        except ValueError as exc:
            outcome["error"] = str(exc)
        finally:
            release.set()

    run_threads(first, second)
    assert outcome == {"out": [4, 5, 6, 7, 8]}
    assert list(w.violations) == []
    # Not attributed to the first thread's requests: their ledgers and page counts stay empty.
    for rid in bound:
        kv = w.ledger[rid]
        assert (kv.kv_allocated_len, kv.kv_committed_len) == (0, 0)
        assert int(w.ledger.owned["full"][kv.slot]) == 0
    assert w.snapshot()["full"].owner[1:3].tolist() == [-1, -1]  # used, unattributed
    w.step()
    assert list(w.violations) == []


# -- deferred verification ---------------------------------------------------------------------------------------
def _double_free_script(w):
    a, b = Req("a"), Req("b")
    with w.batch(["a", "b"]):
        split_extend([a, b], [6, 5], w.alloc_extend(*extend_args([a, b], [6, 5])))
    w.step()
    w.free(t(a.row))
    w.free(t(a.row))
    return a, b


class _Bare:
    """A bare allocator with the wrapper-only API stubbed, to run the same script."""

    def __init__(self, inner):
        self.inner = inner

    def batch(self, rids):
        return contextlib.nullcontext()

    def step(self):
        pass

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_deferred_double_free_reported_at_next_step_like_immediate():
    imm = InstrumentedAllocator(paged(), mode="record", verify="immediate")
    _double_free_script(imm)
    assert [v.invariant for v in imm.violations] == ["double_free"]
    (vi,) = imm.violations
    assert vi.step == 1

    inner, bare = paged(), paged()
    dfr = InstrumentedAllocator(inner, mode="record", verify="deferred")
    assert dfr.deferred is True
    bare_twin = _Bare(bare)
    _double_free_script(dfr)
    _double_free_script(bare_twin)
    assert list(dfr.violations) == []  # not at the call
    dfr.step()
    (vd,) = dfr.violations
    assert (vd.invariant, vd.message, vd.op, vd.pool, vd.rid) == (vi.invariant, vi.message, vi.op, vi.pool, vi.rid)
    assert vd.message.startswith("free frees [1, 2] (2 pages) that are not in use (page 1 is free")
    assert vd.step == 2  # detected at the boundary
    assert allocator_state(inner) == allocator_state(bare_twin.inner)  # record mode forwarded both frees
    dfr.step()
    assert len(dfr.violations) == 1  # reported once


@pytest.mark.parametrize("boundary", ["flush", "check_consistency"])
def test_deferred_double_free_reported_at_flush_or_sweep(boundary):
    w = InstrumentedAllocator(paged(), mode="record", verify="deferred")
    _double_free_script(w)
    assert list(w.violations) == []
    getattr(w, boundary)()
    assert [(v.invariant, v.op, v.step) for v in w.violations] == [("double_free", "free", 1)]


def test_deferred_checks_see_the_values_at_the_call():
    inner = paged()
    w = InstrumentedAllocator(inner, mode="record", verify="deferred")
    a, b = Req("a"), Req("b")
    with w.batch(["a", "b"]):
        out = w.alloc_extend(*extend_args([a, b], [6, 9]))
    split_extend([a, b], [6, 9], out)
    out.fill_(0)  # the engine reuses the returned buffer before the boundary
    req_to_token = torch.zeros((2, 16), dtype=torch.int64)
    req_to_token[0, :6] = t(a.row)
    row = req_to_token[0, :6]  # a view of the engine's table, as SGLang passes it
    w.free(row)
    row.fill_(0)  # the slot table row is reused at once (a new request lands in it)
    assert list(w.violations) == []
    w.step()
    # Had the check read the overwritten values it would see slot 0 (reserved_page_touched) / page 0.
    assert list(w.violations) == []
    snap = w.snapshot()["full"]
    slot_a, slot_b = w.ledger["a"].slot, w.ledger["b"].slot
    assert int((snap.owner == slot_a).sum()) == 0
    assert int((snap.owner == slot_b).sum()) == 3
    assert snap.owner[[1, 2]].tolist() == [-6, -6]  # a's pages are free again
    w.free(t(b.row))
    w.release_request("a")
    w.release_request("b")
    assert w.check_consistency() == []
    assert list(w.violations) == []


def test_deferred_swa_free_with_reused_tensor():
    inner = SWATokenToKVPoolAllocator(64, 64, PS, F16, "cpu", None, False)
    w = InstrumentedAllocator(inner, mode="raise", verify="deferred", sliding_window=8)
    a = Req("a")
    with w.batch(["a"]):
        split_extend([a], [20], w.alloc_extend(*extend_args([a], [20])))
    seg = t(a.row[0:8])
    w.free_swa_segment(seg, start_pos=0)
    seg.fill_(0)
    w.ledger["a"].swa_evicted_seqlen = 8
    w.step()
    full = t(a.row)
    w.free(full)
    full.fill_(0)
    w.release_request("a")
    w.step()
    assert w.check_consistency() == []
    assert list(w.violations) == []


def test_deferred_raise_mode_raises_at_step():
    inner = paged()
    w = InstrumentedAllocator(inner, mode="raise", verify="deferred")
    _double_free_script(w)  # the call itself does not raise: its indices are not checked yet
    with pytest.raises(InvariantViolation) as info:
        w.step()
    assert info.value.invariant == "double_free"
    assert info.value.violation is w.violations[-1]
    assert info.value.violation.message.startswith("free frees [1, 2] (2 pages) that are not in use (page 1 is free")
    assert w.step_count == 2
    w.step()  # nothing new
    assert len(w.violations) == 1


def test_deferred_raise_mode_raises_at_flush():
    w = InstrumentedAllocator(paged(), mode="raise", verify="deferred")
    _double_free_script(w)
    with pytest.raises(InvariantViolation, match="double_free"):
        w.flush()


def test_immediate_raise_mode_refuses_at_the_call_for_comparison():
    inner = paged()
    w = InstrumentedAllocator(inner, mode="raise", verify="immediate")
    a = Req("a")
    with w.batch(["a"]):
        split_extend([a], [6], w.alloc_extend(*extend_args([a], [6])))
    w.free(t(a.row))
    state = allocator_state(inner)
    with pytest.raises(InvariantViolation, match="double_free"):
        w.free(t(a.row))
    assert allocator_state(inner) == state  # immediate: refused before the inner


def _retract_and_reprefill(w, events):
    """A request prefilled, decoded twice, retracted (freed and released) and prefilled again under its id before
    the step boundary, as the demo engine's retraction does; returns the events' (kind, request ids) in order."""
    w.subscribe(events.append)
    a = Req("a")
    with w.batch(["a"]):
        split_extend([a], [6], w.alloc_extend(*extend_args([a], [6])))
        for _ in range(2):
            a.row.append(int(w.alloc_decode(*decode_args([a]))[0]))
    w.free(t(a.row))
    w.release_request("a")
    again = Req("a")
    with w.batch(["a"]):
        split_extend([again], [9], w.alloc_extend(*extend_args([again], [9])))
    w.step()
    out = []
    for batch in events:
        for e in batch:
            rids = getattr(e, "rids", None) or ((e.rid,) if hasattr(e, "rid") else ())
            if type(e).__name__ in ("LedgerUpdate", "RequestReleased", "Alloc"):
                out.append((type(e).__name__, getattr(e, "op", "release"), tuple(rids)))
    return out


def test_deferred_release_of_a_reused_id_comes_before_the_new_requests_events():
    # Deferred verification checks a release later, but a request that takes its id again is bound after the
    # queued release has been verified (what landed is verified at the binding): the sinks see the release before
    # the new request's events, in the order immediate verification gives them (spans and replay key by id).
    imm = _retract_and_reprefill(InstrumentedAllocator(paged(), mode="record", verify="immediate"), [])
    dfr_w = InstrumentedAllocator(paged(), mode="record", verify="deferred")
    dfr = _retract_and_reprefill(dfr_w, [])
    assert dfr == imm
    release = dfr.index(("RequestReleased", "release", ("a",)))
    assert ("LedgerUpdate", "alloc_extend", ("a",)) in dfr[release + 1 :]
    assert list(dfr_w.violations) == [] and dfr_w.ledger["a"].kv_committed_len == 9


def _ledger_write_race(trial: int) -> tuple[list, list]:
    """One round: thread A writes request a's committed length and reads it back until thread B has bound three
    batches of new requests (the ledger's columns grow under the wrapper's lock) and stepped. Returns the writes
    read back wrong and the violations."""
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(256, 4, torch.float16, "cpu"), mode="record")
    with w.batch(["a"]):
        w.alloc_extend(t([0]), t([0]), t([64]), t([64]), t([-1]), 64)
    kv = w.ledger["a"]
    go, done = threading.Event(), threading.Event()
    lost: list = []

    def writer():
        v = 0
        go.wait()
        while not done.is_set():
            v = v % 64 + 1
            kv.kv_committed_len = v
            got = kv.kv_committed_len
            if got != v:
                lost.append((trial, v, got))
                return

    def binder():
        go.set()
        for k in range(3):
            with w.batch([f"n{trial}-{k}-{j}" for j in range(300 * (k + 1))]):
                pass
            w.step()
        done.set()

    threads = [threading.Thread(target=writer), threading.Thread(target=binder)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads)
    return lost, [v.invariant for v in w.violations]


def test_a_checked_ledger_write_is_serialised_with_another_threads_calls():
    # The write holds the wrapper's lock: it never lands in a column being replaced (it did: the value read back
    # was the old one), nor in the dirty set a step iterates.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for trial in range(150):
            assert _ledger_write_race(trial) == ([], [])
    finally:
        sys.setswitchinterval(old)
