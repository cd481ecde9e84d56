"""Every invariant id: inject exactly that fault through the public API and see exactly that id, and no other.

Record mode: the call goes on, and the inner allocator ends in the same state as a bare twin that ran the same
calls. Raise mode: InvariantViolation is raised after the violation was recorded and published to sinks.
The alignment, double-free and duplicate-allocation faults also run with SGLang 0.5.23's own Paged allocator.
"""

from __future__ import annotations

import pytest
import torch

from instrumented_alloc import INVARIANTS, InstrumentedAllocator, InvariantViolation
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from instrumented_alloc.events import ViolationEvent
from tests import sglang_compat
from tests.engine_model import Req, allocator_state, decode_args, extend_args, split_extend, t

PS = 4


def ours_paged():
    return PagedTokenToKVPoolAllocator(64, PS, torch.float16, "cpu", None, False)


def sglang_paged():
    sglang_compat.require_sglang(require_swa=False)
    return sglang_compat.make_sglang_paged(64, PS)


def ours_swa():
    return SWATokenToKVPoolAllocator(64, 64, PS, torch.float16, "cpu", None, False)


class Driver:
    """Drives a wrapped allocator and (record mode) a bare twin with the same calls."""

    def __init__(self, make_inner, mode: str, verify: str, window: int | None = 8):
        self.mode = mode
        self.inner = make_inner()
        self.bare = make_inner()
        self.published = []
        self.w = InstrumentedAllocator(
            self.inner, mode=mode, verify=verify, sliding_window=window, sinks=[self.published.extend]
        )

    def call(self, name, *args, **kwargs):
        rw = getattr(self.w, name)(*args, **kwargs)
        rb = getattr(self.bare, name)(*args, **kwargs)
        assert (rw is None and rb is None) or torch.equal(rw, rb)
        return rw

    def extend(self, reqs, lens):
        with self.w.batch([r.rid for r in reqs]):
            out = self.call("alloc_extend", *extend_args(reqs, lens))
        split_extend(reqs, lens, out)
        return out

    def decode(self, reqs):
        with self.w.batch([r.rid for r in reqs]):
            out = self.call("alloc_decode", *decode_args(reqs))
        for r, s in zip(reqs, out.tolist()):
            r.row.append(s)
        return out

    def fault_call(self, name, *args, **kwargs):
        """The faulty allocator call: forwarded to both in record mode; expected to raise in raise mode."""
        if self.mode == "raise":
            with pytest.raises(InvariantViolation) as info:
                getattr(self.w, name)(*args, **kwargs)
            self.raised = info.value
            return None
        return self.call(name, *args, **kwargs)

    def fault(self, action):
        """A wrapper-only faulty action (ledger write, step, release)."""
        if self.mode == "raise":
            with pytest.raises(InvariantViolation) as info:
                action(self.w)
            self.raised = info.value
        else:
            action(self.w)

    def corrupt(self, fn):
        """Simulate a bug inside the allocator: the same corruption on both twins."""
        fn(self.inner)
        fn(self.bare)


def _two_requests(d: Driver):
    a, b = Req("a"), Req("b")
    d.extend([a, b], [6, 9])
    d.w.step()
    return a, b


# Each scenario: (expected id, inner factory, scenario(driver), window, detected_at_step).
def s_alloc_unaligned(d):
    _a, _ = _two_requests(d)

    def write(w):
        w.ledger["a"].kv_allocated_len = 10

    d.fault(write)
    assert d.w.ledger["a"].kv_allocated_len == 8  # the rejected value was never stored


def s_committed_gt_allocated(d):
    _two_requests(d)

    def write(w):
        w.ledger["a"].kv_committed_len = 9

    d.fault(write)
    assert d.w.ledger["a"].kv_committed_len == 6


def s_ledger_matches_pages(d):
    _two_requests(d)
    d.w.ledger["a"].kv_allocated_len = 16  # aligned, but request a owns 2 pages, not 4
    d.fault(lambda w: w.step())


def s_evicted_unaligned(d):
    a = Req("a")
    d.extend([a], [20])

    def write(w):
        w.ledger["a"].swa_evicted_seqlen = 6

    d.fault(write)
    assert d.w.ledger["a"].swa_evicted_seqlen == 0


def s_evicted_monotonic(d):
    a = Req("a")
    d.extend([a], [20])
    d.call("free_swa_segment", t(a.row[0:8]), start_pos=0)
    d.w.ledger["a"].swa_evicted_seqlen = 8
    d.w.step()

    def write(w):
        w.ledger["a"].swa_evicted_seqlen = 4

    d.fault(write)
    assert d.w.ledger["a"].swa_evicted_seqlen == 8


