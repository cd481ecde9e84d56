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
    assert (v.invariant, v.rid, v.op) == ("segment_start_unaligned", a.rid, "free_segment")


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
