"""The pools' own allocators and SGLang's one-pool SWA layouts.

- ``full_attn_allocator`` / ``swa_attn_allocator`` read through the wrapper are checked views of those pools
  (``wrapper.forwarding._PoolView``): SGLang's unified radix cache evicts a node by freeing its full pages with
  ``full_attn_allocator.free_segment`` (below the composite's peer check) and then its SWA side with the composite's
  ``free_swa_segment``; HiCache and external KV loads allocate and free on either side directly. Before the views,
  those calls went around the wrapper and the next allocation of the freed pages read as ``duplicate_allocation``
  (raised in raise mode) and the step as ``pool_conservation``.
- SGLang's per-request SWA ring (``kvcache.swa_req_ring_size`` set) pages the full pool only, and its
  ``PureSWATokenToKVPoolAllocator`` has one pool that is both sides: the wrapper tracks one pool for each. Before,
  every ring allocation read as ``slot_page_alignment`` / ``reserved_page_touched``, and the all-SWA allocator's
  SWA frees as ``duplicate_allocation`` at the next allocation.

Every scenario runs on the wrapper and on a bare twin of the same class, and compares results and state.
"""

from __future__ import annotations

import pytest
import torch

from instrumented_alloc import InstrumentedAllocator, InvariantViolation
from instrumented_alloc import events as ev
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from tests import sglang_compat
from tests.engine_model import allocator_state

F16 = torch.float16
I64 = torch.int64


def _ours(ps):
    return lambda: SWATokenToKVPoolAllocator(64, 64, ps, F16, "cpu", None, False)


def _sglang(ps):
    def make():
        sglang_compat.require_sglang(True)
        return sglang_compat.make_sglang_swa(64, 64, ps)

    return make


SWA = {"ours-ps4": _ours(4), "ours-ps1": _ours(1), "sglang-ps4": _sglang(4), "sglang-ps1": _sglang(1)}


def _extend(a, n: int) -> torch.Tensor:
    """A new request of ``n`` tokens (no prefix), as the engine prefills it."""
    z = torch.zeros(1, dtype=I64)
    if a.page_size == 1:
        return a.alloc(n)
    s = torch.tensor([n], dtype=I64)
    return a.alloc_extend(z, z.clone(), s, s.clone(), torch.tensor([-1], dtype=I64), n)


def _evict(a, kv: torch.Tensor) -> None:
    """The unified radix cache's eviction of a node holding ``kv``: full side first, through the full allocator
    itself, then the SWA side through the composite (components/full.py, then components/swa.py)."""
    a.full_attn_allocator.free_segment(kv, start_pos=0)
    a.free_swa_segment(kv, start_pos=0)