def s_evicted_gt_allocated(d):
    a = Req("a")
    d.extend([a], [10])

    def write(w):
        w.ledger["a"].swa_evicted_seqlen = 16

    d.fault(write)


def s_evicted_inside_window(d):
    a = Req("a")
    d.extend([a], [20])  # window 8: at most 12 may be evicted

    def write(w):
        w.ledger["a"].swa_evicted_seqlen = 16

    d.fault(write)


def s_reserved_page(d):
    _two_requests(d)
    d.fault_call("free", t([1, 2]))  # slots 1 and 2 are in page 0


def s_double_free(d):
    a, _ = _two_requests(d)
    d.call("free", t(a.row))
    d.fault_call("free", t(a.row))


def s_free_unallocated(d):
    _two_requests(d)
    d.fault_call("free_page_ids", t([12]))  # page 12 was never handed out


def s_duplicate_allocation(d):
    a, _ = _two_requests(d)
    used_page = a.row[0] // PS

    def corrupt(inner):
        inner.free_pages = torch.cat([t([used_page]), inner.free_pages[1:]])

    d.corrupt(corrupt)
    c = Req("c")
    with d.w.batch(["c"]):
        d.fault_call("alloc_extend", *extend_args([c], [4]))


def s_slot_alignment(d):
    a, _ = _two_requests(d)
    prefix = [a.seq]
    bad_last = a.row[-1] + 1  # last_loc must be the request's own last slot
    with d.w.batch(["a"]):
        d.fault_call("alloc_extend", t(prefix), t(prefix), t([a.seq + 1]), t([a.seq + 1]), t([bad_last]), 1)


def s_alloc_length(d):
    _two_requests(d)
    d.fault_call("alloc", 6)  # page size 4: the paged allocator silently hands out one page


def s_segment_unaligned(d):
    a, _ = _two_requests(d)
    if d.mode == "raise":
        d.fault_call("free_segment", t(a.row[2:]), start_pos=2)
        return
    for target in (d.w, d.bare):
        with pytest.raises(ValueError, match="start_pos"):
            target.free_segment(t(a.row[2:]), start_pos=2)


def s_pool_conservation(d):
    _two_requests(d)
    d.corrupt(lambda inner: setattr(inner, "free_pages", inner.free_pages[1:]))  # a free page vanishes
    d.fault(lambda w: w.step())


def s_request_leak(d):
    _two_requests(d)
    d.fault(lambda w: w.release_request("a"))


def s_swa_mapping(d):
    a = Req("a")
    d.extend([a], [10])
    d.fault_call("free_full", t(a.row))  # free_swa must come first


SCENARIOS = {
    "kv_allocated_len_page_aligned": (ours_paged, s_alloc_unaligned, 8),
    "kv_committed_le_allocated": (ours_paged, s_committed_gt_allocated, 8),
    "ledger_matches_pages": (ours_paged, s_ledger_matches_pages, 8),
    "swa_evicted_seqlen_page_aligned": (ours_swa, s_evicted_unaligned, 8),
    "swa_evicted_seqlen_monotonic": (ours_swa, s_evicted_monotonic, 8),
    "swa_evicted_le_allocated": (ours_swa, s_evicted_gt_allocated, None),
    "swa_evicted_within_window": (ours_swa, s_evicted_inside_window, 8),
    "reserved_page_touched": (ours_paged, s_reserved_page, 8),
    "double_free": (ours_paged, s_double_free, 8),
    "free_unallocated": (ours_paged, s_free_unallocated, 8),
    "duplicate_allocation": (ours_paged, s_duplicate_allocation, 8),
    "slot_page_alignment": (ours_paged, s_slot_alignment, 8),
    "alloc_length_mismatch": (ours_paged, s_alloc_length, 8),
    "segment_start_unaligned": (ours_paged, s_segment_unaligned, 8),
    "pool_conservation": (ours_paged, s_pool_conservation, 8),
    "request_leak": (ours_paged, s_request_leak, 8),
    "swa_mapping_inconsistent": (ours_swa, s_swa_mapping, 8),
}
WITH_SGLANG = ("slot_page_alignment", "double_free", "duplicate_allocation", "kv_allocated_len_page_aligned")


