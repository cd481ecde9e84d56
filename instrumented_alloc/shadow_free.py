"""The free half of ``PoolShadow``: judging a free before the inner runs it, mirroring it after, free groups.

Contract (``PoolShadow`` inherits these methods; they read and write its state, see ``shadow.py``):
- ``plan_free`` judges a free before the inner runs it and writes no page (only ``relisted``); ``apply_free`` (or
  ``free_owned``, for a free the wrapper's fast path judged) mirrors it once the inner changed its free lists, so
  a free the wrapper stops (mode raise) or the inner refuses leaves ``owner`` as it was.
- Inside a free group the freed pages are held (``HELD_SET``/``HELD_IDS``), neither free nor owned, until
  ``group_end`` releases them (or ``group_abandon`` leaves them held, as the inner did).
- ``expected_entries`` grows by the entries the inner lists (a page freed twice without dedup counts twice).
"""

from __future__ import annotations

import numpy as np

from instrumented_alloc.pagearrays import has_repeat, sorted_unique
from instrumented_alloc.pagecodes import (
    FREE,
    HELD_IDS,
    HELD_SET,
    PRISTINE,
    RESERVED,
    SLOT_MASK,
    STAGED,
    USED_UNOWNED,
    describe,
    pages_list,
)

_MAX = np.maximum.reduce


