"""Host-side shadow of one pool's page states: what the checks, snapshots and statistics read.

Contract:
- ``owner`` is a numpy int32 array with one entry per page (index = page id, page 0 included). A value >= 0 is
  the ledger slot of the request that owns the page; negative values are the codes of ``pagecodes``. One array
  carries both state and owner so that a decode batch is checked with one gather and one comparison.
- The shadow is updated from host-side facts (``*_cpu`` arguments, Python ints) and from the values of handed-out
  and freed indices *after they reached the host* (at once for CPU tensors, at the next step boundary for
  accelerator tensors: see ``wrapper.verify``). Nothing here touches a device tensor.
- Every check returns ``(invariant_id, message, slot)`` tuples (slot -1 when no request is concerned) and the
  shadow then mirrors what the inner allocator actually did, so one fault is reported once, under one id.
- ``expected_entries`` is the number of entries the inner allocator's free list plus staged list should hold;
  it can exceed the number of free pages after a double free (the inner then lists a page twice).
- ``version`` counts the changes of ``owner`` (every write goes through ``_set`` or ``clear``, or bumps it):
  equal versions mean an unchanged ``owner``, which is what lets the wrapper skip re-reading pages it verified.
- Not thread-safe by itself (the wrapper serialises).

The allocation checks live in ``shadow_alloc``, the free checks in ``shadow_free``, the codes and snapshots in
``pagecodes`` and the array helpers in ``pagearrays``; every name is importable from here as before.
"""

from __future__ import annotations

import numpy as np

from instrumented_alloc.pagearrays import entry_ids, has_repeat, sorted_unique
from instrumented_alloc.pagecodes import (
    FREE,
    HELD_IDS,
    HELD_SET,
    PRISTINE,
    RESERVED,
    SLOT_MASK,
    STAGED,
    STATE_NAMES,
    USED_UNOWNED,
    LedgerSnapshot,
    PoolSnapshot,
    describe,
    pages_list,
)
from instrumented_alloc.shadow_alloc import AllocChecks
from instrumented_alloc.shadow_free import FreeChecks

__all__ = [
    "FREE",
    "HELD_IDS",
    "HELD_SET",
    "PRISTINE",
    "RESERVED",
    "STAGED",
    "STATE_NAMES",
    "USED_UNOWNED",
    "LedgerSnapshot",
    "PoolShadow",
    "PoolSnapshot",
    "entry_ids",
    "has_repeat",
    "pages_list",
    "sorted_unique",
]

_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)