def _cases():
    for inv, (factory, scenario, window) in SCENARIOS.items():
        yield pytest.param(inv, factory, scenario, window, id=f"{inv}-ours")
        if inv in WITH_SGLANG:
            yield pytest.param(inv, sglang_paged, scenario, window, id=f"{inv}-sglang")


def test_every_invariant_has_a_fault_test():
    assert set(SCENARIOS) | {"invalid_argument"} == set(INVARIANTS)


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize(("inv", "factory", "scenario", "window"), list(_cases()))
def test_record_mode_sees_exactly_that_id(inv, factory, scenario, window, verify):
    d = Driver(factory, "record", verify, window)
    scenario(d)
    d.w.step()  # deferred checks land here; nothing else may fire
    seen = [v.invariant for v in d.w.violations]
    assert set(seen) == {inv}, [str(v) for v in d.w.violations]
    # The call went on: the wrapped allocator's state equals the bare twin's.
    assert allocator_state(d.inner) == allocator_state(d.bare)
    # Published as events, in the same order as recorded.
    published = [e.violation for e in d.published if isinstance(e, ViolationEvent)]
    assert published == list(d.w.violations)
    assert d.w.violation_counts[inv] == len(seen)


@pytest.mark.parametrize(("inv", "factory", "scenario", "window"), list(_cases()))
def test_raise_mode_raises_after_recording(inv, factory, scenario, window):
    d = Driver(factory, "raise", "immediate", window)
    scenario(d)
    exc = d.raised
    assert isinstance(exc, AssertionError)  # code written for the seed's assert still catches it
    assert exc.invariant == inv
    assert d.w.violations[-1] is exc.violation
    published = [e.violation for e in d.published if isinstance(e, ViolationEvent)]
    assert published[-1] is exc.violation
    assert {v.invariant for v in d.w.violations} == {inv}


def test_raise_mode_refuses_bad_free_before_the_inner_allocator():
    d = Driver(ours_paged, "raise", "immediate")
    a, _ = _two_requests(d)
    d.call("free", t(a.row))
    state = allocator_state(d.inner)
    with pytest.raises(InvariantViolation, match="double_free"):
        d.w.free(t(a.row))
    assert allocator_state(d.inner) == state  # the free list holds no duplicate


def test_invalid_argument_every_mode_but_off():
    for mode in ("record", "raise"):
        d = Driver(ours_paged, mode, "immediate")
        a, _b = _two_requests(d)
        state = allocator_state(d.inner)
        with pytest.raises(TypeError, match="free_index"):
            d.w.free([1, 2])
        with pytest.raises(ValueError, match="prefix_lens_cpu"):
            d.w.alloc_extend(t([5]), t([5]), t([3]), t([3]), t([-1]), 0)
        with pytest.raises(TypeError, match="free_index"):
            d.w.free(torch.tensor([4.0, 5.0]))
        with pytest.raises(ValueError, match="start_pos"):
            d.w.free_segment(t(a.row), start_pos=-4)
        assert allocator_state(d.inner) == state
        assert [v.invariant for v in d.w.violations] == ["invalid_argument"] * 4
        assert "free_index" in d.w.violations[0].message
        published = [e.violation.invariant for e in d.published if isinstance(e, ViolationEvent)]
        assert published == ["invalid_argument"] * 4


def test_off_mode_forwards_without_checks():
    inner = ours_paged()
    w = InstrumentedAllocator(inner, mode="off")
    out = w.alloc_extend(*extend_args([Req("a")], [5]))
    w.free(out)
    w.free(out)  # a double free, unobserved
    w.step()
    assert list(w.violations) == []
    assert inner.free_pages[:4].tolist() == [1, 2, 1, 2]


