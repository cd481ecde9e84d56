"""The shadow's per-request page counts (``KvLedger.owned``, what ``ledger_matches_pages`` and ``request_leak``
compare) stay the census of its page owners through faults: a page taken from another request by an extend (one
count per page, not per slot), a decode continuing in a page that was not its request's, a page handed to one
request twice in one call (reported at that call), openings the shadow cannot write (page 0), and a free listing
a page twice. Before, each of these left a count that disagreed with the owners, and the disagreement surfaced
later as a negative count, a ``request_leak`` or ``ledger_matches_pages`` naming an innocent request that reused
the slot. Both verification modes; the fast paths (immediate) decline to the general path on every fault here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from instrumented_alloc import InstrumentedAllocator, wrapper
from instrumented_alloc.allocators import (
    PagedTokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from instrumented_alloc.sim import build_engine
from tests.engine_model import Req, decode_args, extend_args, split_extend, t

PS = 4
VERIFY = ("immediate", "deferred")


def _census_mismatches(w) -> dict:
    """Request slot -> (count, census) per pool where the ledger's page count is not the number of pages the
    shadow says the slot owns."""
    out = {}
    for name, pool in w._w_pools.items():
        counts = w.ledger.owned[name]
        codes = pool.shadow.owner
        census = np.bincount(codes[codes >= 0], minlength=counts.size)[: counts.size]
        bad = np.flatnonzero(census != counts)
        if bad.size:
            out[name] = {int(s): (int(counts[s]), int(census[s])) for s in bad}
    return out


def _wrap(inner, verify):
    return InstrumentedAllocator(inner, mode="record", verify=verify, sliding_window=2 * PS)


def _extend(w, reqs, lens):
    with w.batch([r.rid for r in reqs]):
        out = w.alloc_extend(*extend_args(reqs, lens))
    split_extend(reqs, lens, out)
    return out


def _list_first(alloc, *pages):
    alloc.free_pages = torch.cat([t(pages), alloc.free_pages])


def _found(w) -> list:
    w.flush()
    return [(v.invariant, v.rid, v.message) for v in w.violations]


@pytest.mark.parametrize("verify", VERIFY)
def test_extend_taking_a_page_of_another_request_moves_one_count(verify):
    w = _wrap(PagedTokenToKVPoolAllocator(128, PS, torch.float16, "cpu"), verify)
    a, b = Req("a"), Req("b")
    _extend(w, [a], [3 * PS])
    w.step()
    taken = a.row[0] // PS
    _list_first(w.inner, taken)  # the free list lists a page that a holds
    _extend(w, [b], [2 * PS])
    w.step()
    assert _found(w) == [
        (
            "duplicate_allocation",
            "b",
            f"alloc_extend handed out [{taken}] (1 pages) already in use; page {taken} was owned by request slot 0",
        ),
        (  # the fault itself: the free list grew by the page it listed
            "pool_conservation",
            None,
            "step: pool full has 28 free+staged pages, the shadow expected 27: 1 pages appeared in the free list "
            "without being freed",
        ),
    ]
    led = w.ledger
    assert led.owned["full"][led.slot_of("a", create=False)] == 2  # 3 - 1 (it was 3 - page_size)
    assert led.owned["full"][led.slot_of("b", create=False)] == 2
    assert _census_mismatches(w) == {}


@pytest.mark.parametrize("verify", VERIFY)
def test_decode_continuing_in_another_requests_page_moves_the_page(verify):
    w = _wrap(PagedTokenToKVPoolAllocator(128, PS, torch.float16, "cpu"), verify)
    a, b = Req("a"), Req("b")
    _extend(w, [a, b], [2, 2])
    w.step()
    seq, _, _ = decode_args([b])
    with w.batch(["b"]):
        out = w.alloc_decode(seq, seq.clone(), t([a.row[-1]]))  # b's last_loc names a's slot: b lands in a's page
    w.step()
    assert out.tolist() == [a.row[-1] + 1]
    assert [(i, rid) for i, rid, _ in _found(w)] == [("duplicate_allocation", "b")]
    led = w.ledger
    assert led.owned["full"][led.slot_of("a", create=False)] == 0
    assert led.owned["full"][led.slot_of("b", create=False)] == 2
    assert _census_mismatches(w) == {}


@pytest.mark.parametrize("verify", VERIFY)
def test_a_page_handed_twice_to_one_request_in_one_extend_is_reported_at_the_call(verify):
    w = _wrap(PagedTokenToKVPoolAllocator(128, PS, torch.float16, "cpu"), verify)
    page = int(w.inner.free_pages[0])
    _list_first(w.inner, page)  # a free page listed twice (what a double free leaves behind)
    a = Req("a")
    _extend(w, [a], [3 * PS])
    w.step()
    assert _found(w) == [
        (
            "duplicate_allocation",
            "a",
            f"alloc_extend handed out [{page}] (1 pages) more than once to one request in one call; page {page} went "
            "2 times to request slot 0",
        ),
        (
            "pool_conservation",
            None,
            "step: pool full has 30 free+staged pages, the shadow expected 29: 1 pages appeared in the free list "
            "without being freed",
        ),
    ]
    # Immediate verification reports it at the extend (step 0), deferred at the boundary that follows.
    assert (w.violations[0].op, w.violations[0].step) == ("alloc_extend", 0 if verify == "immediate" else 1)
    assert [s // PS for s in a.row[::PS]] == [page, page, page + 1]
    slot = w.ledger.slot_of("a", create=False)
    assert w.ledger.owned["full"][slot] == 2  # the page once, and the next one
    assert _census_mismatches(w) == {}
    # Its row freed and the request released: no count left behind, no leak reported for it.
    w.free(t(a.row))
    w.release_request("a")
    w.step()
    assert [v.invariant for v in w.violations] == ["duplicate_allocation", "pool_conservation"]
    assert _census_mismatches(w) == {}


@pytest.mark.parametrize("verify", VERIFY)
def test_page_size_1_slot_handed_twice_to_one_request_after_a_double_free(verify):
    # At page size 1 the call's slots are sorted for repeats only once a free relisted a slot (a double free here,
    # whose second free the inner appends again): then one request's alloc takes both copies and is told so.
    w = InstrumentedAllocator(TokenToKVPoolAllocator(16, torch.float16, "cpu"), mode="record", verify=verify)
    with w.batch(["a"], lens=[3]):
        a = w.alloc(3)
    w.step()
    w.free(a)
    w.free(a)
    w.release_request("a")
    w.step()
    assert w.inner.free_pages.tolist() == [*range(4, 17), 1, 2, 3, 1, 2, 3]
    with w.batch(["b"], lens=[19]):
        b = w.alloc(19)
    w.step()
    assert b.tolist() == [*range(4, 17), 1, 2, 3, 1, 2, 3]
    assert _found(w) == [
        (
            "double_free",
            "a",
            "free frees [1, 2, 3] (3 pages) that are not in use (page 1 is free, last owned by request slot 0)",
        ),
        (
            "duplicate_allocation",
            "b",
            "alloc handed out [1, 2, 3] (3 pages) more than once to one request in one call; page 1 went 2 times to "
            "request slot 0",
        ),
    ]
    assert w.ledger.owned["full"][w.ledger.slot_of("b", create=False)] == 16
    assert _census_mismatches(w) == {}


def test_page_run_extend_check_declines_a_page_twice_to_one_request(monkeypatch):
    # The fast page-run check must not accept the call (it would count three pages): the per-slot check reports it.
    calls = []
    real = wrapper.InstrumentedAllocator._check_extend

    def spy(self, *args, **kwargs):
        calls.append(args[4])  # the pool
        return real(self, *args, **kwargs)

    monkeypatch.setattr(wrapper.InstrumentedAllocator, "_check_extend", spy)
    w = _wrap(PagedTokenToKVPoolAllocator(128, PS, torch.float16, "cpu"), "immediate")
    page = int(w.inner.free_pages[0])
    _list_first(w.inner, page)
    _extend(w, [Req("a")], [3 * PS])
    assert len(calls) == 1
    assert [v.invariant for v in w.violations] == ["duplicate_allocation"]  # at the call, before any step


@pytest.mark.parametrize("verify", VERIFY)
def test_swa_extend_whose_peers_read_page_zero_counts_no_swa_page(verify):
    # Three SWA pages' worth of peers unmapped (slot 0): the SWA side names reserved page 0 for each; none is owned.
    w = _wrap(SWATokenToKVPoolAllocator(128, 128, PS, torch.float16, "cpu"), verify)
    inner = w.inner
    real = inner.alloc_extend

    def unmapped(*args, **kwargs):
        out = real(*args, **kwargs)
        inner.full_to_swa_index_mapping[out] = 0
        return out

    inner.alloc_extend = unmapped
    _extend(w, [Req("a")], [3 * PS])
    w.step()
    assert _found(w) == [
        (
            "slot_page_alignment",
            "a",
            "alloc_extend: 9 slots break slot % 4 == position % 4; first: position 1 got slot 0",
        ),
        ("reserved_page_touched", None, f"alloc_extend handed out reserved page 0 ({3 * PS} slots)"),
    ]
    slot = w.ledger.slot_of("a", create=False)
    assert w.ledger.owned["swa"][slot] == 0
    assert w.ledger.owned["full"][slot] == 3
    assert _census_mismatches(w) == {}


@pytest.mark.parametrize("verify", VERIFY)
def test_free_listing_a_page_twice_counts_it_once(verify):
    w = _wrap(PagedTokenToKVPoolAllocator(128, PS, torch.float16, "cpu"), verify)
    a = Req("a")
    _extend(w, [a], [3 * PS])
    w.step()
    first = a.row[0] // PS
    w.free_page_ids(t([first, first]))  # no dedup on this path
    w.step()
    assert [(i, rid) for i, rid, _ in _found(w)] == [("double_free", "a")]
    assert w.ledger.owned["full"][w.ledger.slot_of("a", create=False)] == 2
    assert _census_mismatches(w) == {}


# Demo engines with faults that corrupt the free lists, found by a fuzz of seeds and fault plans where some count
# left the census (each case broke it before): the counts stay the census after every call (immediate) or every
# step (deferred: the slot tier lands at the step boundary, the host tier at the call).
ENGINES = [
    ("swa-128", None, 20, ("double-free@56",)),  # pages taken by extends and by continuing decodes; page 0 openings
    ("swa-1024", None, 4, ("double-free@57",)),  # pages handed twice to one request in one extend
    ("swa-128", None, 50, ("alloc-len-misaligned@191", "double-free@129")),  # an SWA segment free listing pages twice
    ("dense", 1, 43, ("double-free@78",)),  # page size 1: a free listing slots twice
    ("dense", 1, 571, ("double-free@63",)),  # page size 1: slots handed twice to one request after a double free
    ("swa-128", 1, 4, ("double-free@57",)),  # the same on an SWA allocator: the SWA peers repeat with the full slots
]


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("case", ENGINES, ids=lambda c: f"{c[0]}-ps{c[1]}-seed{c[2]}")
def test_counts_stay_the_census_on_faulted_demo_engines(case, verify, monkeypatch):
    preset, ps, seed, inject = case
    seen, broken = [], []
    for name in ("alloc_decode", "alloc_extend", "alloc_extend_swa_tail", "alloc", "free", "free_full",
                 "free_swa_segment", "free_segment", "release_request", "step"):
        real = getattr(wrapper.InstrumentedAllocator, name)

        def checked(self, *args, _real=real, _name=name, **kwargs):
            result = _real(self, *args, **kwargs)
            in_group = self._w_pools["full"].shadow.in_group
            if not in_group and (_name == "step" or not self._w_st.deferred):
                seen.append(_name)
                bad = _census_mismatches(self)
                if bad and not broken:
                    broken.append((_name, self.step_count, bad))
            return result

        monkeypatch.setattr(wrapper.InstrumentedAllocator, name, checked)
    e = build_engine(preset, seed=seed, page_size=ps, inject=inject, steps=300, verify=verify)
    e.run(300)
    assert broken == []
    assert len(seen) >= 300
    ids = {v.invariant for v in e.alloc.violations}
    assert "double_free" in ids or "duplicate_allocation" in ids  # the faults did fire and were seen


def test_the_names_split_out_of_shadow_stay_importable_from_it():
    from instrumented_alloc import pagearrays, pagecodes, shadow

    for name in shadow.__all__:
        assert getattr(shadow, name) is not None
    assert shadow.FREE is pagecodes.FREE and shadow.PoolSnapshot is pagecodes.PoolSnapshot
    assert shadow.sorted_unique is pagearrays.sorted_unique
    # What the wrapper calls on a shadow, whichever module now defines it.
    for method in ("on_alloc", "shared_in_call", "plan_free", "apply_free", "free_owned", "group_begin",
                   "group_end", "group_abandon", "merged", "check_count", "check_census", "counts", "note",
                   "take_deltas", "clear", "_set"):  # fmt: skip
        assert callable(getattr(shadow.PoolShadow, method)), method