def _violations(w) -> list:
    return [(v.invariant, v.op, v.pool) for v in w.violations]


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize("mode", ["record", "raise"])
@pytest.mark.parametrize("kind", list(SWA))
def test_unified_cache_eviction_through_the_full_allocator(kind, mode, verify):
    bare, inner = SWA[kind](), SWA[kind]()
    w = InstrumentedAllocator(inner, mode=mode, verify=verify)
    results = []
    for a in (bare, w):
        cached = _extend(a, 32)  # a cached prefix: held by the tree, by no request
        _evict(a, cached)
        again = _extend(a, 64)  # the whole pool: the evicted pages again
        results.append((cached.tolist(), again.tolist(), a.full_available_size(), a.swa_available_size()))
    assert results[0] == results[1]
    assert set(results[1][0]) <= set(results[1][1])  # the freed pages were handed out again
    w.step()
    w.step()  # deferred verification: the checks have landed by the second boundary
    assert _violations(w) == [] and w.check_consistency() == []
    assert allocator_state(w) == allocator_state(bare)
    ps = inner.page_size
    owner = w.snapshot()["full"].owner
    assert sorted(int(p) for p in (owner == -1).nonzero()[0]) == sorted({s // ps for s in results[1][1]})


@pytest.mark.parametrize("kind", list(SWA))
def test_a_double_free_through_the_full_allocator_is_refused_before_the_call(kind):
    bare, inner = SWA[kind](), SWA[kind]()
    w = InstrumentedAllocator(inner, mode="raise")
    for a in (bare, w):
        cached = _extend(a, 32)
        a.full_attn_allocator.free_segment(cached, start_pos=0)
    with pytest.raises(InvariantViolation) as info:
        w.full_attn_allocator.free_segment(cached, start_pos=0)
    assert info.value.violation.invariant == "double_free"
    assert (info.value.violation.op, info.value.violation.pool) == ("full_attn_allocator.free_segment", "full")
    assert allocator_state(w) == allocator_state(bare)  # the inner never saw the second free


def test_a_segment_start_off_the_page_is_named_on_the_view():
    w = InstrumentedAllocator(SWA["ours-ps4"](), mode="record")
    kv = _extend(w, 16)
    with pytest.raises(InvariantViolation):
        InstrumentedAllocator(SWA["ours-ps4"](), mode="raise").full_attn_allocator.free_segment(kv, start_pos=2)
    w.full_attn_allocator.free_segment(kv[8:], start_pos=8)
    assert _violations(w) == []
    with pytest.raises(TypeError, match="free_index"):
        w.swa_attn_allocator.free(kv.tolist())
    assert _violations(w) == [("invalid_argument", "swa_attn_allocator.free", None)]


@pytest.mark.parametrize("kind", ["ours-ps4", "ours-ps1", "sglang-ps4"])
def test_allocations_on_a_pool_directly_belong_to_no_request(kind):
    bare, inner = SWA[kind](), SWA[kind]()
    w = InstrumentedAllocator(inner, mode="record")
    got = []
    w.subscribe(got.extend)
    slots = []
    for a in (bare, w):
        with w.batch(["r"]) if a is w else _null():
            s = a.swa_attn_allocator.alloc(8)  # an external KV load into the SWA pool, inside a batch
        slots.append(s.tolist())
    assert slots[0] == slots[1]
    ps = inner.page_size
    pages = sorted({s // ps for s in slots[1]})
    swa = w.snapshot()["swa"]
    assert sorted(int(p) for p in (swa.owner == -1).nonzero()[0]) == pages
    assert w.ledger["r"].kv_allocated_len == 0  # bound, but the pages are the pool's: the request allocated nothing
    allocs = [e for e in got if isinstance(e, ev.Alloc)]
    assert [(e.op, e.pool, e.n_slots, e.n_pages, e.rids) for e in allocs] == [
        ("swa_attn_allocator.alloc", "swa", 8, 8 // ps, ())
    ]
    for a, s in ((bare, slots[0]), (w, slots[1])):
        a.swa_attn_allocator.free(torch.tensor(s, dtype=I64))  # the load aborted
    frees = [e for e in got if isinstance(e, ev.Free)]
    assert [(e.op, e.pool, e.n_pages) for e in frees] == [("swa_attn_allocator.free", "swa", 8 // ps)]
    w.step()
    assert _violations(w) == [] and w.check_consistency() == []
    assert allocator_state(w) == allocator_state(bare)
    assert (w.snapshot()["swa"].owner == -1).sum() == 0
    # A second free of the same slots: double_free, on that pool, under that op.
    w.swa_attn_allocator.free(torch.tensor(slots[1], dtype=I64))
    assert _violations(w)[0] == ("double_free", "swa_attn_allocator.free", "swa")


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_views_forward_everything_else_and_keep_the_class():
    inner = SWA["ours-ps4"]()
    w = InstrumentedAllocator(inner)
    full = w.full_attn_allocator
    assert isinstance(full, PagedTokenToKVPoolAllocator) and full._w_inner is inner.full_attn_allocator
    assert w.full_attn_allocator is full  # one view per pool, kept
    assert full.free_pages is inner.full_attn_allocator.free_pages
    assert full.available_size() == inner.full_attn_allocator.available_size() == 64
    full.debug_mode = True  # a write reaches the pool's allocator
    assert inner.full_attn_allocator.debug_mode is True
    full.only_here = 3
    assert inner.full_attn_allocator.only_here == 3 and full.only_here == 3
    for kind in ("ours-ps1", "sglang-ps1"):
        one = InstrumentedAllocator(SWA[kind]())
        for name in ("alloc", "free", "free_segment", "free_page_ids", "alloc_extend_swa_tail", "free_swa"):
            # The checked methods the pool's class lacks are hidden, as on the bare one.
            assert hasattr(one.swa_attn_allocator, name) == hasattr(one.inner.swa_attn_allocator, name), (kind, name)
    off = InstrumentedAllocator(SWA["ours-ps4"](), mode="off")
    assert off.full_attn_allocator is off.inner.full_attn_allocator  # off: the object itself
    paged = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, F16, "cpu"))
    assert not hasattr(paged, "full_attn_allocator") and not hasattr(paged, "swa_attn_allocator")


# -- SGLang's one-pool SWA layouts --------------------------------------------------------------------------------
def _ring():
    sglang_compat.require_sglang(True)
    return sglang_compat.make_sglang_swa_ring(256, 128, 16, ring_size=48)


def _ring_run(a):
    z = torch.zeros(1, dtype=I64)
    x = a.alloc_extend(z, z.clone(), torch.tensor([40]), torch.tensor([40]), torch.tensor([-1]), 40)
    d = a.alloc_decode(torch.tensor([41]), torch.tensor([41]), x[-1:])
    a.free_swa_segment(x[:32], start_pos=0)  # a window eviction: a no-op on a ring
    a.free_swa(x[:32])
    free = (a.full_available_size(), a.swa_available_size())
    a.free_segment(torch.cat([x, d]), start_pos=0)
    return x.tolist(), d.tolist(), free, a.full_available_size(), a.swa_available_size()


@pytest.mark.parametrize("mode", ["record", "raise"])
def test_sglang_swa_ring_is_one_pool(mode):
    bare, inner = _ring(), _ring()
    w = InstrumentedAllocator(inner, mode=mode)
    assert w.pools == ("full",)
    got = _ring_run(w)
    assert got == _ring_run(bare)
    assert got[2] == (256 - 48, bare.swa_available_size())  # the SWA frees freed nothing
    w.step()
    assert _violations(w) == [] and w.check_consistency() == []
    assert allocator_state(w) == allocator_state(bare)
    assert w.swa_attn_allocator is inner.swa_attn_allocator  # no tracked pool: the object itself


def test_sglang_swa_ring_still_catches_a_double_free():
    w = InstrumentedAllocator(_ring(), mode="record")
    z = torch.zeros(1, dtype=I64)
    x = w.alloc_extend(z, z.clone(), torch.tensor([32]), torch.tensor([32]), torch.tensor([-1]), 32)
    w.free_segment(x, start_pos=0)
    w.free_segment(x, start_pos=0)
    assert _violations(w)[0] == ("double_free", "free_segment", "full")


def _pure():
    sglang_compat.require_sglang(True)
    return sglang_compat.make_sglang_pure_swa(64)


def _pure_run(a):
    x = a.alloc(40)
    a.free_group_begin()
    a.free_swa_segment(x[:24], start_pos=0)  # the window eviction frees the one pool
    a.free_swa(x[24:28])
    a.free_group_end()
    a.free_full(x[28:])  # all-SWA: nothing to release on the full side
    a.free_full_segment(x[28:], start_pos=0)
    after = a.available_size()
    y = a.alloc(50)
    return x.tolist(), after, y.tolist()


@pytest.mark.parametrize("mode", ["record", "raise"])
def test_sglang_pure_swa_is_one_pool(mode):
    bare, inner = _pure(), _pure()
    w = InstrumentedAllocator(inner, mode=mode, sliding_window=8)
    assert w.pools == ("full",)
    assert w.check_consistency() == []  # the identity mapping is no set of live peers
    got = _pure_run(w)
    assert got == _pure_run(bare)
    assert got[1] == 64 - 40 + 28
    w.step()
    assert _violations(w) == [] and w.check_consistency() == []
    assert allocator_state(w) == allocator_state(bare)
    # Both names are the one pool's view.
    assert w.full_attn_allocator._w_inner is w.swa_attn_allocator._w_inner is inner.swa_attn_allocator


def test_sglang_pure_swa_still_catches_a_double_free():
    w = InstrumentedAllocator(_pure(), mode="raise")
    x = w.alloc(8)
    w.free_swa(x)
    with pytest.raises(InvariantViolation) as info:
        w.free_swa(x)
    assert (info.value.violation.invariant, info.value.violation.pool) == ("double_free", "full")


def test_a_refused_allocation_on_a_pool_is_an_alloc_failure_of_that_pool():
    bare, inner = SWA["ours-ps4"](), SWA["ours-ps4"]()
    w = InstrumentedAllocator(inner, mode="record")
    got = []
    w.subscribe(got.extend)
    assert bare.swa_attn_allocator.alloc(260) is None
    assert w.swa_attn_allocator.alloc(260) is None  # more than its 64 slots
    fails = [e for e in got if isinstance(e, ev.AllocFailed)]
    assert [(e.op, e.pool, e.requested, e.available, e.rids) for e in fails] == [
        ("swa_attn_allocator.alloc", "swa", 260, 64, ())
    ]
    w.step()
    assert _violations(w) == [] and allocator_state(w) == allocator_state(bare)


# -- the views, the ring and the all-SWA allocator against SGLang's own semantics --------------------
def _raises_or_records(w, call):
    """``call()``, then two step boundaries (deferred checks land); the invariant id raised, or None."""
    try:
        call()
        w.step()
        w.step()
    except InvariantViolation as e:
        return e.violation.invariant
    return None


def _ring_ps(ps):
    sglang_compat.require_sglang(True)
    return sglang_compat.make_sglang_swa_ring(256, 128, ps, ring_size=48)


def _ring_extend(a, n):
    z = torch.zeros(1, dtype=I64)
    return a.alloc_extend(z, z.clone(), torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]), n)


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize("mode", ["record", "raise"])
@pytest.mark.parametrize("ps", [4, 16])
def test_ring_free_full_segment_frees_by_page_id(ps, mode, verify):
    # SGLang's ring free_full_segment is full_attn_allocator.free_segment: one page per page_size slots, no dedup.
    bare, w = _ring_ps(ps), InstrumentedAllocator(_ring_ps(ps), mode=mode, verify=verify)
    xs = [_ring_extend(a, 2 * ps) for a in (bare, w)]
    assert xs[0].tolist() == xs[1].tolist()
    twice = torch.cat([xs[1][:ps], xs[1][:ps]])  # the first page named twice: listed twice by the bare one
    refused = mode == "raise" and verify == "immediate"
    if not refused:
        bare.free_full_segment(twice.clone(), start_pos=0)
    assert _raises_or_records(w, lambda: w.free_full_segment(twice, start_pos=0)) == (
        None if mode == "record" else "double_free"
    )
    assert _violations(w) == [("double_free", "free_full_segment", "full")]
    assert allocator_state(w) == allocator_state(bare)  # raise + immediate: refused before the call


@pytest.mark.parametrize("mode", ["record", "raise"])
@pytest.mark.parametrize("ps", [4, 16])
def test_ring_free_full_segment_from_mid_page_frees_the_pages_sglang_frees(ps, mode):
    bare, w = _ring_ps(ps), InstrumentedAllocator(_ring_ps(ps), mode=mode)
    for a in (bare, w):
        x = _ring_extend(a, 2 * ps)
        a.free_full_segment(x[ps // 2 : ps + ps // 2], start_pos=0)  # SGLang frees the first page only
        a.free_full_segment(x[ps:], start_pos=ps)  # the second page, still in use until now
    w.step()
    assert _violations(w) == [] and w.check_consistency() == []
    assert allocator_state(w) == allocator_state(bare)


@pytest.mark.parametrize("mode", ["record", "raise"])
@pytest.mark.parametrize("ps", [4, 16])
def test_ring_follows_free_groups(ps, mode):
    bare, w = _ring_ps(ps), InstrumentedAllocator(_ring_ps(ps), mode=mode)
    for a in (bare, w):
        x = _ring_extend(a, 2 * ps)
        a.free_group_begin()
        a.free(x[:ps])
        a.free(x)  # the first page again: the full allocator's group merges repeats at its end (set-shaped)
    w.step()  # a boundary inside the group: the freed pages are held, not free
    for a in (bare, w):
        a.free_group_end()
    w.step()
    assert _violations(w) == [] and w.check_consistency() == []
    assert allocator_state(w) == allocator_state(bare)


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize("mode", ["record", "raise"])
def test_pure_swa_follows_free_groups(mode, verify):
    bare, w = _pure(), InstrumentedAllocator(_pure(), mode=mode, verify=verify)
    for a in (bare, w):
        x = a.alloc(8)
        a.free_group_begin()
        a.free(x)
    w.step()  # a boundary inside the group: the inner holds the slots in its own pile
    assert bare.available_size() == w.available_size() == 56
    for a in (bare, w):
        a.free_group_end()
    w.step()
    w.step()
    assert _violations(w) == [] and w.check_consistency() == []
    assert allocator_state(w) == allocator_state(bare)
    # A repeat inside a group is no merge here: the group ends in one token-pool free that lists it twice.
    w2 = InstrumentedAllocator(_pure(), mode="record", verify=verify)
    w2.alloc(40)  # held elsewhere: the relisted slots do not over-credit the pool (SGLang asserts that)
    y = w2.alloc(8)
    w2.free_group_begin()
    w2.free_swa(y[:4])
    w2.free(y)
    w2.free_group_end()
    w2.step()
    w2.step()
    assert _violations(w2) == [("double_free", "free", "full")]


VIEW_KINDS = {
    "sglang-ps4": lambda need_sort=False: sglang_compat.make_sglang_swa(64, 32, 4, need_sort=need_sort),
    "sglang-ps1": lambda need_sort=False: sglang_compat.make_sglang_swa(64, 32, 1, need_sort=need_sort),
    "ours-ps4": lambda need_sort=False: SWATokenToKVPoolAllocator(64, 32, 4, F16, "cpu", None, need_sort),
    "ours-ps1": lambda need_sort=False: SWATokenToKVPoolAllocator(64, 32, 1, F16, "cpu", None, need_sort),
    "sglang-pure": lambda need_sort=False: sglang_compat.make_sglang_pure_swa(32, need_sort=need_sort),
}


def _view_kind(kind, need_sort=False):
    if kind.startswith("sglang"):
        sglang_compat.require_sglang(True)
    return VIEW_KINDS[kind](need_sort)


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize("mode", ["record", "raise"])
@pytest.mark.parametrize("kind", list(VIEW_KINDS))
def test_a_view_free_inside_a_free_group_releases_at_once(kind, mode, verify):
    # SGLang's free_group_begin opens a group on the composite and its full allocator only (the all-SWA
    # allocator: on itself only): the SWA allocator's own free releases at once.
    bare, w = _view_kind(kind), InstrumentedAllocator(_view_kind(kind), mode=mode, verify=verify)
    got = []
    for a in (bare, w):
        s = a.swa_attn_allocator.alloc(32)  # an external KV load takes the whole SWA pool
        a.free_group_begin()
        a.swa_attn_allocator.free(s)  # the load aborted, inside the scheduler's group
        t = a.swa_attn_allocator.alloc(8)  # the pool hands the pages out again
        a.free_group_end()
        got.append((s.tolist(), t.tolist(), a.swa_available_size()))
    assert got[0] == got[1]
    w.step()
    w.step()
    assert _violations(w) == [] and w.check_consistency() == []
    assert allocator_state(w) == allocator_state(bare)


@pytest.mark.parametrize("kind", ["sglang-ps4", "ours-ps1"])
def test_a_view_free_inside_a_group_of_pages_the_group_holds_is_a_double_free(kind):
    bare, w = _view_kind(kind), InstrumentedAllocator(_view_kind(kind), mode="raise")
    for a in (bare, w):
        x = _extend(a, 8)
        peers = a.full_to_swa_index_mapping[x].clone()
        a.free_group_begin()
        a.free(x)  # the composite holds the SWA peers until the group ends, then releases them
    with pytest.raises(InvariantViolation) as info:
        w.swa_attn_allocator.free(peers)  # at once, through the SWA allocator: they would be released twice
    v = info.value.violation
    assert (v.invariant, v.op, v.pool) == ("double_free", "swa_attn_allocator.free", "swa")
    for a in (bare, w):
        a.free_group_end()
    w.step()
    assert [x.invariant for x in w.violations] == ["double_free"] and w.check_consistency() == []
    assert allocator_state(w) == allocator_state(bare)  # refused before the call


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize("mode", ["record", "raise"])
@pytest.mark.parametrize("kind", list(VIEW_KINDS))
def test_a_view_alloc_that_merges_the_staged_pages(kind, mode, verify):
    bare, w = _view_kind(kind, True), InstrumentedAllocator(_view_kind(kind, True), mode=mode, verify=verify)
    got = []
    for a in (bare, w):
        s = a.swa_attn_allocator.alloc(32)  # the whole SWA pool
        a.swa_attn_allocator.free(s)  # need_sort: staged
        t = a.swa_attn_allocator.alloc(8)  # runs short: merges the staged pages, then hands them out
        got.append((t.tolist(), a.swa_available_size()))
    assert got[0] == got[1]
    w.step()
    w.step()
    assert _violations(w) == [] and w.check_consistency() == []
    assert allocator_state(w) == allocator_state(bare)


@pytest.mark.parametrize("kind", ["sglang-ps4", "ours-ps4"])
@pytest.mark.parametrize("attr", ["full_attn_allocator", "swa_attn_allocator"])
def test_a_view_alloc_off_the_page_size_is_a_length_mismatch_as_on_the_wrapper(kind, attr):
    # SGLang's paged alloc takes a page-aligned need_size (asserted in its debug mode) and hands out
    # need_size // page_size pages: alloc(6) at page size 4 gets 4 slots.
    bare, w = _view_kind(kind), InstrumentedAllocator(_view_kind(kind), mode="record")
    outs = [getattr(a, attr).alloc(6) for a in (bare, w)]
    assert outs[0].tolist() == outs[1].tolist() and outs[1].numel() == 4
    assert _violations(w) == [("alloc_length_mismatch", f"{attr}.alloc", attr[:4].rstrip("_"))]
    paged = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, F16, "cpu"), mode="record")
    assert paged.alloc(6).numel() == 4
    assert _violations(paged) == [("alloc_length_mismatch", "alloc", "full")]
    assert w.violations[0].message.replace(f"{attr}.alloc", "alloc") == paged.violations[0].message
    w.step()
    assert len(w.violations) == 1 and allocator_state(w) == allocator_state(bare)


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize("op", ["free", "free_swa", "free_segment", "free_swa_segment"])
def test_pure_swa_frees_drop_slot_zero_as_sglang_does(op, verify):
    bare, w = _pure(), InstrumentedAllocator(_pure(), mode="record", verify=verify)
    for a in (bare, w):
        x = a.alloc(4)
        idx = torch.cat([torch.zeros(1, dtype=I64), x])  # a padded row: slot 0 first
        getattr(a, op)(idx, start_pos=0) if op.endswith("segment") else getattr(a, op)(idx)
    w.step()
    w.step()
    assert _violations(w) == [("reserved_page_touched", op, "full")]
    assert w.check_consistency() == [] and allocator_state(w) == allocator_state(bare)
    assert w.available_size() == 64
    raising = InstrumentedAllocator(_pure(), mode="raise")
    y = raising.alloc(4)
    with pytest.raises(InvariantViolation) as info:
        getattr(raising, op)(torch.cat([torch.zeros(1, dtype=I64), y]), **({"start_pos": 0} if "seg" in op else {}))
    assert info.value.violation.invariant == "reserved_page_touched"
    assert raising.available_size() == 60  # refused before the call


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize("mode", ["record", "raise"])
def test_pure_swa_window_eviction_keeps_the_request_lengths(mode, verify):
    # SGLang's order (mem_cache/common.py): free the out-of-window prefix, then record the evicted length.
    bare, w = _pure(), InstrumentedAllocator(_pure(), mode=mode, verify=verify, sliding_window=8)
    for a in (bare, w):
        with w.batch(["r"]) if a is w else _null():
            x = a.alloc(40)
        w.step()
        a.free_swa_segment(x[:24], start_pos=0)
        if a is w:
            w.ledger["r"].swa_evicted_seqlen = 24  # 24 <= 40 - 8
            w.step()
            w.step()
            kv = w.ledger["r"]
            assert (kv.kv_allocated_len, kv.kv_committed_len, kv.swa_evicted_seqlen) == (40, 40, 24)
            assert _violations(w) == [] and w.check_consistency() == []
        a.free(x[36:])  # a retracted tail: the lengths follow the pages left plus the evicted length
    w.step()
    w.step()
    kv = w.ledger["r"]
    assert (kv.kv_allocated_len, kv.kv_committed_len, kv.swa_evicted_seqlen) == (36, 36, 24)
    assert _violations(w) == [] and w.check_consistency() == []
    assert allocator_state(w) == allocator_state(bare)


def test_pure_swa_evicted_length_without_the_free_is_still_a_ledger_mismatch():
    w = InstrumentedAllocator(_pure(), mode="record", sliding_window=8)
    with w.batch(["r"]):
        w.alloc(40)
    w.ledger["r"].swa_evicted_seqlen = 24  # nothing freed: the pool still holds 40 pages, the ledger means 16
    assert [(v.invariant, v.pool) for v in w.check_consistency()] == [("ledger_matches_pages", "full")]
