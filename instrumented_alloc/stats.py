"""Allocator statistics: the figures of the metric catalog (docs/metrics.md), computed from snapshots.

Contract:
- Pure: every function reads a ``PoolSnapshot`` (``LedgerSnapshot`` for the request-level figures, or a dict of
  snapshots as ``InstrumentedAllocator.snapshot()`` returns) and returns plain Python numbers, dicts or numpy
  arrays. No I/O, no state, no mutation of the snapshot, no imports beyond numpy and this package.
- Cost: O(num_pages), vectorised (a handful of numpy passes over the ``owner`` array, no Python loop over pages
  or requests); about a few milliseconds at a million pages. Still never called per allocator call: exporters
  call it at scrape time (single process) or at a step boundary (multiprocess), rate-limited.
- Page states follow ``shadow.STATE_NAMES``: owner >= -1 (``USED_UNOWNED`` or a request slot) is "used",
  ``RESERVED`` "reserved", ``STAGED``/``HELD_SET``/``HELD_IDS`` "staged" (freed, not yet allocatable),
  ``FREE``/``PRISTINE`` "free". Page 0 (reserved) is counted, so the states sum to ``num_pages + 1``.
- "Free run": a maximal run of consecutive page ids that are all free (staged pages break a run: they are
  not allocatable).
- Every ratio is a float in [0, 1], 0.0 when its denominator is 0.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from instrumented_alloc.shadow import (
    FREE,
    HELD_IDS,
    PRISTINE,
    RESERVED,
    STAGED,
    USED_UNOWNED,
    LedgerSnapshot,
    PoolSnapshot,
)

STATES = ("free", "used", "staged", "reserved")

# Codes are PRISTINE (-7) .. USED_UNOWNED (-1), then request slots >= 0: ``owner - PRISTINE`` is a bincount index.
_SHIFT = -PRISTINE
_FREE_BINS = slice(PRISTINE + _SHIFT, FREE + _SHIFT + 1)  # PRISTINE, FREE
_STAGED_BINS = slice(HELD_IDS + _SHIFT, STAGED + _SHIFT + 1)  # HELD_IDS, HELD_SET, STAGED
_RESERVED_BIN = RESERVED + _SHIFT
_USED_FROM = USED_UNOWNED + _SHIFT  # USED_UNOWNED, then request slot s at _USED_FROM + 1 + s


# -- helpers ------------------------------------------------------------------------------------------------------
def _census(owner: np.ndarray, minlength: int = 0) -> np.ndarray:
    """Pages per code/slot in one pass: index ``code + 7`` (codes below PRISTINE count as PRISTINE)."""
    minlength = max(minlength, _USED_FROM + 1)
    shifted = owner + _SHIFT  # owner's own dtype (int32): bincount widens it once
    try:
        return np.bincount(shifted, minlength=minlength)
    except ValueError:  # a code below PRISTINE (not written by the shadow): count it as free, like owner <= FREE
        return np.bincount(np.maximum(shifted, 0), minlength=minlength)


def _states(counts: np.ndarray) -> dict[str, int]:
    return {
        "free": int(counts[_FREE_BINS].sum()),
        "used": int(counts[_USED_FROM:].sum()),
        "staged": int(counts[_STAGED_BINS].sum()),
        "reserved": int(counts[_RESERVED_BIN]),
    }


def _runs(free: np.ndarray) -> np.ndarray:
    """Lengths of the maximal runs of True in a boolean mask, in order."""
    if not free.size:
        return np.zeros(0, np.int64)
    padded = np.zeros(free.size + 2, bool)
    padded[1:-1] = free
    edges = np.flatnonzero(padded[1:] != padded[:-1])  # alternating run starts and run ends (exclusive)
    return (edges[1::2] - edges[::2]).astype(np.int64, copy=False)


def _ext_frag(runs: np.ndarray) -> float:
    total = int(runs.sum())
    if total == 0:
        return 0.0
    return float(min(1.0, max(0.0, 1.0 - int(runs.max()) / total)))


def _int_frag(snap: PoolSnapshot, counts: np.ndarray) -> float:
    led = snap.ledger
    slots = np.asarray(led.slots, np.int64)
    if not slots.size:
        return 0.0
    per_slot = counts[_USED_FROM + 1 :]  # pages owned by slot s at index s
    in_range = (slots >= 0) & (slots < per_slot.size)
    pages = np.zeros(slots.size, np.int64)
    pages[in_range] = per_slot[slots[in_range]]
    allocated = int(pages.sum()) * int(snap.page_size)
    if allocated <= 0:
        return 0.0
    holders = pages > 0
    committed = np.asarray(led.committed, np.int64)[holders]
    if snap.pool == "swa":
        committed = np.maximum(0, committed - np.asarray(led.evicted, np.int64)[holders])
    return float(min(1.0, max(0.0, 1.0 - int(committed.sum()) / allocated)))


def _min_census_len(snap: PoolSnapshot) -> int:
    slots = np.asarray(snap.ledger.slots)
    return int(slots.max()) + _USED_FROM + 2 if slots.size else 0


def _ledger_of(x) -> LedgerSnapshot:
    """The ledger columns of a LedgerSnapshot, a PoolSnapshot or a dict of PoolSnapshots."""
    if isinstance(x, LedgerSnapshot):
        return x
    if isinstance(x, PoolSnapshot):
        return x.ledger
    if isinstance(x, Mapping):
        if not x:
            raise ValueError("an empty dict of snapshots has no ledger")
        return next(iter(x.values())).ledger
    raise TypeError(f"expected a LedgerSnapshot, PoolSnapshot or dict of them, got {type(x).__name__}")


# -- per pool -----------------------------------------------------------------------------------------------------
def pages_by_state(snap: PoolSnapshot) -> dict[str, int]:
    """Pages by state: keys exactly "free", "used", "staged", "reserved"; they sum to ``num_pages + 1``."""
    return _states(_census(snap.owner))


def free_mask(snap: PoolSnapshot) -> np.ndarray:
    """True where the page is free (in the free list: FREE or PRISTINE), one entry per page id."""
    return snap.owner <= FREE


def free_runs(snap: PoolSnapshot) -> np.ndarray:
    """Lengths (int64) of the maximal runs of consecutive free pages, by page id, in page order."""
    return _runs(free_mask(snap))


def free_run_count(snap: PoolSnapshot) -> int:
    """Number of maximal runs of consecutive free pages."""
    return int(free_runs(snap).size)


def largest_free_run(snap: PoolSnapshot) -> int:
    """The longest run of consecutive free pages (0 when nothing is free)."""
    runs = free_runs(snap)
    return int(runs.max()) if runs.size else 0


def external_fragmentation(snap: PoolSnapshot) -> float:
    """1 - largest free run / free pages; 0.0 when nothing is free."""
    return _ext_frag(free_runs(snap))


def internal_fragmentation(snap: PoolSnapshot) -> float:
    """1 - committed tokens / allocated slots in this pool, clamped to [0, 1]; 0.0 when nothing is allocated.

    Allocated slots: pages owned by live requests (the ledger snapshot's slots) times the page size; pages of
    finished (leaked) requests and unattributed pages are not counted. Committed tokens, over the live requests
    that own pages in this pool: ``committed`` for the full pool, ``max(0, committed - evicted)`` for the pool
    named "swa" (the sliding-window tokens still held).
    """
    return _int_frag(snap, _census(snap.owner, _min_census_len(snap)))


def pool_figures(snap: PoolSnapshot) -> dict:
    """Every per-pool figure in one call (one census pass and one run pass over the pages).

    Keys: pool, step, page_size, num_pages, pages_by_state (dict), free_runs (int64 array), free_run_count,
    largest_free_run, external_fragmentation, internal_fragmentation.
    """
    counts = _census(snap.owner, _min_census_len(snap))
    runs = _runs(free_mask(snap))
    return {
        "pool": snap.pool,
        "step": int(snap.step),
        "page_size": int(snap.page_size),
        "num_pages": int(snap.num_pages),
        "pages_by_state": _states(counts),
        "free_runs": runs,
        "free_run_count": int(runs.size),
        "largest_free_run": int(runs.max()) if runs.size else 0,
        "external_fragmentation": _ext_frag(runs),
        "internal_fragmentation": _int_frag(snap, counts),
    }


# -- request level ------------------------------------------------------------------------------------------------
def swa_outside_window_tokens(ledger_snapshot) -> int:
    """Tokens still holding SWA KV though outside the window: sum over live requests of
    ``max(0, committed - window - evicted)``; 0 when there is no sliding window.

    Accepts a LedgerSnapshot, a PoolSnapshot or a dict of them (the ledger is shared by all pools)."""
    led = _ledger_of(ledger_snapshot)
    if led.sliding_window is None:
        return 0
    committed = np.asarray(led.committed, np.int64)
    evicted = np.asarray(led.evicted, np.int64)
    return int(np.maximum(0, committed - int(led.sliding_window) - evicted).sum())


def requests_live(ledger_snapshot) -> int:
    """Live requests that hold KV (allocated > 0). Accepts what ``swa_outside_window_tokens`` accepts."""
    return int(np.count_nonzero(np.asarray(_ledger_of(ledger_snapshot).allocated) > 0))


def figures(snapshots: Mapping[str, PoolSnapshot]) -> dict:
    """All figures of ``alloc.snapshot()``'s result: ``{"pools": {name: pool_figures}, "page_size_tokens",
    "requests_live", "swa_outside_window_tokens", "step"}`` (globals read from the shared ledger snapshot).
    A single PoolSnapshot is taken as a dict of one; an empty dict gives zeros."""
    if isinstance(snapshots, PoolSnapshot):
        snapshots = {snapshots.pool: snapshots}
    pools = {name: pool_figures(s) for name, s in snapshots.items()}
    if not snapshots:
        return {"pools": pools, "page_size_tokens": 0, "requests_live": 0, "swa_outside_window_tokens": 0, "step": 0}
    first = next(iter(snapshots.values()))
    return {
        "pools": pools,
        "page_size_tokens": int(first.page_size),
        "requests_live": requests_live(first.ledger),
        "swa_outside_window_tokens": swa_outside_window_tokens(first.ledger),
        "step": int(first.step),
    }
