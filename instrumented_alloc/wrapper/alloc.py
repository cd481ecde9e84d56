"""Checks of a plain ``alloc`` (the wrapper's and a pool view's), a refused allocation, and what every allocation
shares: the bound requests' shares, the merge of staged pages, a misaligned slot.

Contract (``_AllocChecks``, a mixin of ``InstrumentedAllocator``): forwards the call, then checks every slot
handed out (in range, free, page-aligned at its position, not handed to two requests) and mirrors it: writes the
pools' shadows (owners, free counts), the bound requests' ledger columns (owned pages, lengths, decode steps of a
plain ``alloc`` at page size 1) and the call's events. Reads the per-call state and the thread's ``batch()``
binding. The page-run and page-size-1 fast paths change nothing when they decline; the general path then judges
the call and reports."""

from __future__ import annotations

import numpy as np

from instrumented_alloc import events as ev
from instrumented_alloc.argcheck import (
    ArgumentValueError,
    check_int,
)
from instrumented_alloc.ledger import KvLedger
from instrumented_alloc.shadow import (
    FREE,
    has_repeat,
)
from instrumented_alloc.wrapper.constants import _ADD, _B_ALLOC, _I64, _MIN
from instrumented_alloc.wrapper.state import _CallState, _charged, _Pool


def _count_decodes(led: KvLedger, slots: np.ndarray, shares) -> None:
    """Before a plain ``alloc`` adds ``shares`` (an int or one per slot) to the bound requests: a share of one slot
    to a request already holding KV is a decode step (SGLang decodes so at page size 1). The records it sets
    replace any a free saved (``KvLedger.kept``). Only while the records are read (``KvLedger.keep_records``)."""
    if not led.keep_records:
        return
    if led.kept:
        led.unkeep(slots)
    if type(shares) is int:
        if shares != 1 or not slots.size:
            return
        committed = led.committed[slots]
        if _MIN.reduce(committed) > 0:  # every request holds KV (the usual decode): a count, no column write
            led.count_decodes(slots)
        else:
            led.decode_steps[slots] += committed > 0
    else:
        held = led.committed[slots] > 0
        held &= shares == 1
        led.decode_steps[slots] += held