def test_seed_scenario_unaligned_swa_tail_is_caught_before_store():
    from instrumented_alloc.prealloc import alloc_for_decode_prealloc, swa_tail_len

    inner = SWATokenToKVPoolAllocator(640, 320, 16, torch.float16, "cpu", None, False)
    w = InstrumentedAllocator(inner, mode="record", sliding_window=32)
    assert swa_tail_len(100, 32, 16) == 36
    out = alloc_for_decode_prealloc(w, rid="ok", fill_len=100, swa_tail_len=36)
    assert out is not None and w.ledger["ok"].swa_evicted_seqlen == 64
    # A caller that bypasses swa_tail_len: the tail is not floored to a page, the evicted length is 68.
    out = alloc_for_decode_prealloc(w, rid="bad", fill_len=100, swa_tail_len=32)
    assert out is not None
    assert [v.invariant for v in w.violations] == ["swa_evicted_seqlen_page_aligned"]
    assert w.violations[0].rid == "bad" and "68" in w.violations[0].message
    assert w.ledger["bad"].swa_evicted_seqlen == 0  # never stored
    w.step()
    assert [v.invariant for v in w.violations] == ["swa_evicted_seqlen_page_aligned"]

    raising = InstrumentedAllocator(
        SWATokenToKVPoolAllocator(640, 320, 16, torch.float16, "cpu", None, False),
        mode="raise",
        sliding_window=32,
    )
    with pytest.raises(InvariantViolation, match="swa_evicted_seqlen_page_aligned"):
        alloc_for_decode_prealloc(raising, rid="bad", fill_len=100, swa_tail_len=32)
    assert raising.ledger["bad"].swa_evicted_seqlen == 0


def test_unaligned_segment_names_the_request_owning_its_first_page():
    d = Driver(ours_paged, "record", "immediate")
    a, _ = _two_requests(d)
    with pytest.raises(ValueError, match="start_pos"):  # the allocator itself refuses it after the record
        d.w.free_segment(t(a.row[2:]), start_pos=2)
    (v,) = d.w.violations
    assert (v.invariant, v.rid, v.op, v.pool) == ("segment_start_unaligned", a.rid, "free_segment", "full")


def test_unaligned_segment_under_deferred_verification_names_no_request():
    # The start is a host-tier fact, reported at the call in both modes; naming the request reads an index value,
    # which deferred verification never does at the call (on an accelerator it would be a sync): on the host too,
    # so that verify="deferred" behaves as it does on a device.
    d = Driver(ours_paged, "record", "deferred")
    a, _ = _two_requests(d)
    with pytest.raises(ValueError, match="start_pos"):
        d.w.free_segment(t(a.row[2:]), start_pos=2)
    (v,) = d.w.violations
    assert (v.invariant, v.rid, v.op, v.step) == ("segment_start_unaligned", None, "free_segment", 1)


# -- faults whose exact report is easy to get wrong ----------------------------------------------------------------


def _seen(w) -> list:
    return [(v.invariant, v.rid, v.pool, v.op, v.message) for v in w.violations]


@pytest.mark.parametrize("need_sort", [True, False])
def test_handing_out_a_page_still_staged_or_held_by_an_open_free_group_is_duplicate_allocation(need_sort):
    # A freed page is staged (need_sort) until an alloc merges it, or held by an open free group until it ends:
    # not free yet. A free list that lists it again and hands it out hands out a page still in use.
    d = Driver(
        lambda: PagedTokenToKVPoolAllocator(64, PS, torch.float16, "cpu", None, need_sort), "record", "immediate"
    )
    a, b = Req("a"), Req("b")
    d.extend([a], [PS])
    page = a.row[0] // PS
    if not need_sort:
        d.call("free_group_begin")
    d.call("free", t(a.row))
    d.corrupt(lambda inner: setattr(inner, "free_pages", torch.cat([t([page]), inner.free_pages])))
    d.extend([b], [PS])
    assert b.row[0] // PS == page
    assert _seen(d.w) == [
        (
            "duplicate_allocation",
            "b",
            "full",
            "alloc_extend",
            f"alloc_extend handed out [{page}] (1 pages) already in use; page {page} was staged",
        )
    ]
    assert allocator_state(d.inner) == allocator_state(d.bare)