class FreeChecks:
    """Mixin of ``PoolShadow``: frees, free groups and the need_sort merge. Holds no state of its own."""

    def plan_free(self, pages: np.ndarray, *, dedup: bool, op: str, unmapped: np.ndarray | None = None):
        """Check a free of ``pages`` (one entry per page the inner will release; ``dedup``: the inner frees
        each distinct page once). ``unmapped`` masks entries already reported as SWA mapping faults (they
        are counted but not judged again). Returns (violations, plan) for ``apply_free``.

        The usual free (every page in range and in use, no repeat where the inner does not dedup) is judged
        with one clipped gather and one count; anything else is judged again, entry by entry, below."""
        if dedup:
            pages = sorted_unique(pages)
        if unmapped is None:
            prev = self._owner_ext.take(pages, mode="clip")
            if self.in_group and dedup:
                busy = np.count_nonzero((prev < USED_UNOWNED) & (prev != HELD_SET))
            else:
                busy = np.count_nonzero(prev < USED_UNOWNED)
            if not busy and (dedup or not has_repeat(pages)):
                return [], (pages, pages, prev, int(pages.size), dedup)
        bad: list = []
        n_entries = int(pages.size)
        owner = self.owner
        valid = (pages >= 1) & (pages < owner.size)
        if unmapped is not None:
            valid &= ~unmapped
        if not valid.all():
            judged = pages if unmapped is None else pages[~unmapped]
            zero = judged[judged == 0]
            if zero.size:
                bad.append(("reserved_page_touched", f"{op} frees reserved page 0", -1))
            oob = judged[(judged < 0) | (judged >= owner.size)]
            if oob.size:
                bad.append(
                    (
                        "free_unallocated",
                        f"{op} frees pages outside the pool (valid 1..{self.num_pages}): {pages_list(oob)}",
                        -1,
                    )
                )
            vpages = pages[valid]
        else:
            vpages = pages
        prev = owner[vpages]
        inuse = prev >= USED_UNOWNED
        if self.in_group and dedup:
            # A second set-shaped free of a page held by this group is merged by the inner's own dedup.
            inuse |= prev == HELD_SET
        if not inuse.all():
            bad += self._classify_free(vpages, prev, inuse, op)
            self.relisted = True
        if not dedup and vpages.size > 1 and has_repeat(vpages):
            self.relisted = True
            u, first, counts = np.unique(vpages, return_index=True, return_counts=True)
            twice = u[counts > 1]
            slot = int(owner[twice[0]])
            bad.append(
                (
                    "double_free",
                    f"{op} frees {pages_list(twice)} more than once in one call (no dedup on this path)",
                    slot if slot >= 0 else -1,
                )
            )
            # The inner lists every entry again (n_entries), but a page is released once: its owner's count loses
            # it once (apply_free counts owners over vpages).
            vpages, prev = u, prev[first]
        return bad, (pages, vpages, prev, n_entries, dedup)

    def _classify_free(self, vpages, prev, inuse, op) -> list:
        bad = []
        idx = np.flatnonzero(~inuse)
        bp, bprev = vpages[idx], prev[idx]
        unalloc = bprev == PRISTINE
        reserved = bprev == RESERVED
        double = ~unalloc & ~reserved
        if double.any():
            page = int(bp[double][0])
            packed = self.last_freed.item(page)
            last = packed & SLOT_MASK if packed >= 0 else -1
            if last >= 0 and self._ledger.generation.item(last) != packed >> 32:
                last = -1  # that request was released since; its slot now names another one
            bad.append(
                (
                    "double_free",
                    f"{op} frees {pages_list(np.unique(bp[double]))} that are not in use "
                    f"(page {page} is {describe(int(bprev[double][0]))}"
                    + (f", last owned by request slot {last})" if last >= 0 else ")"),
                    last,
                )
            )
        if unalloc.any():
            bad.append(
                (
                    "free_unallocated",
                    f"{op} frees {pages_list(np.unique(bp[unalloc]))} never handed out since clear()",
                    -1,
                )
            )
        if reserved.any():
            bad.append(("reserved_page_touched", f"{op} frees reserved page 0", -1))
        return bad

    def apply_free(self, plan) -> np.ndarray:
        """Mirror the inner's free. Returns the distinct owner slots (>= 0) of the pages that were in use."""
        pages, vpages, prev, n_entries, dedup = plan
        n = prev.size
        first = int(prev[0]) if n else -1
        if first >= 0 and prev.tobytes() == prev[:1].tobytes() * n:
            # The usual free: every page owned by one request. Scalars instead of masks and gathers.
            owned = self.owned
            self.last_freed[vpages] = first | self._ledger.generation.item(first) << 32
            if self.name == "full":
                peak = self._ledger.peak_pages
                peak[first] = max(int(peak[first]), int(owned[first]))
            owned[first] -= n
            self._release(pages, vpages, n_entries, dedup)
            return prev[:1]
        owned_mask = prev >= 0
        owners = prev[owned_mask]
        u = owners
        if owners.size:
            self.last_freed[vpages[owned_mask]] = owners.astype(np.int64) | self._ledger.generation[owners] << 32
            owned = self.owned
            first = owners[0]
            if (owners == first).all():  # the usual case: one request's row, in Python ints
                u = owners[:1]
                s = int(first)
                if self.name == "full":
                    peak = self._ledger.peak_pages
                    peak[s] = max(int(peak[s]), int(owned[s]))
                owned[s] -= owners.size
            else:
                u, counts = np.unique(owners, return_counts=True)
                if self.name == "full":
                    # A request's peak footprint is counted in full-pool pages (the swa pool only shrinks it).
                    np.maximum.at(self._ledger.peak_pages, u, owned[u])
                owned[u] -= counts
        self._release(pages, vpages, n_entries, dedup)
        return u

    def free_owned(self, pages: np.ndarray, slot: int, n: int, dedup: bool) -> None:
        """``apply_free`` for a free already judged to release ``n`` pages (``pages``, int64, in range) that were
        all in use by request slot ``slot`` (>= 0): what apply_free's one-owner case applies, without testing it
        again (the wrapper's free fast path has). ``pages`` is kept (held in a free group): the caller's own."""
        led = self._ledger
        owned = led.owned[self.name]
        self.last_freed[pages] = slot | led.generation.item(slot) << 32
        had = owned.item(slot)
        if self.name == "full":
            peak = led.peak_pages
            if had > peak.item(slot):
                peak[slot] = had
        owned[slot] = had - n
        if self.in_group:
            (self.held_set if dedup else self.held_ids).append(pages)
            self._set(pages, HELD_SET if dedup else HELD_IDS)
        else:
            self._set(pages, STAGED if self.need_sort else FREE)
            if self.need_sort:
                self.n_staged += n
            self.expected_entries += n

    def _release(self, pages, vpages, n_entries: int, dedup: bool) -> None:
        if self.in_group:
            (self.held_set if dedup else self.held_ids).append(pages)
            self._set(vpages, HELD_SET if dedup else HELD_IDS)
        else:
            self._set(vpages, STAGED if self.need_sort else FREE)
            if self.need_sort:
                self.n_staged += n_entries
            self.expected_entries += n_entries

    def group_begin(self) -> None:
        self.in_group = True
        self.held_set, self.held_ids = [], []

    def group_end(self) -> None:
        self.in_group = False
        code = STAGED if self.need_sort else FREE
        n = 0
        for held, dedup in ((self.held_set, True), (self.held_ids, False)):
            if not held:
                continue
            if len(held) == 1:
                # One free in the group: its pages as planned (set-shaped ones are sorted_unique already).
                pages = held[0]
            else:
                pages = np.concatenate(held)
                if dedup:
                    pages = sorted_unique(pages)
            n += pages.size
            # The held pages that are still held (in range: a clipped gather reads page 0, negatives and pages
            # past the end as reserved, which is not held). Usually all of them: no mask then.
            prev = self._owner_ext.take(pages, mode="clip")
            v = pages if not pages.size or _MAX(prev) <= HELD_SET else pages[prev <= HELD_SET]
            self._set(v, code)
        self.held_set, self.held_ids = [], []
        self.expected_entries += n
        if self.need_sort:
            self.n_staged += n

    def group_abandon(self) -> None:
        """The inner left its free group without releasing this pool's held pages (its ``free_group_end`` raised
        before it got to them): they stay held, neither free nor owned, as they are in the inner (lost to it), and
        later frees are immediate again. The count of expected entries does not change."""
        self.in_group = False
        self.held_set, self.held_ids = [], []

    def merged(self) -> None:
        """The inner merged its need_sort staging into the free list."""
        if self.n_staged:
            self._set(np.flatnonzero(self.owner == STAGED), FREE)
            self.n_staged = 0