class _AllocChecks:
    """Allocation checks (see the module docstring)."""

    @_charged
    def _w_sub_alloc(self, attr: str, pool_name: str, need_size: int):
        """``<attr>.alloc(need_size)`` through its view: forwarded, the pages handed out checked and mirrored as
        held by no request (see ``_PoolView``)."""
        st = self._w_st
        with st.lock:
            op = f"{attr}.alloc"
            st.op = op
            n = self._validate(op, check_int, "need_size", need_size)
            pool = st.pools[pool_name]
            before = pool.entries()
            staged = pool.staged() if st.need_sort else 0
            st.cost.stop_checks()
            t0 = st.clock()
            try:
                out = pool.allocator.alloc(n)
            finally:
                st.cost.start()
            dt = st.clock() - t0
            if staged and pool.staged() == 0:
                # need_sort: an allocation that ran short merged the pool's staged pages into its free list first
                # (as _after_merge_check, for this pool alone): mirrored before the pages handed out are judged.
                self._slot_tier(pool.shadow.merged)
            if out is None:
                # A refusal must take no page (see _alloc_none).
                if pool.entries() != before:
                    pool.shadow.expected_entries = before
                    self._report(pool.shadow.check_count(pool.entries(), f"{op} returned None but"), pool_name, op)
                if st.stats is not None:
                    st.stats.failure(pool_name, op)
                if self.bus.wants(ev.AllocFailed):
                    self._emit(
                        ev.AllocFailed,
                        op=op,
                        pool=pool_name,
                        requested=n,
                        available=int(pool.allocator.available_size()),
                        rids=(),
                        duration=dt,
                    )
                self._finish()
                return None
            ps = st.ps
            got = int(out.shape[0])
            if got != n:
                # SGLang's paged alloc takes a page-aligned need_size (its debug mode asserts it) and hands out
                # need_size // page_size pages: an unaligned one gets fewer slots than asked, as the wrapper's own
                # alloc reports.
                self._alloc_mismatch(op, n, got, pool_name)

            def verify(o):
                if ps == 1:
                    self._report(pool.shadow.on_alloc(o, -1, None, got, op), pool_name, op)
                else:
                    self._alloc_pages_check(pool, o, -1, got, op)

            self._slot_tier(verify, out)
            stats = st.stats
            if stats is not None and stats.alloc(op, pool_name, got // ps, dt):
                self._emit_stats()
            if st.want_alloc:
                st.seq = seq = st.seq + 1
                st.events.append(_B_ALLOC(seq, st.clock(), st.step, op, pool_name, got, got // ps, (), dt))
            self._finish()
            return out

    def _alloc_mismatch(self, op: str, n: int, got: int, pool: str) -> None:
        """``alloc_length_mismatch``: ``op`` (a plain ``alloc``, the wrapper's or a pool view's) asked for ``n``
        slots and got ``got``. The contract is exactly ``n`` (SGLang's paged allocators expect a page-aligned
        ``n``: an unaligned one is handed ``n // page_size`` pages, which the message names)."""
        ps = self._w_ps
        expect = n // ps * ps
        self._violate(
            "alloc_length_mismatch",
            f"{op}({n}) returned {got} slots"
            + (f" (page size {ps}: {n} is not a multiple, {expect} handed out)" if ps > 1 and got == expect else ""),
            op=op,
            pool=pool,
        )

    def _alloc_pages_check(self, pool: _Pool, slots: np.ndarray, own, got: int, op: str) -> None:
        """A plain ``alloc`` of ``got`` slots at page size > 1 (host ``slots``): whole pages from their first slot,
        handed out to ``own`` (owner code per page, or -1), mirrored in ``pool``'s shadow."""
        ps = self._w_ps
        starts = slots[::ps]
        if (starts % ps).any():
            self._violate(
                "slot_page_alignment",
                f"{op} returned a page not starting at a page boundary: slots {starts[:4].tolist()}",
                op=op,
                pool=pool.name,
            )
        self._report(pool.shadow.on_alloc(starts // ps, own, None, got // ps, op), pool.name, op)

    # -- allocation ops ---------------------------------------------------------------------------------------
    @_charged
    def alloc(self, need_size: int):
        st = self._w_st  # the wrapper's state, read from it (see _CallState)
        with st.lock:
            op = "alloc"
            st.op = op
            if type(need_size) is int and need_size >= 0:
                n = need_size  # what check_int accepts and returns unchanged
            else:
                n = self._validate(op, check_int, "need_size", need_size)
            bound = getattr(st.tls, "bound", None)
            if bound is not None and bound[2] is not None and int(_ADD.reduce(bound[2])) != n:
                self._invalid(
                    op, ArgumentValueError("lens", f"the bound lens sum to {int(bound[2].sum())}, alloc asks {n}")
                )
            before = self._entries_before() if st.capture_before else None
            st.cost.stop_checks()
            t0 = st.clock()
            try:
                out = st.inner.alloc(n)
            finally:
                st.cost.start()
            dt = st.clock() - t0
            if st.need_sort:
                self._after_merge_check(before)
            if out is None:
                return self._alloc_none(op, n, before, dt)
            fast = st.fast_alloc and bound is not None and n and out.shape[0] == n
            if fast and self._alloc_fast(st, out, n, bound, dt):
                return out
            ps = st.ps
            got = int(out.shape[0])
            if got != n:
                self._alloc_mismatch(op, n, got, "full")
            own, grow = self._alloc_owners(n if got == n else got)
            full = self._w_st.full
            if ps == 1:

                def verify(o, s=None):
                    bad = full.shadow.on_alloc(o, own, None, got, op)
                    self._report(bad, "full", op)
                    if s is not None:
                        swa_shadow = self._w_st.swa.shadow
                        # A full slot listed twice has one SWA peer for both: the SWA side repeats with it.
                        swa_shadow.relisted |= full.shadow.relisted
                        self._report(swa_shadow.on_alloc(s, own, None, got, op), "swa", op)

            else:

                def verify(o, s=None):
                    self._alloc_pages_check(full, o, own, got, op)

            self._host_alloc_ledger(op, grow)
            if self._w_st.swa is not None:
                self._slot_tier(verify, out, self._swa_peer(out))
            else:
                self._slot_tier(verify, out)
            self._emit_alloc(op, got, got // ps, dt)
            if self._w_st.swa is not None:
                self._emit_alloc(op, got, got, 0.0, pool="swa")
            self._finish()
            return out

    def _alloc_fast(self, st: _CallState, out, n: int, bound, dt: float) -> bool:
        """``alloc(n)`` at page size 1 on one pool, verified immediately, bound to requests (SGLang's decode and
        extend there), for the case where every check passes: every slot in range and free, and no slot handed to
        two requests (the owners read back, undone before declining). Then it applies what
        the general path applies (the requests' shares as in ``_alloc_owners``, their ledger rows, the shadow,
        the free count, the events in the same order) and returns True. Otherwise it returns False having changed
        nothing, and the general path checks the call and reports it. ``st``: the wrapper's ``_CallState``."""
        o = out.numpy()
        if o.dtype is not _I64:
            return False
        rids, slots, lens = bound[0], bound[1], bound[2]
        # Owner codes as int32 (the shadow's dtype): written and read back without a cast.
        own32 = bound[3]
        if own32 is None:
            own32 = bound[3] = slots.astype(np.int32)
            own32.setflags(write=False)  # shared by this block's page deltas (see _bind)
        if lens is not None:
            shares, own = lens, own32.repeat(lens)
        elif len(rids) == 1:
            shares, own = n, np.full(n, slots[0], np.int32)
        elif len(rids) == n:
            shares, own = 1, own32  # a decode: one slot each
        else:
            return False
        shadow = st.full.shadow
        # A slot outside the pool reads as reserved (the clipped gather, see PoolShadow): not free.
        prev = shadow._owner_ext.take(o, mode="clip")
        if np.count_nonzero(prev > FREE):
            return False  # handed out twice, reserved, or outside the pool: the general path reports it
        if shadow.relisted and n > 1 and has_repeat(o):
            return False  # one slot twice in this call, after a double free relisted it: the general path reports it
        shadow.owner[o] = own
        if n > 1 and len(rids) > 1 and shadow.owner[o].tobytes() != own.tobytes():
            # One slot handed to two requests in this call (the later write wins): undone, and declined; the
            # general path reports it (PoolShadow.shared_in_call).
            shadow.owner[o] = prev
            return False
        led = st.ledger
        _count_decodes(led, slots, shares)
        for arr in led.owned.values():
            arr[slots] += shares
        led.allocated[slots] += shares
        led.committed[slots] += shares
        self._emit_ledger("alloc", slots, rids, private=True)  # the binding's (read-only)
        shadow.version += 1  # owner written above (see PoolShadow.version)
        if shadow.deltas is not None:
            shadow.note(o, own)
        shadow.expected_entries -= n
        if st.bus.active:
            self._emit_alloc("alloc", n, n, dt)
            self._finish()
        return True

    def _alloc_owners(self, n: int):
        """Owner per returned slot of a plain alloc(n), and each bound request's page growth."""
        bound = self._w_bound
        if bound is None:
            return -1, None
        rids, slots, lens = bound[:3]
        ps = self._w_ps
        if lens is not None and int(lens.sum()) == n:
            shares = lens
        elif len(rids) == 1:
            shares = np.array([n], np.int64)
        elif len(rids) == n:
            shares = np.ones(n, np.int64)
        else:
            return -1, None
        own = np.repeat(slots, shares) if ps == 1 else np.repeat(slots, shares // ps)
        return own, (slots, shares)

    def _host_alloc_ledger(self, op: str, grow) -> None:
        if grow is None:
            return
        slots, shares = grow
        led = self._w_st.ledger
        ps = self._w_ps
        pages = shares // ps if ps > 1 else shares
        _count_decodes(led, slots, shares)
        for name in led.owned:
            led.owned[name][slots] += pages
        led.allocated[slots] += pages * ps
        led.committed[slots] += shares
        self._emit_ledger(op, slots, self._w_bound[0], private=True)  # the binding's (read-only)

    def _entries_before(self):
        # Only a multi-pool allocator can refuse (None) after changing a pool (SGLang's SWA decode), and only
        # need_sort merges inside an allocation: otherwise nothing to capture.
        st = self._w_st  # every read below from it (see _CallState)
        if st.need_sort:
            return [(p.count(), p.staged()) for p in st.pools.values()]
        if len(st.pools) > 1:
            return [(p.count(), 0) for p in st.pools.values()]
        return None

    def _alloc_none(self, op: str, requested: int, before, duration: float = 0.0) -> None:
        """The inner refused: it must not have taken any page (SGLang's SWA decode can; that is reported)."""
        for pool, (was, _) in zip(self._w_st.pools.values(), before or ()):
            now = pool.entries()
            if now != was:
                pool.shadow.expected_entries = was
                bad = pool.shadow.check_count(now, f"{op} returned None but")
                self._report(bad, pool.name, op)
        stats = self._w_st.stats
        want = self.bus.wants(ev.AllocFailed)
        if want or stats is not None:
            # Name the pool that ran short: the one with fewer free slots.
            short = min(self._w_st.pools.values(), key=lambda p: p.allocator.available_size())
            if stats is not None:
                stats.failure(short.name, op)
            if want:
                bound = self._w_bound
                self._emit(
                    ev.AllocFailed,
                    op=op,
                    pool=short.name,
                    requested=int(requested),
                    available=int(short.allocator.available_size()),
                    rids=bound[0] if bound else (),
                    duration=duration,
                )
        self._finish()
        return None

    def _after_merge_check(self, before) -> None:
        # need_sort: an allocation that ran short merged the staged pages into the free list first. Judged
        # from the inner's host-side staged counts, since the shadow may still be behind (deferred mode).
        for pool, (_, staged_before) in zip(self._w_st.pools.values(), before):
            if staged_before and pool.staged() == 0:
                self._slot_tier(pool.shadow.merged)

    def _misaligned(self, o, pos, own, op, pool) -> None:
        bad = np.flatnonzero((o - pos) % self._w_ps)
        i = int(bad[0])
        slot = int(own[i]) if isinstance(own, np.ndarray) else -1
        self._violate(
            "slot_page_alignment",
            f"{op}: {bad.size} slots break slot % {self._w_ps} == position % {self._w_ps}; first: position "
            f"{int(pos[i])} got slot {int(o[i])}",
            slot=slot,
            op=op,
            pool=pool,
        )

    def _bound_slots(self, bs: int, op: str):
        bound = self._w_bound
        if bound is None:
            return None
        rids, slots = bound[0], bound[1]
        if len(rids) != bs:
            self._invalid(op, ArgumentValueError("batch", f"{len(rids)} request ids bound, the call has {bs} requests"))
        return slots