def test_a_free_touching_page_0_leaves_it_reserved():
    # Record mode forwards the bad free: the inner lists page 0 as free and hands it out later. The shadow keeps
    # page 0 reserved, so that hand-out is reported too.
    d = Driver(ours_paged, "record", "immediate")
    a, b = Req("a"), Req("b")
    d.extend([a], [PS])
    d.call("free", t([1, 2, *a.row]))  # slots 1 and 2 are in page 0
    d.extend([b], [2 * PS])
    assert [s // PS for s in b.row[::PS]] == [0, 1]
    d.w.step()
    assert _seen(d.w) == [
        ("reserved_page_touched", None, "full", "free", "free frees reserved page 0"),
        (
            "reserved_page_touched",
            None,
            "full",
            "alloc_extend",
            f"alloc_extend handed out reserved page 0 ({PS} slots)",
        ),
    ]
    assert allocator_state(d.inner) == allocator_state(d.bare)


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
def test_decode_continuing_into_a_page_never_handed_out_is_slot_page_alignment(verify):
    d = Driver(ours_paged, "record", verify)
    a = Req("a")
    d.extend([a], [6])  # positions 0..5: a's second page is half full
    bad_last = 10 * PS + 1  # the right offset for position 6, but in page 10, which was never handed out
    with d.w.batch(["a"]):
        out = d.call("alloc_decode", t([7]), t([7]), t([bad_last]))
    assert out.tolist() == [bad_last + 1]
    d.w.step()
    assert _seen(d.w) == [
        (
            "slot_page_alignment",
            "a",
            "full",
            "alloc_decode",
            "alloc_decode handed out [10] (1 pages) free, though the slot continues the request's own page "
            "(bad last_loc); page 10 was free",
        )
    ]
    assert d.w.violations[0].step == (0 if verify == "immediate" else 1)


def test_sweep_reports_a_mapping_onto_another_requests_swa_page():
    d = Driver(ours_swa, "record", "immediate")
    a, b = Req("a"), Req("b")
    d.extend([a, b], [PS, PS])
    d.w.step()

    def corrupt(inner):  # a's full page now maps onto b's SWA page
        m = inner.full_to_swa_index_mapping
        m[t(a.row)] = m[t(b.row)].clone()

    d.corrupt(corrupt)
    d.w.step()
    assert list(d.w.violations) == []  # no call touched it: only the sweep reads the whole mapping
    found = d.w.check_consistency()
    want = f"sweep: full pages [{a.row[0] // PS}] (1) point at SWA pages owned by another request"
    assert _seen(d.w) == [("swa_mapping_inconsistent", None, "swa", "sweep", want)]
    assert found == list(d.w.violations)


@pytest.mark.parametrize("boundary", ["flush", "check_consistency"])
def test_clean_swa_eviction_passes_the_whole_ledger_check(boundary):
    # flush() and check_consistency() compare every request's ledger with its pages at once: the SWA side owns
    # the allocated pages less the evicted ones.
    d = Driver(ours_swa, "record", "immediate")  # window 8
    a = Req("a")
    d.extend([a], [20])
    d.call("free_swa_segment", t(a.row[0:8]), start_pos=0)  # the first 2 pages leave the window
    d.w.ledger["a"].swa_evicted_seqlen = 8
    d.w.step()
    assert getattr(d.w, boundary)() in (None, [])
    assert list(d.w.violations) == []
    slot = d.w.ledger.slot_of("a", create=False)
    assert (d.w.ledger.owned["full"][slot], d.w.ledger.owned["swa"][slot]) == (5, 3)


def test_request_leak_names_the_pool_still_holding_pages():
    d = Driver(ours_swa, "record", "immediate")
    a = Req("a")
    d.extend([a], [2 * PS])
    d.fault_call("free_full", t(a.row))  # free_swa skipped: a's SWA pages stay a's
    d.w.release_request("a")
    assert _seen(d.w)[1:] == [
        (
            "request_leak",
            "a",
            "swa",
            "release",
            "request 'a' released while still owning 2 pages, neither freed nor handed to the prefix cache "
            "(swa: [1, 2] (2 pages))",
        )
    ]
    assert _seen(d.w)[0][:4] == ("swa_mapping_inconsistent", "a", "swa", "free_full")


def test_the_sweep_names_a_lost_pages_last_owner():
    # A page the request freed leaves the inner's free list behind the wrapper's back: the sweep says which page and
    # who last owned it (a step before it would report the count, and the sweep then only resyncs).
    inner = PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu", None, False)
    w = InstrumentedAllocator(inner, mode="record")
    with w.batch(["a"]):
        out = w.alloc(8)
    assert out.tolist() == list(range(4, 12))  # pages 1 and 2
    w.free(out)
    lost = int(inner.free_pages[0])
    assert lost in (1, 2)
    inner.free_pages = inner.free_pages[1:]
    found = w.check_consistency()
    assert [(v.invariant, v.op) for v in found] == [("pool_conservation", "sweep")]
    assert found[0].message == (
        f"sweep: pool full: [{lost}] (1 pages) are neither in the free list nor handed out; page {lost} was last "
        "owned by request 'a', which freed it"
    )
    # Once the request is released, its slot may name another: the message no longer names the request.
    w.release_request("a")
    inner.free_pages = inner.free_pages[1:]
    other = 3 - lost
    (v,) = w.check_consistency()
    assert v.message.endswith(f"; page {other} was last freed by request slot 0, released since"), v.message