class PoolShadow(AllocChecks, FreeChecks):
    """One pool's shadow: the state below, written here and by the allocation and free checks it inherits
    (``shadow_alloc.AllocChecks``, ``shadow_free.FreeChecks``). The wrapper's fast paths write ``owner`` too, and
    bump ``version`` when they do."""

    def __init__(self, name: str, page_size: int, num_pages: int, *, dedup_free: bool, need_sort: bool, ledger):
        self.name = name
        self.page_size = page_size
        self.num_pages = num_pages
        self.dedup_free = dedup_free
        self.need_sort = need_sort
        self._ledger = ledger
        # ``owner`` is a view of ``_owner_ext``, which has one guard entry past the last page (reads as reserved):
        # a gather with ``take(mode="clip")`` then maps any page id outside the pool onto page 0 (below) or the
        # guard (above), both reserved, which no fast-path check accepts; the general path then names the fault.
        # One range check without the two comparisons and the reduction it costs otherwise.
        self._owner_ext = np.empty(num_pages + 2, np.int32)
        self._owner_ext[-1] = RESERVED
        self.owner = self._owner_ext[:-1]
        # The request that last owned each page, to name it behind a double free of a page already free: its slot
        # and the slot's generation then (a slot released since names another request), packed in one int64 as
        # ``slot | generation << 32`` (one store per free instead of two); -1: none.
        self.last_freed = np.empty(num_pages + 1, np.int64)
        # When not None, every change of ``owner`` is appended here as (pages, codes) for the wrapper to publish
        # (``PageUpdate`` events: what a recording replays; entries known to change nothing are left out, see
        # ``note``). None when no sink listens: no cost.
        self.deltas: list | None = None
        self.version = 0
        # The slot offsets within a page (int64): a page's slots are its first slot + these (page-run checks).
        self.offsets = np.arange(page_size, dtype=np.int64)
        self.clear()

    def _set(self, pages: np.ndarray, codes, *, private: bool = False) -> None:
        """``owner[pages] = codes``, recorded in ``deltas`` when they are kept. The delta's arrays belong to the
        event made of it: copies, unless ``private`` (the caller guarantees that nothing ever writes ``pages``
        (int64) nor ``codes`` (int32, same shape) again: a fresh array no one else holds, or a read-only one that
        owns its memory)."""
        self.owner[pages] = codes
        self.version += 1
        if self.deltas is not None and pages.size:
            self.note(pages, codes, private=private)

    def note(self, pages: np.ndarray, codes, *, private: bool = False) -> None:
        """Record the delta ``owner[pages] = codes`` (deltas kept, ``pages`` not empty) for a change already made:
        what a ``PageUpdate`` carries (see its contract in ``events.py``). Callers leave out the entries they
        already know change nothing (a decode's requests that continue their pages, an extend's repeats of one
        page) and never note a delta whose every entry is known to change nothing. ``private`` as in ``_set``."""
        if isinstance(codes, np.ndarray) and codes.shape == pages.shape:
            if not (private and codes.dtype is _I32):
                # A copy: the event owns it (ndarray.copy() is half the cost of astype(copy=True)).
                codes = codes.copy() if codes.dtype is _I32 else codes.astype(np.int32)
        else:
            c = np.empty(pages.shape, np.int32)
            c.fill(codes)  # np.full, without its Python wrapper (twice the cost)
            codes = c
        if not (private and pages.dtype is _I64):
            pages = pages.copy() if pages.dtype is _I64 else pages.astype(np.int64)
        self.deltas.append((pages, codes))

    def take_deltas(self) -> list:
        out, self.deltas = self.deltas, ([] if self.deltas is not None else None)
        return out or []

    def clear(self) -> None:
        self.version += 1
        self.owner.fill(PRISTINE)
        self.owner[0] = RESERVED
        self.last_freed.fill(-1)
        if self.deltas is not None:
            self.deltas.append((np.arange(self.owner.size, dtype=np.int64), self.owner.copy()))
        self.expected_entries = self.num_pages
        self.held_set: list[np.ndarray] = []
        self.held_ids: list[np.ndarray] = []
        self.in_group = False
        self.n_staged = 0
        self.unexplained_loss = 0
        self.reported: set = set()
        # A free released a page that was not in use, or one page twice: the inner's free list may now list a page
        # more than once, and hand it out twice in one call. Page size 1 looks for that only from then on (its fast
        # path sorts the call's slots: a prefill's every token); larger pages always (ids written at one entry per
        # page and read back, see ``_opened_twice``). Until ``clear()``.
        self.relisted = False

    @property
    def owned(self) -> np.ndarray:
        return self._ledger.owned[self.name]

    # -- conservation -----------------------------------------------------------------------------------------
    def check_count(self, inner_entries: int, op: str) -> list:
        """Count conservation: the inner's free+staged entries against the shadow's expectation (host ints)."""
        delta = inner_entries - self.expected_entries
        if delta == 0:
            return []
        self.expected_entries = inner_entries
        if delta < 0:
            self.unexplained_loss += -delta
            what = f"{-delta} pages left the free list without being handed out"
        else:
            what = f"{delta} pages appeared in the free list without being freed"
        return [
            (
                "pool_conservation",
                f"{op}: pool {self.name} has {inner_entries} free+staged pages, the shadow expected "
                f"{inner_entries - delta}: {what}",
                -1,
            )
        ]

    def check_census(self, census: np.ndarray) -> list:
        """Full sweep against the inner's free list + staging (host copy). May be slow; never on the hot path."""
        bad: list = []
        owner = self.owner
        n = owner.size
        inrange = census[(census >= 0) & (census < n)]
        counts = np.bincount(inrange, minlength=n)
        expected_in_list = (owner <= FREE) | (owner == STAGED)
        lost = np.flatnonzero(expected_in_list & (counts == 0))
        if lost.size:
            explained = min(self.unexplained_loss, lost.size)
            self.unexplained_loss -= explained
            self._set(lost, USED_UNOWNED)  # the allocator no longer lists them: they are not allocatable
            if lost.size > explained:
                bad.append(
                    (
                        "pool_conservation",
                        f"sweep: pool {self.name}: {pages_list(lost)} are neither in the free list nor handed out"
                        + self._last_owner(int(lost[0])),
                        -1,
                    )
                )
        both = np.flatnonzero(~expected_in_list & (counts > 0) & (owner >= USED_UNOWNED))
        new_both = [int(p) for p in both if ("both", int(p)) not in self.reported]
        if new_both:
            self.reported.update(("both", p) for p in new_both)
            p0 = new_both[0]
            bad.append(
                (
                    "pool_conservation",
                    f"sweep: pool {self.name}: {pages_list(np.asarray(new_both))} are in the free list and in use "
                    f"(page {p0} is {describe(int(owner[p0]))})",
                    int(owner[p0]) if owner[p0] >= 0 else -1,
                )
            )
        dups = np.flatnonzero(counts > 1)
        new_dups = [int(p) for p in dups if ("dup", int(p)) not in self.reported]
        if new_dups and census.size != self.expected_entries:
            bad.append(
                (
                    "pool_conservation",
                    f"sweep: pool {self.name}: {pages_list(np.asarray(new_dups))} are listed more than once "
                    "in the free list",
                    -1,
                )
            )
        self.reported.update(("dup", p) for p in new_dups)
        self.expected_entries = int(census.size)
        return bad

    def _last_owner(self, page: int) -> str:
        """``; page P was last owned by request R`` (from ``last_freed``) when the wrapper saw it freed, and the
        request's slot has not named another request since; else nothing."""
        packed = self.last_freed.item(page)
        if packed < 0:
            return ""
        slot = packed & SLOT_MASK
        if self._ledger.generation.item(slot) != packed >> 32:
            return f"; page {page} was last freed by request slot {slot}, released since"
        return f"; page {page} was last owned by request {self._ledger.rid_of(slot)!r}, which freed it"

    def counts(self) -> dict[str, int]:
        o = self.owner
        return {
            "free": int(np.count_nonzero(o <= FREE)),
            "used": int(np.count_nonzero(o >= USED_UNOWNED)),
            "staged": int(np.count_nonzero((o >= HELD_IDS) & (o <= STAGED))),
            "reserved": int(np.count_nonzero(o == RESERVED)),
        }
