"""The per-request KV record (``ReqKvInfo``) and its columnar store (``KvLedger``).

Contract:
- Columnar: every field is a numpy array indexed by a request *slot* (as SGLang's ``req_to_token_pool`` indexes
  rows), so a decode batch of 256 requests updates its ledger with a few vector operations.
- ``ledger[rid]`` returns a ``ReqKvInfo`` view. Assigning ``kv_allocated_len``, ``kv_committed_len`` or
  ``swa_evicted_seqlen`` on it is the single checked write point (the seed's design: the check sits where the
  value is stored, so every caller passes the same gate). A rejected value is never stored: the old one stays.
- The checks at a write are the catalog's ledger rules (``invariants.py``): page alignment of the evicted length,
  and of the allocated length where the engine promises it (``aligned_allocated``: the host-allocator contract of
  SGLang's #35223; SGLang 0.5.23 counts ``kv_allocated_len`` in tokens, its pages being the ceiling), committed <=
  allocated, evicted <= allocated, evicted monotonic while the request holds KV, nothing inside the sliding window
  evicted (``seq_len`` is the committed length).
- ``cache_protected_len`` (the ``protected`` column, tokens, page-aligned): the request's first tokens whose KV the
  prefix cache owns (a matched prefix, or what the request handed to the cache). The request's own pages are
  those of ``[cache_protected_len, kv_allocated_len)``. Written by the engine adapter (``protect``), never by the
  request's allocations; no event carries it.
- The prefix cache owns pages too. It is the ledger slot ``cache_slot()`` (reserved on first use, never released,
  named ``CACHE_RID``): the shadows write that slot as the owner of cached pages, so frees and counts treat it as
  any owner, while it is no request (not in ``live_slots()``, ``len()`` or iteration; no ledger row is compared
  or published for it).
- ``version`` counts checked writes, resets and releases (what the wrapper's own allocation updates do not
  cover): a cache of facts about the ledger is valid while it is unchanged (see ``wrapper.decode._DecodeRun``).
- ``epoch`` counts the changes of the id -> slot mapping (a new id, a release): ``slots_of`` of the same ids
  returns the same slots while it is unchanged (what ``wrapper.requests._Requests._bind`` remembers a binding by).
- A checked write (``write``, ``write_protected``) is a boundary where the engine's code enters ours: its time is
  charged to ``cost``'s ``ledger`` part (the wrapper's ``SelfCost`` once it observes this ledger).
- Host memory only; never touches a device tensor. Not thread-safe by itself: the wrapper serialises its calls
  and, through ``lock``, the engine's checked writes.
- Slots of released requests are reused, except slots whose request leaked pages (their pages still name them).
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator

import numpy as np

from instrumented_alloc.argcheck import ArgumentTypeError
from instrumented_alloc.invariants import SEVERITY, InvariantViolation, Violation
from instrumented_alloc.selfcost import SelfCost

FIELDS = ("kv_allocated_len", "kv_committed_len", "swa_evicted_seqlen")
# What the prefix cache's owner slot is called wherever a request id would stand (page maps, messages, Free events).
CACHE_RID = "<prefix cache>"
_COLUMNS = {"kv_allocated_len": "allocated", "kv_committed_len": "committed", "swa_evicted_seqlen": "evicted"}


class ReqKvInfo:
    """One request's KV record: a view onto the ledger's columns, with checked attribute writes."""

    __slots__ = ("_ledger", "rid", "slot")

    def __init__(self, ledger: KvLedger, rid, slot: int):
        self._ledger = ledger
        self.rid = rid
        self.slot = slot

    @property
    def kv_allocated_len(self) -> int:
        return self._ledger.allocated.item(self.slot)  # a Python int (int() of a numpy scalar costs twice as much)

    @kv_allocated_len.setter
    def kv_allocated_len(self, value: int) -> None:
        self._ledger.write(self.slot, "kv_allocated_len", value)

    @property
    def kv_committed_len(self) -> int:
        return self._ledger.committed.item(self.slot)  # a Python int (int() of a numpy scalar costs twice as much)

    @kv_committed_len.setter
    def kv_committed_len(self, value: int) -> None:
        self._ledger.write(self.slot, "kv_committed_len", value)

    @property
    def swa_evicted_seqlen(self) -> int:
        return self._ledger.evicted.item(self.slot)  # a Python int (int() of a numpy scalar costs twice as much)

    @swa_evicted_seqlen.setter
    def swa_evicted_seqlen(self, value: int) -> None:
        self._ledger.write(self.slot, "swa_evicted_seqlen", value)

    @property
    def cache_protected_len(self) -> int:
        return self._ledger.protected.item(self.slot)

    @cache_protected_len.setter
    def cache_protected_len(self, value: int) -> None:
        self._ledger.write_protected(self.slot, value)

    def __repr__(self) -> str:
        return (
            f"ReqKvInfo(rid={self.rid!r}, kv_allocated_len={self.kv_allocated_len}, "
            f"kv_committed_len={self.kv_committed_len}, swa_evicted_seqlen={self.swa_evicted_seqlen})"
        )


class _RaisingObserver:
    """Used by a ledger that stands alone: a rejected write raises at once."""

    def ledger_rejected(self, slot: int, rid, violations: list[tuple[str, str]], exc=None) -> None:
        if exc is not None:
            return  # the caller raises the argument error itself
        inv, msg = violations[0]
        raise InvariantViolation(Violation(inv, msg, rid=rid, op="ledger", severity=SEVERITY.get(inv, "error")))

    def ledger_written(self, slot: int, rid, field: str, old: int, new: int) -> None:
        pass


class KvLedger:
    """Columnar per-request KV records, keyed by request id, stored by slot."""

    def __init__(
        self,
        page_size: int,
        *,
        sliding_window: int | None = None,
        pools=("full",),
        capacity: int = 256,
        aligned_allocated: bool = True,
    ):
        self.page_size = int(page_size)
        self.sliding_window = sliding_window
        self.pools = tuple(pools)
        # kv_allocated_len is promised page-aligned (True) or counts tokens (False: SGLang 0.5.23).
        self.aligned_allocated = bool(aligned_allocated)
        # The prefix cache's owner slot (see cache_slot), -1 until first used.
        self.cache = -1
        self._observer = _RaisingObserver()
        # What a checked write holds while it checks, stores and reports: the wrapper's lock once it observes this
        # ledger (an engine thread writes a request's fields while another thread's call may grow the columns or
        # read the dirty set; the wrapper's calls hold that lock). Reentrant: the observer takes it again.
        self.lock = contextlib.nullcontext()
        self.cost = SelfCost()  # the wrapper's, once it observes this ledger
        # slot -> a misaligned SWA evicted length an SWA tail allocation implied and the wrapper reported there:
        # the engine's write of that value next is not reported again (one fault, one report).
        self.reported_evicted: dict[int, int] = {}
        # Slots inserting their KV into the prefix cache (from cache_insert's offer to its take, in call order):
        # what they free there are copies the cache already holds, positions that become protected, so the wrapper
        # does not shrink their lengths for those frees (allocated_len="pages").
        self.inserting: set[int] = set()
        # Slots whose last write was rejected: their pages may legitimately disagree with the ledger until the
        # request is reset, and the root cause was already reported.
        self.tainted: set[int] = set()
        # Slots whose ledger or pages changed other than by the wrapper's own (consistent by construction)
        # allocation updates: what a step boundary compares against the pages.
        self.dirty: set[int] = set()
        self.version = 0
        # Counts the changes of the id -> slot mapping (a new id, a release): a memo of slots_of is valid while
        # it is unchanged (see wrapper.requests).
        self.epoch = 0
        self._live_cache: np.ndarray | None = None
        self._rid_to_slot: dict = {}
        self._slot_rid: list = []
        self._free_slots: list[int] = []
        self._cap = 0
        self.allocated = np.zeros(0, np.int64)
        self.committed = np.zeros(0, np.int64)
        self.evicted = np.zeros(0, np.int64)
        self.protected = np.zeros(0, np.int64)  # cache_protected_len (tokens)
        self.live = np.zeros(0, bool)  # slot names a request that has not been released
        self.leaked = np.zeros(0, bool)  # released while still owning pages (reported once)
        self.peak_pages = np.zeros(0, np.int64)
        self.released_step = np.zeros(0, np.int64)  # the step of the slot's last release (what a leak names)
        self.generation = np.zeros(0, np.int64)  # bumped when a slot is released: a reused slot is a new request
        # Decode allocations that included the request (``decode_steps``; zeroed when the slot is released, not by
        # ``reset``: a retracted request keeps counting). The decode paths count a run of decodes of one bound
        # batch (the same slots array, a read-only binding's) in ``dec_slots``/``dec_n`` (``count_decodes``): a
        # compare and an add per decode; the column takes the run when it is read or another batch decodes.
        self._decode_steps = np.zeros(0, np.int64)
        self.dec_slots: np.ndarray | None = None
        self.dec_n = 0
        # slot -> (decode_steps, allocated, committed, evicted): the request's record as its last allocation or
        # checked write left it, saved by the first free (or clear) that changed it since (``keep``); stale once
        # the request decodes (its decode_steps moved), dropped by its next other allocation (``unkeep``) and its
        # release; a checked write updates its column. What ``record`` reads at the release.
        self.kept: dict[int, tuple[int, int, int, int]] = {}
        # Whether anyone reads the records (the wrapper sets it while a sink reads ``RequestReleased``): otherwise
        # a free saves nothing, a plain alloc counts no decode step, and ``record`` reads the columns as they are.
        self.keep_records = True
        self.owned: dict[str, np.ndarray] = {p: np.zeros(0, np.int64) for p in self.pools}
        self._grow(capacity)

    # -- storage ------------------------------------------------------------------------------------------------
    def _grow(self, cap: int) -> None:
        def ext(a: np.ndarray) -> np.ndarray:
            out = np.zeros(cap, a.dtype)
            out[: len(a)] = a
            return out

        self.allocated, self.committed, self.evicted = ext(self.allocated), ext(self.committed), ext(self.evicted)
        self.protected = ext(self.protected)
        self.live, self.leaked, self.peak_pages = ext(self.live), ext(self.leaked), ext(self.peak_pages)
        self.released_step = ext(self.released_step)
        self.generation = ext(self.generation)
        self._decode_steps = ext(self._decode_steps)
        self.owned = {p: ext(a) for p, a in self.owned.items()}
        self._free_slots.extend(range(cap - 1, self._cap - 1, -1))
        self._slot_rid.extend([None] * (cap - self._cap))
        self._cap = cap

    @property
    def capacity(self) -> int:
        return self._cap

    def slot_of(self, rid, *, create: bool = True) -> int:
        slot = self._rid_to_slot.get(rid)
        if slot is not None:
            return slot
        if not create:
            raise KeyError(rid)
        if not self._free_slots:
            self._grow(self._cap * 2)
        slot = self._free_slots.pop()
        self._rid_to_slot[rid] = slot
        self._slot_rid[slot] = rid
        self.live[slot] = True
        self._live_cache = None
        self.epoch += 1
        return slot

    def slots_of(self, rids) -> np.ndarray:
        """The slot of each request id, in order; a new id gets one (every batch of an engine names mostly
        known requests: one dict lookup each, no method call)."""
        to_slot = self._rid_to_slot
        if type(rids) is tuple or type(rids) is list:
            try:
                # Every id known (the usual batch): one C-level pass, no list.
                return np.fromiter(map(to_slot.__getitem__, rids), np.int64, len(rids))
            except KeyError:
                pass  # some new id: below
        get = to_slot.get
        slots = [get(r) for r in rids]
        if None in slots:
            self.epoch += 1
            # New requests (an extend's batch): slots taken in one pass, marked live with one vector store.
            free = self._free_slots
            n = len(slots)
            if slots.count(None) == n and n <= len(free) and len(set(rids)) == n:
                # All new, distinct, and no growth needed: the slots one pop() each would give, in that order.
                new = free[: -n - 1 : -1]
                del free[-n:]
                to_slot.update(zip(rids, new))
                slot_rid = self._slot_rid
                for slot, r in zip(new, rids):
                    slot_rid[slot] = r
                self.live[new] = True
                self._live_cache = None
                return np.array(new, np.int64)
            new = []
            for i, r in enumerate(rids):
                if slots[i] is None:
                    slot = get(r)  # the same new id twice in ``rids`` gets one slot
                    if slot is None:
                        if not self._free_slots:
                            self._grow(self._cap * 2)
                        slot = self._free_slots.pop()
                        to_slot[r] = slot
                        self._slot_rid[slot] = r
                        new.append(slot)
                    slots[i] = slot
            self.live[new] = True
            self._live_cache = None
        return np.array(slots, np.int64) if slots else np.zeros(0, np.int64)

    def rid_of(self, slot: int):
        return self._slot_rid[slot] if 0 <= slot < self._cap else None

    def cache_slot(self) -> int:
        """The prefix cache's owner slot: reserved the first time it is asked for (a request's slot numbers do not
        change for an engine without a prefix cache), live for good, named ``CACHE_RID``, never bound to a request
        id."""
        if self.cache < 0:
            if not self._free_slots:
                self._grow(self._cap * 2)
            slot = self._free_slots.pop()
            self._slot_rid[slot] = CACHE_RID
            self.live[slot] = True
            self.cache = slot
        return self.cache

    def slot_rids(self) -> list:
        """A copy of the slot -> request id list (None: a free slot), indexed by slot: ``rid_of`` for many slots,
        read later without the lock."""
        return list(self._slot_rid)

    def release(self, rid, *, leaked: bool) -> int:
        """Forget ``rid``; its slot is reused unless it still owns pages (``leaked``). Returns the slot."""
        slot = self.detach(rid)
        self.release_slot(slot, leaked=leaked)
        return slot

    def detach(self, rid) -> int:
        """Forget the id ``rid`` now (KeyError when unknown) and return its slot, which stays as it is (its values,
        its pages, its id for events and messages: ``rid_of``) until ``release_slot``: deferred verification
        releases a request at the call and checks its slot later. The id is unknown from here on (a second
        release is refused at once) and names a new request, with a slot of its own, when it is bound again."""
        slot = self._rid_to_slot.pop(rid)
        self.version += 1
        self.epoch += 1
        self._live_cache = None
        return slot

    def release_slot(self, slot: int, *, leaked: bool) -> None:
        """Release a detached slot: reused unless it still owns pages (``leaked``)."""
        self.version += 1
        self.epoch += 1
        self.live[slot] = False
        self.generation[slot] += 1
        self._live_cache = None
        self.dirty.discard(slot)
        self.tainted.discard(slot)
        self.inserting.discard(slot)
        self.kept.pop(slot, None)
        self.decode_steps[slot] = 0
        if leaked:
            self.leaked[slot] = True
        else:
            self.reset(slot)
            self.peak_pages[slot] = 0
            self._slot_rid[slot] = None
            self._free_slots.append(slot)

    @property
    def decode_steps(self) -> np.ndarray:
        """The decode steps per slot (the pending run of decodes added first)."""
        if self.dec_n:
            self.flush_decodes()
        return self._decode_steps

    def count_decodes(self, slots: np.ndarray) -> None:
        """One decode of ``slots`` (distinct, never written: a binding's). The hot paths test
        ``slots is dec_slots`` and add to ``dec_n`` themselves; this is the other case."""
        if slots is self.dec_slots:
            self.dec_n += 1
            return
        if self.dec_n:
            self.flush_decodes()
        self.dec_slots, self.dec_n = slots, 1

    def flush_decodes(self) -> None:
        n, self.dec_n = self.dec_n, 0
        self._decode_steps[self.dec_slots] += n

    def keep(self, slot: int) -> None:
        """A free (or clear) is about to change ``slot``'s lengths: save its record first, unless one saved since
        its last allocation or write is still current (see ``kept``). Free paths only: decode pays nothing."""
        if not self.keep_records:
            return
        k = self.kept.get(slot)
        steps = self.decode_steps.item(slot)
        if k is None or k[0] != steps:
            self.kept[slot] = (steps, self.allocated.item(slot), self.committed.item(slot), self.evicted.item(slot))

    def shrink_one(self, slot: int, cap: int) -> None:
        """A free left ``slot`` ``cap`` tokens of pages: ``allocated`` at most ``cap``, ``committed`` at most
        ``allocated``; the record saved first when they change (``keep``)."""
        allocated = self.allocated.item(slot)
        if allocated > cap or self.committed.item(slot) > min(allocated, cap):
            if self.keep_records:  # tested here: the call alone costs a free a few percent
                self.keep(slot)
            if allocated > cap:
                self.allocated[slot] = allocated = cap
            if self.committed.item(slot) > allocated:
                self.committed[slot] = allocated

    def shrink(self, slots: np.ndarray, cap: np.ndarray) -> None:
        """``shrink_one`` of distinct ``slots`` with their caps."""
        if not self.keep_records:  # no record to save: the lengths alone
            self.allocated[slots] = new_allocated = np.minimum(self.allocated[slots], cap)
            self.committed[slots] = np.minimum(self.committed[slots], new_allocated)
            return
        allocated, committed = self.allocated[slots], self.committed[slots]
        new_allocated = np.minimum(allocated, cap)
        new_committed = np.minimum(committed, new_allocated)
        changed = (new_allocated != allocated) | (new_committed != committed)
        if changed.any():
            for s in slots[changed].tolist():
                self.keep(s)
            self.allocated[slots] = new_allocated
            self.committed[slots] = new_committed

    def unkeep(self, slots) -> None:
        """An allocation other than a decode set these slots' records (call only while ``kept`` is non-empty)."""
        kept = self.kept
        for s in slots.tolist():
            kept.pop(s, None)

    def _kept_write(self, slot: int, column: str, value: int) -> None:
        """A checked write changed ``column``: a saved record takes it (the write is part of the record)."""
        k = self.kept.get(slot)
        if k is not None and k[0] == self.decode_steps.item(slot):
            i = ("allocated", "committed", "evicted").index(column) + 1
            self.kept[slot] = (*k[:i], value, *k[i + 1 :])

    def record(self, slot: int) -> tuple[int, int, int]:
        """``(allocated, committed, evicted)`` as the request's last allocation or checked write left them: the
        frees since then (a request torn down before its release) do not count."""
        k = self.kept.get(slot)
        if k is not None and k[0] == self.decode_steps.item(slot):
            return k[1], k[2], k[3]
        return self.allocated.item(slot), self.committed.item(slot), self.evicted.item(slot)

    def reset(self, slot: int) -> None:
        """The request holds no KV any more (all its pages were freed: finished or retracted)."""
        self.version += 1
        self.allocated[slot] = self.committed[slot] = self.evicted[slot] = self.protected[slot] = 0

    def write_protected(self, slot: int, value) -> bool:
        """``protect`` at the checked write point: a rejected value is reported (as any rejected write) and not
        stored, and a value of the wrong type is ``invalid_argument`` (as at ``write``). Returns True when stored."""
        cost = self.cost
        cost.start()
        try:
            return self._write_protected(slot, value)
        finally:
            cost.end_ledger()

    def _write_protected(self, slot: int, value) -> bool:
        with self.lock:
            try:
                bad = self.protect(slot, value)
            except ArgumentTypeError as exc:
                self._observer.ledger_rejected(slot, self._slot_rid[slot], [("invalid_argument", str(exc))], exc)
                raise
            if bad:
                self._observer.ledger_rejected(slot, self._slot_rid[slot], bad)
                return False
            return True

    def protect(self, slot: int, value) -> list[tuple[str, str]]:
        """Set the request's ``cache_protected_len`` (tokens whose KV the prefix cache owns, from position 0).
        Returns the rules the value breaks (then nothing is stored): an int >= 0 and a multiple of page_size (the
        cache holds whole pages). No event: it changes which pages are the request's own, which the step boundary
        then compares (the slot is marked dirty)."""
        if type(value) is not int:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ArgumentTypeError("cache_protected_len", f"expected an int, got {type(value).__name__}")
            value = int(value)
        ps = self.page_size
        if value < 0 or value % ps:
            old = self.protected.item(slot)
            return [
                (
                    "ledger_matches_pages",
                    f"cache_protected_len={value} is not a non-negative multiple of page_size={ps}: the prefix "
                    f"cache holds whole pages; kept {old}",
                )
            ]
        self.version += 1
        self.protected[slot] = value
        self.dirty.add(slot)
        return []

    # -- mapping protocol ---------------------------------------------------------------------------------------
    def __getitem__(self, rid) -> ReqKvInfo:
        # slot_of(rid, create=False), inline: an engine reads a request's record per eviction.
        slot = self._rid_to_slot.get(rid)
        if slot is None:
            raise KeyError(rid)
        return ReqKvInfo(self, rid, slot)

    def __contains__(self, rid) -> bool:
        return rid in self._rid_to_slot

    def __iter__(self) -> Iterator:
        return iter(list(self._rid_to_slot))

    def __len__(self) -> int:
        return len(self._rid_to_slot)

    def get_or_create(self, rid) -> ReqKvInfo:
        return ReqKvInfo(self, rid, self.slot_of(rid))

    def live_slots(self) -> np.ndarray:
        """Slots of the requests not yet released (cached between changes; do not modify the result)."""
        if self._live_cache is None:
            self._live_cache = np.fromiter(self._rid_to_slot.values(), np.int64, len(self._rid_to_slot))
        return self._live_cache

    # -- the checked write point --------------------------------------------------------------------------------
    def check(self, slot: int, field: str, value: int) -> list[tuple[str, str]]:
        """The ledger rules broken by storing ``value`` into ``field`` of ``slot`` (empty list: accepted)."""
        ps = self.page_size
        alloc, comm, ev = self.allocated.item(slot), self.committed.item(slot), self.evicted.item(slot)
        bad: list[tuple[str, str]] = []
        if field == "kv_allocated_len":
            if value < 0 or (value % ps and self.aligned_allocated):
                bad.append(
                    (
                        "kv_allocated_len_page_aligned",
                        f"kv_allocated_len={value} is negative; kept {alloc}"
                        if value < 0 and not self.aligned_allocated
                        else f"kv_allocated_len={value} is not a non-negative multiple of page_size={ps} "
                        f"(remainder {value % ps}); kept {alloc}",
                    )
                )
            if comm > value:
                bad.append(
                    ("kv_committed_le_allocated", f"kv_allocated_len={value} < kv_committed_len={comm}; kept {alloc}")
                )
            if ev > value:
                bad.append(
                    ("swa_evicted_le_allocated", f"kv_allocated_len={value} < swa_evicted_seqlen={ev}; kept {alloc}")
                )
        elif field == "kv_committed_len":
            if value < 0 or value > alloc:
                bad.append(
                    (
                        "kv_committed_le_allocated",
                        f"kv_committed_len={value} is not within 0..kv_allocated_len={alloc}; kept {comm}",
                    )
                )
        elif field == "swa_evicted_seqlen":
            if value < 0 or value % ps:
                bad.append(
                    (
                        "swa_evicted_seqlen_page_aligned",
                        f"swa_evicted_seqlen={value} is not a non-negative multiple of page_size={ps} "
                        f"(remainder {value % ps}); kept {ev}",
                    )
                )
            if value < ev:
                bad.append(("swa_evicted_seqlen_monotonic", f"swa_evicted_seqlen would decrease from {ev} to {value}"))
            if value > alloc:
                bad.append(
                    ("swa_evicted_le_allocated", f"swa_evicted_seqlen={value} > kv_allocated_len={alloc}; kept {ev}")
                )
            w = self.sliding_window
            # The cached prefix's SWA KV is the cache's, not the request's: the request may count it as evicted
            # (SGLang moves the evicted length past the prefix before its first eviction).
            if w is not None and value > max(0, comm - w, self.protected.item(slot)):
                bad.append(
                    (
                        "swa_evicted_within_window",
                        f"swa_evicted_seqlen={value} reaches into the window: seq_len={comm}, window={w}, "
                        f"at most {max(0, comm - w, self.protected.item(slot))} may be evicted",
                    )
                )
        return bad

    def write(self, slot: int, field: str, value) -> bool:
        """Checked write. Returns True when stored; on a broken rule reports it and keeps the old value. Holds
        ``lock`` throughout (see ``__init__``)."""
        cost = self.cost
        cost.start()
        try:
            with self.lock:
                return self._write(slot, field, value)
        finally:
            cost.end_ledger()

    def _write(self, slot: int, field: str, value) -> bool:
        self.version += 1  # stored or not: whoever caches a fact about the ledger looks again
        if type(value) is not int:  # a plain int is the usual value: no ABC isinstance check for it
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                exc = ArgumentTypeError(field, f"expected an int, got {type(value).__name__}")
                self._observer.ledger_rejected(slot, self._slot_rid[slot], [("invalid_argument", str(exc))], exc)
                raise exc
            value = int(value)
        bad = self.check(slot, field, value)
        if bad and field == "swa_evicted_seqlen" and self.reported_evicted.get(slot) == value:
            # The value an SWA tail allocation implied, already reported there (see ``reported_evicted``): rejected,
            # and only its other broken rules reported.
            del self.reported_evicted[slot]
            bad = [b for b in bad if b[0] != "swa_evicted_seqlen_page_aligned"]
            if not bad:
                self.tainted.add(slot)
                return False
        if bad:
            self._observer.ledger_rejected(slot, self._slot_rid[slot], bad)
            return False
        name = _COLUMNS.get(field)
        if name is None:
            raise AttributeError(field)  # what _column raises
        column = getattr(self, name)  # the column by attribute: _grow replaces the arrays
        old = column.item(slot)
        column[slot] = value
        if self.kept and old != value:
            self._kept_write(slot, name, value)
        self.dirty.add(slot)
        if old != value:
            self._observer.ledger_written(slot, self._slot_rid[slot], field, old, value)
        return True

    def _column(self, field: str) -> np.ndarray:
        if field == "kv_allocated_len":
            return self.allocated
        if field == "kv_committed_len":
            return self.committed
        if field == "swa_evicted_seqlen":
            return self.evicted
        raise AttributeError(field)
