"""Per-request paths: ``batch()`` bindings, the prefix cache's handoffs (``cache_insert``), releases, and the
ledger's observer callbacks (checked writes).

Contract (``_Requests``, a mixin of ``InstrumentedAllocator``): a binding belongs to the calling thread (a
thread-local, remembered per batch while the ledger's id -> slot mapping is unchanged); its slots array is
read-only and shared by that block's events. A release checks that the request owns no page (``request_leak``)
and publishes ``RequestReleased`` with its record (``KvLedger.record``) and decode steps; deferred verification
detaches the id at the call and releases the slot in call order."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from instrumented_alloc import events as ev
from instrumented_alloc.argcheck import (
    ArgumentError,
    ArgumentTypeError,
    ArgumentValueError,
    check_index_tensor,
    check_int,
)
from instrumented_alloc.invariants import InvariantViolation
from instrumented_alloc.shadow import (
    FREE,
    pages_list,
    sorted_unique,
)
from instrumented_alloc.wrapper.constants import _B_RELEASED, _BIND_MEMO
from instrumented_alloc.wrapper.state import _Binding, _CacheInsert, _charged


class _Requests:
    """Per-request paths (see the module docstring)."""

    def batch(self, rids: Sequence, *, lens: Sequence[int] | None = None):
        """Bind the next calls' per-request segments to ``rids``, in batch order (a context manager; entering it
        returns the allocator).

        ``lens`` (optional) gives each request's share of a plain ``alloc(n)`` (page size 1 extends, where the
        call itself carries no per-request lengths); decode (``n == len(rids)``) and single-request allocs need
        none. Binding does not nest, and it belongs to the calling thread: calls from another thread are not
        attributed to it. Off mode attributes (and remembers) nothing: the block costs an attribute lookup.
        """
        if self._w_st.off:
            return self._w_off_batch
        return _Binding(self, rids, lens)

    def _bind(self, rids, lens):
        """Bind the calling thread to ``rids`` (see ``batch``); returns the thread-local that holds the binding.

        An engine binds the same batch step after step (its decode batch changes only when a request joins or
        leaves): each thread remembers its last few bindings (ids -> ledger slots), valid while the ledger's
        ``epoch`` (its id -> slot mapping) is unchanged. A remembered batch was checked (hashable, distinct)
        when it was first bound, and takes the same slots array (read-only, see below) and the same owner codes
        the decode fast path made for it."""
        try:
            rids = tuple(rids)
        except TypeError:
            raise ArgumentTypeError("rids", f"expected a sequence of hashable request ids, got {rids!r:.80}") from None
        st = self._w_st
        tls = st.tls
        memo = getattr(tls, "memo", None) if st.bind_memo else {}  # a fresh dict remembers nothing
        if memo is None:
            memo = tls.memo = {}
        try:
            hit = memo.get(rids)
        except TypeError:  # an unhashable id: named below
            hit = None
        if hit is None:
            try:
                distinct = len(set(rids))
            except TypeError:
                raise ArgumentTypeError(
                    "rids", f"expected a sequence of hashable request ids, got {rids!r:.80}"
                ) from None
            if distinct != len(rids):
                raise ArgumentValueError("rids", "a request id appears twice in one batch")
        if lens is not None:
            if isinstance(lens, (str, bytes, torch.Tensor)) or not hasattr(lens, "__len__"):
                raise ArgumentTypeError("lens", f"expected a sequence of ints, got {type(lens).__name__}")
            if len(lens) != len(rids):
                raise ArgumentValueError("lens", f"has {len(lens)} entries for {len(rids)} requests")
            # Plain non-negative ints (the usual lens) pass with two C-level scans; anything else is checked
            # one by one, which names the bad entry.
            if not (set(map(type, lens)) <= {int} and (not len(lens) or min(lens) >= 0)):
                lens = [check_int("lens", x) for x in lens]
        with st.lock:
            if getattr(tls, "bound", None) is not None:
                raise RuntimeError("batch(): already inside a batch() block (binding does not nest)")
            led = st.ledger
            lens = None if lens is None else np.asarray(lens, np.int64)
            if hit is not None and hit[0] is led and hit[1] == led.epoch:
                # The same ids map to the same slots (see above): the remembered binding again, its own lens.
                bound = tls.bound = hit[2]
                bound[2] = lens
                return tls
            if st.detached and not st.detached.keys().isdisjoint(rids):
                # An id whose release is still queued (deferred verification) names a new request now: a
                # retracted request re-prefilled before the boundary that checks its release. Verify what has
                # landed (never waiting), so that the release and its RequestReleased come before the new
                # request's events, as they do under immediate verification. (Still queued behind a copy in
                # flight, it stays behind them: sinks that key requests by id then see the two overlap.)
                self._drain(wait=False)
                self._finish()  # raise mode: the release's violation is raised here, before this binding
            slots = led.slots_of(rids)
            # The binding's slots are read-only: the events of this block (LedgerUpdate.slots) and later bindings
            # of the same batch share them instead of a copy each, which is safe because slots_of returns a fresh
            # array that owns its memory.
            slots.flags.writeable = False
            # The last entry: the slots as owner codes (int32, read-only), made by the decode fast path when it
            # first needs them (it compares the pages' owners to them in one memcmp; an extend's binding never
            # needs them).
            bound = tls.bound = [rids, slots, lens, None]
            if len(memo) >= _BIND_MEMO:
                memo.clear()
            memo[rids] = (led, led.epoch, bound)
        return tls

    def cache_insert(self, rid, slots) -> _CacheInsert:
        """The engine inserts request ``rid``'s KV into its prefix cache (SGLang's ``tree_cache.checkpoint``), as a
        context manager around the insert: ``with alloc.cache_insert(rid, offered) as ins: ...; ins.held = slots``.

        ``offered``: the request's slots of the positions it offers, ``[cache_protected_len, up_to)`` of its row
        as it is before the insert. Every page of them must be the request's own: one the prefix cache owns
        already is a page handed to the cache twice, one free or another request's is not the request's to give
        (``double_free``, naming the request). During the insert the engine frees the pages the cache already had
        a copy of (as any free, except that with ``allocated_len="pages"`` they leave the request's lengths: those
        positions become protected, they are not dropped). ``ins.held`` (set by the caller before the block ends;
        None: nothing taken) are the slots the cache now holds for the request: its row over the positions that
        became protected, as it is after the insert (SGLang points it at the cache's own slots). Every page of
        them, and every SWA page they map to, that the request still owns passes to the cache (a cache that already
        held a position may adopt the request's SWA page for it). Index tensors are read as the slot tier reads
        indices: at once on the host, once their copies land from a device (taken at the call). The request's
        ``cache_protected_len`` is the engine's to write (``ledger[rid]``)."""
        return _CacheInsert(self, rid, slots)

    @_charged
    def _cache_offer(self, rid, slots):
        """``cache_insert``'s entry, under the lock: the request's slot, the offered slots, the check queued."""
        st = self._w_st
        with st.lock:
            st.op = "cache_insert"
            self._validate("cache_insert", check_index_tensor, "slots", slots, st.device)
            led = st.ledger
            try:
                known = rid in led
            except TypeError:
                known = False
            if not known:
                self._invalid("cache_insert", ArgumentValueError("rid", f"unknown request id {rid!r}"), rid=rid)
            slot = led.slot_of(rid, create=False)
            cache = led.cache_slot()
            full = st.full
            ps = st.ps

            def check(o: np.ndarray) -> None:
                led.inserting.add(slot)  # until the take (see KvLedger.inserting)
                pages = sorted_unique(o // ps)
                prev = full.shadow._owner_ext.take(pages, mode="clip")
                bad = (prev != slot) & (prev != -1)
                if not bad.any():
                    return
                for mask, what in (
                    (prev == cache, "which the prefix cache owns already: handed to it twice"),
                    ((prev != cache) & bad, "which are not its own"),
                ):
                    mask &= bad
                    if mask.any():
                        first = int(prev[mask][0])
                        who = (
                            "free" if first <= FREE else f"owned by request {led.rid_of(first)!r}" if first >= 0 else ""
                        )
                        self._violate(
                            "double_free",
                            f"request {rid!r} offers the prefix cache {pages_list(pages[mask])} {what}"
                            + (f" (page {int(pages[mask][0])} is {who})" if who and first != cache else ""),
                            slot=slot,
                            op="cache_insert",
                            pool="full",
                        )

            self._slot_tier(check, slots)
            try:
                self._finish()
            except InvariantViolation:
                led.inserting.discard(slot)  # refused (raise mode): no insert follows
                raise
        return slot

    @_charged
    def _cache_take(self, slot: int, held) -> None:
        """``cache_insert``'s exit, under the lock: the pages of ``held`` still owned by ``slot`` pass to the
        prefix cache, in the full pool and through the SWA mapping in the SWA pool."""
        st = self._w_st
        with st.lock:
            st.op = "cache_insert"
            led = st.ledger

            def end() -> None:
                led.inserting.discard(slot)

            if held is None:  # nothing taken: the insert ends
                self._slot_tier(end)
                return
            try:
                self._validate("cache_insert", check_index_tensor, "held", held, st.device)
            except ArgumentError:
                self._slot_tier(end)
                raise
            if not held.numel():
                self._slot_tier(end)
            else:
                cache = led.cache_slot()
                ps = st.ps
                taken_slots = held

                def take(o: np.ndarray, peers: np.ndarray | None = None) -> None:
                    parts = [(st.full, o)]
                    if peers is not None and st.swa is not None:
                        parts.append((st.swa, peers[peers > 0]))
                    for pool, idx in parts:
                        if not idx.size:
                            continue
                        shadow = pool.shadow
                        pages = sorted_unique(idx // ps)
                        mine = pages[shadow._owner_ext.take(pages, mode="clip") == slot]
                        if mine.size:
                            shadow._set(mine, cache)
                            owned = led.owned[pool.name]
                            if pool.name == "full":  # its peak before the pages leave it (as a free records it)
                                led.peak_pages[slot] = max(led.peak_pages.item(slot), owned.item(slot))
                            owned[slot] -= mine.size
                            owned[cache] += mine.size
                            led.dirty.add(slot)
                    end()

                if st.swa is not None and self._w_swa_frees == "peers":
                    self._slot_tier(take, taken_slots, self._peers_at(taken_slots))
                else:
                    self._slot_tier(take, taken_slots)
            self._finish()

    @_charged
    def release_request(self, rid) -> None:
        """The request finished (or was aborted): it must own no pages any more (``request_leak``)."""
        st = self._w_st  # the wrapper's state, read from it (see _CallState)
        if st.off:
            return
        with st.lock:
            try:
                known = rid in st.ledger
            except TypeError:
                known = None
            if known is None:
                self._invalid(
                    "release_request",
                    ArgumentTypeError("rid", f"expected a hashable request id, got {type(rid).__name__}"),
                )
            if not known:
                # The id is named (and carried as the violation's rid, so a hasher can redact it in the message).
                self._invalid("release_request", ArgumentValueError("rid", f"unknown request id {rid!r}"), rid=rid)
            st.op = "release"
            if st.deferred:
                # The id is forgotten now, its slot checked and released in call order (behind the queued checks
                # that still name it): a second release of the id is refused here, as under immediate
                # verification, and a request that takes the id again gets a slot of its own.
                slot = st.ledger.detach(rid)
                st.detached[rid] = st.detached.get(rid, 0) + 1
                self._slot_tier(lambda: self._do_release(rid, slot))
            else:
                self._do_release(rid)  # what _slot_tier does at once in immediate mode, without the closure
            if st.events or st.to_raise or st.want_pages:
                self._finish()

    def _do_release(self, rid, detached: int | None = None) -> None:
        """Check and release request ``rid``; ``detached``: its slot, when the id was already detached from it
        (deferred verification, see ``release_request``)."""
        st = self._w_st
        led = st.ledger
        if detached is None:
            slot = led.slot_of(rid, create=False)
        else:
            slot = detached
            n = st.detached.get(rid, 0) - 1
            if n > 0:
                st.detached[rid] = n
            else:
                st.detached.pop(rid, None)
        owned = led.owned
        total = 0
        for a in owned.values():
            total += a.item(slot)  # Python ints: no dict, no numpy scalars on the usual (clean) release
        peak = max(led.peak_pages.item(slot), owned["full"].item(slot))
        led.released_step[slot] = st.step
        if total > 0:
            held = {n: a.item(slot) for n, a in owned.items()}
            # The pages themselves (a leak is rare: the owner arrays are scanned only then).
            detail = "; ".join(
                f"{n}: {pages_list(np.flatnonzero(st.pools[n].shadow.owner == slot))}"
                for n, v in held.items()
                if v and n in st.pools
            )
            self._violate(
                "request_leak",
                f"request {rid!r} released while still owning {total} pages, neither freed nor handed to the "
                f"prefix cache ({detail})",
                slot=slot,
                op="release",
                pool=next(n for n, v in held.items() if v),
            )
        if st.want_released:
            st.seq = seq = st.seq + 1
            allocated, committed, evicted = led.record(slot)
            st.events.append(
                _B_RELEASED(
                    seq, st.clock(), st.step, rid, total, peak, allocated, committed, evicted,
                    led.decode_steps.item(slot),
                )
            )  # fmt: skip
        if detached is None:
            led.release(rid, leaked=total > 0)
        else:
            led.release_slot(slot, leaked=total > 0)
        led.tainted.discard(slot)

    # -- ledger observer (called by KvLedger on checked writes) -----------------------------------------------
    def ledger_rejected(self, slot: int, rid, violations, exc=None) -> None:
        with self._w_lock:
            self._w_st.ledger.tainted.add(slot)
            for inv, msg in violations:
                self._violate(inv, msg, slot=slot, op="ledger", pool=None)
            if exc is not None:
                self._w_to_raise.clear()  # the argument error itself is raised by the ledger
                self._deliver()
                return
            self._finish()

    def ledger_written(self, slot: int, rid, field: str, old: int, new: int) -> None:
        st = self._w_st
        write = st.want_write
        evict = st.note_evict and field == "swa_evicted_seqlen"
        if not (write or evict):
            return  # as with no sink: nothing to build, and a ledger write leaves no page delta to publish
        with st.lock:
            if write:
                self._emit(ev.LedgerWrite, rid=rid, field=field, old=old, new=new)
            if evict and st.stats is not None:
                st.stats.evict(old, new)
            if evict and st.want_evict:
                ps = st.ps
                self._emit(ev.SwaEvict, rid=rid, old=old, new=new, n_pages=new // ps - old // ps)
            self._deliver()
