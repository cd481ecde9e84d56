"""The allocation half of ``PoolShadow``: judging the pages an allocator handed out, then mirroring them.

Contract (``PoolShadow`` inherits these methods; they read and write its state, see ``shadow.py``):
- The usual allocation (every page free, or the request's own page where it continues one) is judged with one
  clipped gather and one count; anything else is judged again entry by entry (``_on_alloc_judged``).
- Every fault is named once, then ``owner`` mirrors what the inner did; per-request page counts follow ``owner``
  over the pages a judged call touched (``_recount``), so the ledger never drifts from the owner array.
- Every change of ``owner`` bumps ``version`` (directly or through ``_set``); ``_opened_twice`` writes ids and
  restores the owners before it returns.
"""

from __future__ import annotations

import numpy as np

from instrumented_alloc.pagearrays import entry_ids, sorted_unique
from instrumented_alloc.pagecodes import FREE, describe, pages_list


class AllocChecks:
    """Mixin of ``PoolShadow``: ``on_alloc`` and the rules it applies. Holds no state of its own."""

    def on_alloc(
        self,
        pages: np.ndarray,
        own,
        new_mask: np.ndarray | None,
        n_new: int,
        op: str,
        runs: bool = False,
        slots: np.ndarray | None = None,
    ) -> list:
        """Pages handed out, one entry per returned slot. ``own``: owner slot per entry (array) or -1.
        ``new_mask``: True where the slot opens a page taken from the free list, False where it continues the
        request's own partial page (None: all new). Per-request page counts are the caller's (host-known).
        ``runs``: the entries come in runs of one page (an extend's slots: page_size entries per page); the page
        delta of a call that passes then keeps one entry per run (see ``_note_alloc``). ``slots``: the slots
        themselves where an entry's page repeats within one opening (an extend's), to name the pages opened twice
        by unattributed requests (see ``shared_in_call``)."""
        bad: list = []
        if pages.size:
            # The usual allocation, judged with one clipped gather (a page outside the pool reads as reserved:
            # never free, never anyone's own) and one count; anything else is judged again below.
            prev = self._owner_ext.take(pages, mode="clip")
            ok = (prev <= FREE) if new_mask is None else np.where(new_mask, prev <= FREE, prev == own)
            if np.count_nonzero(ok) == ok.size:
                self.owner[pages] = own
                self.version += 1
                if n_new > 1:
                    bad = self.shared_in_call(pages, own, new_mask, n_new, op, slots, runs=runs)
                    if bad:
                        # Some page opened twice: the counts follow the owner array over the opened pages (free
                        # before, every one of them: ok above), less what the caller counted.
                        opened = sorted_unique(pages if new_mask is None else pages[new_mask])
                        counted = self._counted(own, new_mask, runs, int(pages.size))
                        self._recount(np.full(opened.size, FREE, np.int32), self.owner[opened], counted)
                if self.deltas is not None:
                    self._note_alloc(pages, own, new_mask, runs)
            else:
                bad = self._on_alloc_judged(pages, own, new_mask, n_new, op, slots, runs)
        self.expected_entries -= n_new
        return bad

    def shared_in_call(self, pages: np.ndarray, own, new_mask, n_new: int, op: str, slots=None, runs=False) -> list:
        """One page opened twice in one call (the inner's free list listed it twice), with ``owner[pages] = own``
        already written: ``duplicate_allocation`` at the call. Attributed calls (``own`` an array of ledger slots):
        the later write wins, so an opening entry of the earlier request reads another owner (one gather, one
        bytes compare). The earlier request loses the page (both are tainted, as for a stolen page); the violation
        names it. Unattributed calls (``own`` -1, scalar or every entry): fewer distinct pages among the opening
        entries than ``n_new``, the pages the call opened (a sort); named by the
        slots handed out twice when ``slots`` is given (each opening starts at its page's offset 0), else by the
        repeated pages (one entry per opening). One request handed one page twice in one call (one owner code, which
        the read-back cannot tell apart) is found where it can happen: an extend's runs (``runs``: page_size
        entries per page, ``slots`` naming each run's first slot) or an ``alloc``'s pages (``new_mask`` None), not a
        decode (one entry per request); at page size 1 only once the free list may list a page twice
        (``relisted``); see ``_opened_twice``. The wrapper's fast paths apply these same rules before they commit
        (see ``wrapper.decode``, ``wrapper.extend``, ``wrapper.alloc``).
        Counts are the caller's: ``on_alloc`` recounts the call's pages (``_recount``) when this reports."""
        if new_mask is not None:
            pages = pages[new_mask]
            if isinstance(own, np.ndarray):
                own = own[new_mask]
            if slots is not None:
                slots = slots[new_mask]
        if isinstance(own, np.ndarray) and (not own.size or own.item(0) < 0):
            own = -1  # the unattributed code on every entry (see wrapper.decode)
        if isinstance(own, np.ndarray):
            bad = []
            back = self._owner_ext.take(pages, mode="clip")  # in range here; take is cheaper than a fancy gather
            if back.tobytes() != own.astype(np.int32, copy=False).tobytes():
                lost = np.flatnonzero(back != own)
                pairs = sorted({(int(pages[i]), int(own[i])) for i in lost.tolist()}, key=lambda x: x[0])
                for page, earlier in pairs:
                    self._ledger.tainted.update((earlier, int(self.owner[page])))
                page, earlier = pairs[0]
                up = np.unique(np.fromiter((p for p, _ in pairs), np.int64))
                bad.append(
                    (
                        "duplicate_allocation",
                        f"{op} handed out {pages_list(up)} to two requests in one call; page {page} went to request "
                        f"slot {earlier} and to request slot {int(self.owner[page])}",
                        earlier,
                    )
                )
            if (self.page_size > 1 or self.relisted) and (new_mask is None if not runs else slots is not None):
                bad += self._opened_twice(pages, own, op, slots if runs else None)
            return bad
        if own >= 0:
            return []  # one request's pages: no second request to tell apart
        u = sorted_unique(pages)
        if u.size >= n_new or u.size == pages.size:
            return []
        if slots is not None and slots.shape == pages.shape:
            srt = np.sort(slots)
            twice = np.unique(srt[1:][srt[1:] == srt[:-1]] // self.page_size)
        else:
            srt = np.sort(pages)
            twice = np.unique(srt[1:][srt[1:] == srt[:-1]])
        return [
            (
                "duplicate_allocation",
                f"{op} handed out {pages_list(twice)} to more than one unattributed request in one call "
                f"({n_new} pages opened, {u.size} distinct)",
                -1,
            )
        ]

    def _note_alloc(self, pages: np.ndarray, own, new_mask, runs: bool) -> None:
        """The page delta of an allocation that passed every check (``owner[pages] = own`` already written), with
        only the entries that change an owner, as far as the call already knows them: the entries that open a page
        (``new_mask``; the others continue a page that read ``own`` before the call, and no entry that opens a
        page writes one of those, which read free: no-ops), and with ``runs``, the first entry of each run of
        equal (page, owner) neighbours (writing a value again right after itself changes nothing). Replaying the
        delta leaves ``owner`` as the full write did, in every case that passes (two requests handed one page
        included: their entries differ in owner, both are kept, in order)."""
        private = False  # pages as the caller's (the out tensor's memory at page size 1): copied by note
        if new_mask is not None:
            pages = pages[new_mask]  # boolean gathers: fresh arrays
            if isinstance(own, np.ndarray):
                own = own[new_mask]
            private = True
        n = pages.size
        if runs and n > 1:
            keep = np.empty(n, bool)
            keep[0] = True
            heads = keep[1:]
            np.not_equal(pages[1:], pages[:-1], out=heads)
            if isinstance(own, np.ndarray):
                heads |= own[1:] != own[:-1]
            pages = pages[keep]
            if isinstance(own, np.ndarray):
                own = own[keep]
            private = True
        if pages.size:
            self.note(pages, own, private=private)

    def _opened_twice(self, pages: np.ndarray, own: np.ndarray, op: str, slots) -> list:
        """``shared_in_call``'s same-request rule: a page opened more than once for one request in one call (an
        extend's runs, or an ``alloc``'s pages, ``pages``/``own`` the opening entries, ``owner[pages] = own``
        written). ``slots`` (an extend's) names the runs: an opening starts at its page's offset 0. Cheap when
        nothing repeats (ids written at the openings' pages and read back, see ``entry_ids``); else the openings
        per (request, page). The request is tainted, as for a stolen page."""
        if slots is None:
            heads, owners = pages, own
        else:
            ps = self.page_size
            # Page sizes are powers of two in practice: a mask is several times cheaper than % on every slot.
            first = (slots & (ps - 1) if ps & (ps - 1) == 0 else slots % ps) == 0
            heads, owners = pages[first], own[first]
        if heads.size < 2:
            return []
        # A page opened twice reads back the later opening's id (see entry_ids); the owners are restored at once.
        owner, ids = self.owner, entry_ids(heads.size)
        written = owner[heads]
        owner[heads] = ids
        back = owner[heads]
        owner[heads] = written
        if back.tobytes() == ids.tobytes():
            return []
        k, times = np.unique(owners.astype(np.int64) << 32 | heads, return_counts=True)
        rep = times > 1
        if not rep.any():
            return []  # repeats across requests only: the read-back's
        slot_r, page_r = k[rep] >> 32, k[rep] & 0xFFFFFFFF
        self._ledger.tainted.update(int(x) for x in np.unique(slot_r))
        s0, p0 = int(slot_r[0]), int(page_r[0])
        return [
            (
                "duplicate_allocation",
                f"{op} handed out {pages_list(np.unique(page_r))} more than once to one request in one call; page "
                f"{p0} went {int(times[rep][0])} times to request slot {s0}",
                s0,
            )
        ]

    def _on_alloc_judged(
        self, pages: np.ndarray, own, new_mask, n_new: int, op: str, slots=None, runs: bool = False
    ) -> list:
        """``on_alloc`` when some entry breaks a rule: name every fault, then mirror what the inner did, and keep
        each request's page count the census of the owner array (``_recount``)."""
        bad: list = []
        owner = self.owner
        counted = self._counted(own, new_mask, runs, int(pages.size))
        prev = None
        if pages.min() >= 1:
            try:
                prev = owner[pages]
            except IndexError:  # a page past the end
                prev = None
        oob = prev is None
        if oob:
            bad += self._alloc_out_of_range(pages, op)
            keep = (pages >= 1) & (pages < owner.size)
            pages = pages[keep]
            new_mask = None if new_mask is None else new_mask[keep]
            if isinstance(own, np.ndarray):
                own = own[keep]
            if slots is not None:
                slots = slots[keep]
            prev = owner[pages]
        ok = (prev <= FREE) if new_mask is None else np.where(new_mask, prev <= FREE, prev == own)
        if not ok.all():
            bad += self._classify_alloc(pages, prev, own, new_mask, ok, op)
        touched, first = np.unique(pages, return_index=True)
        before = prev[first]
        self._set(pages, own)
        if n_new > 1 and pages.size and not oob:
            bad += self.shared_in_call(pages, own, new_mask, n_new, op, slots, runs=runs)
        self._recount(before, owner[touched], counted)
        return bad

    def _counted(self, own, new_mask, runs: bool, n_entries: int):
        """What the caller added to the per-request counts for this allocation, before calling ``on_alloc``: a page
        per opening entry (a decode's request, an ``alloc`` page), or with ``runs`` (an extend's slots, page_size
        per page, a request's last page maybe fewer) a page per started run of a request's opening entries.
        Returns (slots, pages) arrays, or None when nothing was counted (unattributed)."""
        if not isinstance(own, np.ndarray):
            if own < 0:
                return None
            n = n_entries if new_mask is None else int(np.count_nonzero(new_mask))
            return own, (-(-n // self.page_size) if runs else n)
        opening = own if new_mask is None else own[new_mask]
        opening = opening[opening >= 0]
        if not opening.size:
            return None
        u, n = np.unique(opening, return_counts=True)
        return u, (-(-n // self.page_size) if runs else n)

    def _recount(self, before: np.ndarray, after: np.ndarray, counted) -> None:
        """Counts follow the owner array over the pages a judged call touched (one entry per distinct page, its
        owner before and after the call), less what the caller already added (``_counted``). A page the call
        could not write (page 0, past the end) owns nothing, so its opener's count is taken back."""
        owned = self.owned
        np.subtract.at(owned, before[before >= 0], 1)
        np.add.at(owned, after[after >= 0], 1)
        if counted is not None:
            slots_c, n = counted
            if isinstance(slots_c, np.ndarray):
                np.subtract.at(owned, slots_c, n)
            else:
                owned[slots_c] -= n

    def _alloc_out_of_range(self, pages: np.ndarray, op: str) -> list:
        bad = []
        zero = pages[pages == 0]
        if zero.size:
            bad.append(("reserved_page_touched", f"{op} handed out reserved page 0 ({zero.size} slots)", -1))
        oob = pages[(pages < 0) | (pages >= self.owner.size)]
        if oob.size:
            bad.append(
                (
                    "duplicate_allocation",
                    f"{op} handed out pages outside the pool (valid 1..{self.num_pages}): {pages_list(oob)}",
                    -1,
                )
            )
        return bad

    def _classify_alloc(self, pages, prev, own, new_mask, ok, op) -> list:
        bad = []
        bad_idx = np.flatnonzero(~ok)
        is_new = np.ones(bad_idx.size, bool) if new_mask is None else new_mask[bad_idx]
        own_at = np.broadcast_to(np.asarray(own), pages.shape)[bad_idx]
        bpages, bprev = pages[bad_idx], prev[bad_idx]
        # A new page that is busy, or a continued page that belongs to someone else: the slot is in use twice.
        dup = (is_new & (bprev > FREE)) | (~is_new & (bprev != own_at) & (bprev > FREE))
        # A continued slot that lands in a free page: last_loc did not point at the request's own last slot.
        stray = ~is_new & (bprev <= FREE)
        for mask, inv, what in (
            (dup, "duplicate_allocation", "already in use"),
            (stray, "slot_page_alignment", "free, though the slot continues the request's own page (bad last_loc)"),
        ):
            if mask.any():
                up = np.unique(bpages[mask])
                first = int(np.flatnonzero(mask)[0])
                slot = int(own_at[first])
                was = describe(int(bprev[first]))
                bad.append(
                    (inv, f"{op} handed out {pages_list(up)} {what}; page {int(bpages[first])} was {was}", slot)
                )
        taken = bprev[dup & (bprev >= 0)]
        if taken.size:
            # Both requests' ledgers now disagree with their pages for this reported reason (the counts follow the
            # owner array: ``_recount``).
            self._ledger.tainted.update(int(x) for x in np.unique(taken))
        return bad
