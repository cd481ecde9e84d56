"""instrumented_alloc.stats against hand-built snapshots with known answers, a Python reference for free runs,
and one snapshot of a real wrapped allocator whose page layout is derived by hand from the allocator's rules
(pages handed out from the head of the free list, in order; freed pages go back to the head)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from instrumented_alloc import InstrumentedAllocator, stats
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from instrumented_alloc.shadow import (
    FREE,
    HELD_IDS,
    HELD_SET,
    PRISTINE,
    RESERVED,
    STAGED,
    USED_UNOWNED,
    LedgerSnapshot,
    PoolSnapshot,
)

ALL_CODES = [USED_UNOWNED, RESERVED, STAGED, HELD_SET, HELD_IDS, FREE, PRISTINE]


def ledger(slots=(), allocated=(), committed=(), evicted=None, window=None) -> LedgerSnapshot:
    slots = np.asarray(slots, np.int64)
    return LedgerSnapshot(
        rids=tuple(f"r{s}" for s in slots),
        slots=slots,
        allocated=np.asarray(allocated, np.int64),
        committed=np.asarray(committed, np.int64),
        evicted=np.zeros(slots.size, np.int64) if evicted is None else np.asarray(evicted, np.int64),
        sliding_window=window,
    )


def pool(owner, *, page_size=16, name="full", led=None) -> PoolSnapshot:
    owner = np.asarray(owner, np.int32)
    return PoolSnapshot(
        pool=name,
        page_size=page_size,
        num_pages=owner.size - 1,
        owner=owner,
        step=3,
        ledger=ledger() if led is None else led,
        slot_rids={},
    )


def owner_with(num_pages: int, codes: dict[int, int], default: int = USED_UNOWNED) -> np.ndarray:
    """Owner array of ``num_pages`` pages (page 0 reserved), every page ``default`` unless listed in ``codes``."""
    owner = np.full(num_pages + 1, default, np.int32)
    owner[0] = RESERVED
    for page, code in codes.items():
        owner[page] = code
    return owner


# -- pages by state, free runs, external fragmentation ------------------------------------------------------------
def test_worked_example_free_runs_and_external_fragmentation():
    # 10 pages: free {1,2,3,7,8} (both free codes), page 0 reserved, the rest used.
    snap = pool(owner_with(10, {1: FREE, 2: PRISTINE, 3: FREE, 7: PRISTINE, 8: PRISTINE}))
    assert stats.pages_by_state(snap) == {"free": 5, "used": 5, "staged": 0, "reserved": 1}
    runs = stats.free_runs(snap)
    assert runs.tolist() == [3, 2]
    assert runs.dtype == np.int64
    assert stats.free_run_count(snap) == 2
    assert stats.largest_free_run(snap) == 3
    assert stats.external_fragmentation(snap) == pytest.approx(0.4)


def test_pages_by_state_every_code():
    owner = owner_with(
        12,
        {1: 0, 2: 5, 3: USED_UNOWNED, 4: STAGED, 5: HELD_SET, 6: HELD_IDS, 7: FREE, 8: PRISTINE, 9: 2},
        default=PRISTINE,
    )
    counts = stats.pages_by_state(pool(owner))
    assert list(counts) == ["free", "used", "staged", "reserved"]
    assert counts == {"free": 1 + 1 + 3, "used": 4, "staged": 3, "reserved": 1}
    assert sum(counts.values()) == 12 + 1


def test_nothing_free():
    snap = pool(owner_with(10, {}, default=0))
    assert stats.free_runs(snap).tolist() == []
    assert stats.free_run_count(snap) == 0
    assert stats.largest_free_run(snap) == 0
    assert stats.external_fragmentation(snap) == 0.0


def test_all_free():
    snap = pool(owner_with(10, {}, default=PRISTINE))
    assert stats.pages_by_state(snap) == {"free": 10, "used": 0, "staged": 0, "reserved": 1}
    assert stats.free_runs(snap).tolist() == [10]
    assert stats.largest_free_run(snap) == 10
    assert stats.external_fragmentation(snap) == 0.0


def test_staged_and_held_pages_are_not_free():
    # Pages 1..9 would be one run if staged pages were free; they split it into [1-2], [4], [6], [8-9].
    codes = {1: FREE, 2: FREE, 3: STAGED, 4: FREE, 5: HELD_SET, 6: FREE, 7: HELD_IDS, 8: FREE, 9: FREE}
    snap = pool(owner_with(10, codes))
    assert stats.pages_by_state(snap) == {"free": 6, "used": 1, "staged": 3, "reserved": 1}
    assert stats.free_runs(snap).tolist() == [2, 1, 1, 2]
    assert stats.external_fragmentation(snap) == pytest.approx(1 - 2 / 6)


def test_run_touching_the_last_page():
    snap = pool(owner_with(6, {5: FREE, 6: FREE, 2: FREE}))
    assert stats.free_runs(snap).tolist() == [1, 2]


# -- internal fragmentation -----------------------------------------------------------------------------------------
def test_internal_fragmentation_full_pool():
    # Slot 0 owns pages 1,2 (committed 20 of 32 slots), slot 3 owns page 5 (committed 5 of 16): 1 - 25/48.
    led = ledger(slots=[0, 3], allocated=[32, 16], committed=[20, 5])
    snap = pool(owner_with(8, {1: 0, 2: 0, 5: 3}, default=FREE), led=led)
    assert stats.internal_fragmentation(snap) == pytest.approx(1 - 25 / 48)


def test_internal_fragmentation_ignores_unowned_dead_and_pageless():
    # Page 3 is unattributed, page 4 belongs to a finished (leaked) slot 7: neither counts. Slot 2 is live but
    # owns no page here: its committed tokens do not count either.
    led = ledger(slots=[0, 3, 2], allocated=[32, 16, 16], committed=[20, 5, 16])
    snap = pool(owner_with(8, {1: 0, 2: 0, 5: 3, 3: USED_UNOWNED, 4: 7}, default=FREE), led=led)
    assert stats.internal_fragmentation(snap) == pytest.approx(1 - 25 / 48)


def test_internal_fragmentation_swa_pool_subtracts_evicted():
    # SWA pool, page size 16: slot 0 committed 100, evicted 64, owns 3 SWA pages (48 slots) -> 36 tokens held;
    # slot 1 committed 10, evicted 0, owns 1 page -> 10. 1 - 46/64. The full pool ignores evicted.
    led = ledger(slots=[0, 1], allocated=[112, 16], committed=[100, 10], evicted=[64, 0], window=32)
    swa = pool(owner_with(6, {1: 0, 2: 0, 3: 0, 4: 1}, default=FREE), name="swa", led=led)
    assert stats.internal_fragmentation(swa) == pytest.approx(1 - 46 / 64)
    full_owner = owner_with(10, dict.fromkeys(range(1, 8), 0) | {8: 1}, default=FREE)
    full = pool(full_owner, name="full", led=led)
    assert stats.internal_fragmentation(full) == pytest.approx(1 - 110 / 128)


def test_internal_fragmentation_edge_cases():
    assert stats.internal_fragmentation(pool(owner_with(4, {}, default=FREE))) == 0.0
    # Only unattributed pages: nothing allocated to a live request.
    assert stats.internal_fragmentation(pool(owner_with(4, {}), led=ledger([0], [16], [3]))) == 0.0
    # No page waste at all, and a ledger claiming more than its pages hold: clamped to [0, 1].
    assert stats.internal_fragmentation(pool(owner_with(4, {1: 0}, default=FREE), led=ledger([0], [16], [16]))) == 0.0
    assert stats.internal_fragmentation(pool(owner_with(4, {1: 0}, default=FREE), led=ledger([0], [32], [30]))) == 0.0
    # Evicted beyond committed gives no negative tokens: all slots wasted.
    led = ledger([0], [32], [10], evicted=[16])
    assert stats.internal_fragmentation(pool(owner_with(4, {1: 0}, default=FREE), name="swa", led=led)) == 1.0


# -- request-level figures ------------------------------------------------------------------------------------------
def test_swa_outside_window_tokens_worked_example():
    # window 32: (100 - 32) - 64 = 4; (50 - 32) - 0 = 18; (20 - 32) -> 0; (200 - 32) - 192 -> 0 (clamped).
    led = ledger(
        slots=[0, 1, 2, 3],
        allocated=[112, 64, 32, 208],
        committed=[100, 50, 20, 200],
        evicted=[64, 0, 0, 192],
        window=32,
    )
    assert stats.swa_outside_window_tokens(led) == 4 + 18
    no_window = ledger(slots=[0], allocated=[112], committed=[100], window=None)
    assert stats.swa_outside_window_tokens(no_window) == 0
    assert stats.swa_outside_window_tokens(ledger(window=8)) == 0


def test_requests_live_counts_only_requests_holding_kv():
    led = ledger(slots=[0, 1, 2], allocated=[16, 0, 48], committed=[3, 0, 40])
    assert stats.requests_live(led) == 2
    assert stats.requests_live(ledger()) == 0
    # Also reads the ledger of a PoolSnapshot or a dict of them.
    snap = pool(owner_with(4, {}), led=led)
    assert stats.requests_live(snap) == 2
    assert stats.requests_live({"full": snap}) == 2


def test_pool_figures_and_figures_agree_with_the_single_functions():
    led = ledger(slots=[0, 3], allocated=[32, 16], committed=[20, 5], evicted=[0, 0], window=8)
    codes = {1: 0, 2: 0, 3: FREE, 4: FREE, 5: 3, 6: STAGED, 7: FREE, 8: USED_UNOWNED}
    full = pool(owner_with(10, codes, default=PRISTINE), led=led)
    swa = pool(owner_with(4, {1: 0, 2: 3}, default=FREE), name="swa", led=led)
    f = stats.pool_figures(full)
    assert f["pool"] == "full" and f["page_size"] == 16 and f["num_pages"] == 10 and f["step"] == 3
    assert f["pages_by_state"] == stats.pages_by_state(full)
    assert f["pages_by_state"] == {"free": 5, "used": 4, "staged": 1, "reserved": 1}
    assert f["free_runs"].tolist() == stats.free_runs(full).tolist() == [2, 1, 2]
    assert f["free_run_count"] == stats.free_run_count(full) == 3
    assert f["largest_free_run"] == stats.largest_free_run(full) == 2
    assert f["external_fragmentation"] == stats.external_fragmentation(full) == pytest.approx(1 - 2 / 5)
    assert f["internal_fragmentation"] == stats.internal_fragmentation(full) == pytest.approx(1 - 25 / 48)
    g = stats.figures({"full": full, "swa": swa})
    assert set(g["pools"]) == {"full", "swa"}
    assert g["pools"]["swa"]["internal_fragmentation"] == pytest.approx(1 - 25 / 32)
    assert g["page_size_tokens"] == 16
    assert g["requests_live"] == 2
    assert g["swa_outside_window_tokens"] == (20 - 8) + 0
    assert stats.figures({})["pools"] == {}


# -- free runs against a plain Python reference -----------------------------------------------------------------------
def reference_runs(owner) -> list[int]:
    runs, current = [], 0
    for code in owner:
        if code in (FREE, PRISTINE):
            current += 1
        elif current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    return runs


@given(st.lists(st.sampled_from([*ALL_CODES, 0, 1, 7]), min_size=0, max_size=300))
def test_free_runs_match_reference(codes):
    owner = np.array([RESERVED, *codes], np.int32)
    snap = pool(owner)
    expected = reference_runs(owner)
    assert stats.free_runs(snap).tolist() == expected
    assert stats.free_run_count(snap) == len(expected)
    assert stats.largest_free_run(snap) == max(expected, default=0)
    n_free = sum(expected)
    want = 0.0 if n_free == 0 else 1 - max(expected) / n_free
    assert stats.external_fragmentation(snap) == pytest.approx(want)
    counts = stats.pages_by_state(snap)
    assert sum(counts.values()) == owner.size
    assert counts["free"] == n_free
    assert counts["staged"] == sum(c in (STAGED, HELD_SET, HELD_IDS) for c in codes)
    assert counts["used"] == sum(c >= USED_UNOWNED for c in codes)


# -- a real snapshot from the wrapper ----------------------------------------------------------------------------------
def t(values):
    return torch.tensor(values, dtype=torch.int64)


def extend(alloc, rids, seqs):
    """Empty-prefix extend for ``rids`` with ``seqs`` tokens each."""
    n = len(seqs)
    with alloc.batch(rids):
        return alloc.alloc_extend(t([0] * n), t([0] * n), t(seqs), t(seqs), t([-1] * n), sum(seqs))


@pytest.mark.parametrize("need_sort", [False, True])
def test_snapshot_of_a_wrapped_paged_allocator(need_sort):
    ps, num_pages = 4, 10
    inner = PagedTokenToKVPoolAllocator(num_pages * ps, ps, torch.float16, "cpu", need_sort=need_sort)
    alloc = InstrumentedAllocator(inner, mode="raise")

    # "a": 9 tokens -> pages 1,2,3 (head of the free list); "b": 6 tokens -> pages 4,5. Pages 6..10 never used.
    out = extend(alloc, ["a", "b"], [9, 6])
    snaps = alloc.snapshot()
    assert set(snaps) == {"full"}
    snap = snaps["full"]
    assert stats.pages_by_state(snap) == {"free": 5, "used": 5, "staged": 0, "reserved": 1}
    assert stats.free_runs(snap).tolist() == [5]
    assert stats.external_fragmentation(snap) == 0.0
    # 5 pages = 20 slots hold 15 committed tokens.
    assert stats.internal_fragmentation(snap) == pytest.approx(1 - 15 / 20)
    assert stats.requests_live(snap.ledger) == 2

    # Free "a": pages 1,2,3 go back to the head of the free list (need_sort: into staging, not allocatable).
    alloc.free(out[:9])
    snap = alloc.snapshot()["full"]
    if need_sort:
        assert stats.pages_by_state(snap) == {"free": 5, "used": 2, "staged": 3, "reserved": 1}
        assert stats.free_runs(snap).tolist() == [5]
        assert stats.external_fragmentation(snap) == 0.0
    else:
        assert stats.pages_by_state(snap) == {"free": 8, "used": 2, "staged": 0, "reserved": 1}
        assert stats.free_runs(snap).tolist() == [3, 5]
        assert stats.external_fragmentation(snap) == pytest.approx(1 - 5 / 8)
    # "b": 2 pages = 8 slots, 6 committed. "a" is still live in the ledger but holds no KV.
    assert stats.internal_fragmentation(snap) == pytest.approx(1 - 6 / 8)
    assert stats.requests_live(snap.ledger) == 1
    alloc.release_request("a")

    if not need_sort:
        # "c": 4 tokens -> one page from the head of the free list: page 1, splitting the first run.
        extend(alloc, ["c"], [4])
        f = stats.figures(alloc.snapshot())
        full = f["pools"]["full"]
        assert full["pages_by_state"] == {"free": 7, "used": 3, "staged": 0, "reserved": 1}
        assert full["free_runs"].tolist() == [2, 5]
        assert full["internal_fragmentation"] == pytest.approx(1 - (6 + 4) / 12)
        assert f["requests_live"] == 2
        assert f["swa_outside_window_tokens"] == 0
        assert f["page_size_tokens"] == ps
    assert list(alloc.violations) == []
