"""Host-side shadow of one pool's page states: what the checks, snapshots and statistics read.

Contract:
- ``owner`` is a numpy int32 array with one entry per page (index = page id, page 0 included). A value >= 0 is
  the ledger slot of the request that owns the page; negative values are the codes below. One array carries
  both state and owner so that a decode batch is checked with one gather and one comparison.
- The shadow is updated from host-side facts (``*_cpu`` arguments, Python ints) and from the values of handed-out
  and freed indices *after they reached the host* (at once for CPU tensors, at the next step boundary for
  accelerator tensors: see ``wrapper.py``). Nothing here touches a device tensor.
- Every check returns ``(invariant_id, message, slot)`` tuples (slot -1 when no request is concerned) and the
  shadow then mirrors what the inner allocator actually did, so one fault is reported once, under one id.
- ``expected_entries`` is the number of entries the inner allocator's free list plus staged list should hold;
  it can exceed the number of free pages after a double free (the inner then lists a page twice).
- ``version`` counts the changes of ``owner`` (every write goes through ``_set`` or ``clear``): equal versions
  mean an unchanged ``owner``, which is what lets the wrapper skip re-reading pages it verified (see
  ``wrapper._DecodeRun``, ``wrapper._DecodeRoll``). Any new writer of ``owner`` must go through ``_set`` or bump
  it (the decode roll writes ``owner`` directly and bumps it).
- Not thread-safe by itself (the wrapper serialises).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Page codes (owner < 0). Free-like codes are the lowest, so "allocatable" is one comparison: owner <= FREE.
_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_ALL = np.logical_and.reduce  # ndarray.all() goes through a Python wrapper
_MAX = np.maximum.reduce
_SLOT_MASK = (1 << 32) - 1

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


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` for a 1-D integer array (sorted distinct values, a fresh array), without its fixed cost:
    numpy 2's ``unique`` spends several microseconds per call even on a handful of values (13 us on 256), a sort
    and a neighbour compare about 1.5."""
    n = a.size
    if n < 2:
        return a.copy()
    if n > 64:
        # Runs of equal neighbours first (a freed row repeats each page page_size times in a row): the same set
        # of values, so the same result, with a linear pass instead of sorting every entry.
        heads = np.empty(n, bool)
        heads[0] = True
        np.not_equal(a[1:], a[:-1], out=heads[1:])
        srt = a[heads]  # a boolean gather: a fresh array
        if srt.size < 2:
            return srt
    else:
        srt = a.copy()
    srt.sort()  # in place (np.sort copies first, through a Python wrapper)
    differ = srt[1:] != srt[:-1]
    if _ALL(differ):
        return srt  # the usual case: no value repeats once runs are gone
    keep = np.empty(srt.size, bool)
    keep[0] = True
    keep[1:] = differ
    return srt[keep]


def has_repeat(a: np.ndarray) -> bool:
    """Whether some value occurs twice in a 1-D integer array."""
    n = a.size
    if n < 2:
        return False
    if n <= 64:
        return len(set(a.tolist())) != n  # a few dozen values: a Python set beats a sort's fixed cost
    srt = np.sort(a)
    return bool(np.count_nonzero(srt[1:] == srt[:-1]))


_IDS = np.arange(4096, dtype=np.int32)
_IDS.setflags(write=False)


def entry_ids(n: int) -> np.ndarray:
    """``0 .. n-1`` as int32 (read-only; shared): codes to write at a call's pages and read back, which finds a
    page listed twice in one scatter, one gather and one bytes compare (a later entry overwrites an earlier one's
    code) instead of a sort."""
    global _IDS
    if n > _IDS.size:
        _IDS = np.arange(max(n, 2 * _IDS.size), dtype=np.int32)
        _IDS.setflags(write=False)
    return _IDS[:n]


def pages_list(pages: np.ndarray, limit: int = 8) -> str:
    shown = ", ".join(str(int(p)) for p in pages[:limit])
    return f"[{shown}{', ...' if pages.size > limit else ''}] ({pages.size} pages)"


def _describe(code: int) -> str:
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


class PoolShadow:
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

    # -- allocation -------------------------------------------------------------------------------------------
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
        (see ``wrapper._decode_fast``, ``wrapper._alloc_runs``, ``wrapper._alloc_fast``).
        Counts are the caller's: ``on_alloc`` recounts the call's pages (``_recount``) when this reports."""
        if new_mask is not None:
            pages = pages[new_mask]
            if isinstance(own, np.ndarray):
                own = own[new_mask]
            if slots is not None:
                slots = slots[new_mask]
        if isinstance(own, np.ndarray) and (not own.size or own.item(0) < 0):
            own = -1  # the unattributed code on every entry (see wrapper._decode_consts)
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
                was = _describe(int(bprev[first]))
                bad.append(
                    (inv, f"{op} handed out {pages_list(up)} {what}; page {int(bpages[first])} was {was}", slot)
                )
        taken = bprev[dup & (bprev >= 0)]
        if taken.size:
            # Both requests' ledgers now disagree with their pages for this reported reason (the counts follow the
            # owner array: ``_recount``).
            self._ledger.tainted.update(int(x) for x in np.unique(taken))
        return bad

    # -- frees ------------------------------------------------------------------------------------------------
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
            last = packed & _SLOT_MASK if packed >= 0 else -1
            if last >= 0 and self._ledger.generation.item(last) != packed >> 32:
                last = -1  # that request was released since; its slot now names another one
            bad.append(
                (
                    "double_free",
                    f"{op} frees {pages_list(np.unique(bp[double]))} that are not in use "
                    f"(page {page} is {_describe(int(bprev[double][0]))}"
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
                    f"(page {p0} is {_describe(int(owner[p0]))})",
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
        slot = packed & _SLOT_MASK
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
