"""The page codes of a pool's owner array, and the snapshots the statistics, replay and dashboard read.

Contract: ``owner[page]`` >= 0 is the ledger slot of the request that owns the page; a negative value is one of the
codes below. The free-like codes are the lowest, so "allocatable" is one comparison (``owner <= FREE``), and the
codes run PRISTINE .. USED_UNOWNED without gaps (``stats`` bins them by ``owner - PRISTINE``). Changing a code's
value changes the recordings' format: recorded ``PageUpdate`` events carry these codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

USED_UNOWNED = -1  # handed out to no known request (unattributed call, or lost by the allocator)
RESERVED = -2  # page 0, the padding sink
STAGED = -3  # freed, waiting in need_sort staging (counted by available_size, not yet allocatable)
HELD_SET = -4  # freed by a set-shaped free() inside an open free group
HELD_IDS = -5  # freed by a page-id free (free_page_ids, free_segment) inside an open free group
FREE = -6  # in the free list, handed out before
PRISTINE = -7  # in the free list, never handed out since clear()

STATE_NAMES = {
    USED_UNOWNED: "used",
    RESERVED: "reserved",
    STAGED: "staged",
    HELD_SET: "staged",
    HELD_IDS: "staged",
    FREE: "free",
    PRISTINE: "free",
}

# ``PoolShadow.last_freed`` packs ``slot | generation << 32`` in one int64: the slot is the low 32 bits.
SLOT_MASK = (1 << 32) - 1


def pages_list(pages: np.ndarray, limit: int = 8) -> str:
    """``[3, 4, ...] (12 pages)``: the first ``limit`` pages of a violation's message."""
    shown = ", ".join(str(int(p)) for p in pages[:limit])
    return f"[{shown}{', ...' if pages.size > limit else ''}] ({pages.size} pages)"


def describe(code: int) -> str:
    """What an owner code means, for a violation's message."""
    return f"owned by request slot {code}" if code >= 0 else STATE_NAMES.get(int(code), "?")


@dataclass(frozen=True)
class LedgerSnapshot:
    """The ledger columns of the live requests at snapshot time (one entry per live request)."""

    rids: tuple
    slots: np.ndarray
    allocated: np.ndarray
    committed: np.ndarray
    evicted: np.ndarray
    sliding_window: int | None


@dataclass(frozen=True)
class PoolSnapshot:
    """One pool at one step: a copy of the shadow's ``owner`` codes plus the ledger's live requests."""

    pool: str
    page_size: int
    num_pages: int
    owner: np.ndarray
    step: int
    ledger: LedgerSnapshot
    slot_rids: dict
