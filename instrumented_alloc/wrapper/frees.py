"""Checks of the free family: every ``free*`` op, a pool view's frees, and what a free leaves in the ledger.

Contract (``_FreeChecks``, a mixin of ``InstrumentedAllocator``): a free's pages must be in use (and on an SWA
allocator its peers mapped as the op requires); with immediate verification they are judged before the call and
raise mode refuses a bad free there; then the free is forwarded and mirrored: the shadows (owners, free counts),
the owners' ledger lengths (shrunk to their pages, the records saved first: ``KvLedger.keep``) and the call's
events. An inner that raises after changing its free lists is mirrored as far as it got. The usual free takes
the fast path (``fast_paths``), which changes nothing when it declines."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import numpy as np
import torch

from instrumented_alloc import events as ev
from instrumented_alloc.allocators.base import page_disjoint
from instrumented_alloc.argcheck import (
    check_index_tensor,
    check_segments,
)
from instrumented_alloc.shadow import (
    PoolShadow,
    has_repeat,
    sorted_unique,
)
from instrumented_alloc.wrapper.constants import _ABSENT, _B_FREE, _I64, _MAX, _TORCH_I64
from instrumented_alloc.wrapper.state import _CallState, _charged, _inner_call


def _distinct_pages(slots: np.ndarray, ps: int, shift: int, offsets: np.ndarray) -> np.ndarray:
    """``sorted_unique(slots >> shift)`` (the sorted distinct pages of a set-shaped free, a fresh array). A row of
    whole-page runs (each run a page's slots in order from its first, the last run maybe shorter: what an engine
    frees for a finished request) is recognised from one slot per page, as the page-run extend check does (one
    bytes compare), and its pages sorted if none repeats; any other layout goes through ``sorted_unique``."""
    heads = slots[::ps] >> shift
    if slots.tobytes() == ((heads << shift)[:, None] + offsets).tobytes()[: slots.nbytes] and not has_repeat(heads):
        heads.sort()
        return heads
    return sorted_unique(slots >> shift)


class _FreeChecks:
    """Free checks (see the module docstring)."""

    @_charged
    def _w_sub_free(self, attr: str, pool_name: str, method: str, index, start_pos):
        """``<attr>.<method>`` (``free``, ``free_segment``, ``free_page_ids``) through its view: checked (the
        pages must be in use; raise mode refuses a host-visible bad free before the call), forwarded, mirrored
        on that pool alone (see ``_PoolView``)."""
        st = self._w_st
        op = f"{attr}.{method}"
        with st.lock:
            st.op = op
            arg = "page_ids" if method == "free_page_ids" else "free_index"
            if start_pos is _ABSENT:
                self._validate(op, check_index_tensor, arg, index, st.device)
            else:
                self._segment_args(op, index, start_pos, pool=pool_name)
            pool = st.pools[pool_name]
            forward = _inner_call(st.cost, getattr(pool.allocator, method), index, start_pos)
            if index.numel() == 0:
                return forward()
            if method == "free":
                part = self._set_part(pool, index)
            elif method == "free_segment":
                part = self._segment_part(pool, index)
            else:
                part = (pool, lambda p: (p, False, None), (index,))
            held = getattr(pool.allocator, "free_group", None) is not None
            if not held and getattr(st.inner, "free_group", None) is not None:
                # The composite is in a free group its pool's own allocator is not in (SGLang's SWA allocator
                # opens one on its full allocator only; the all-SWA allocator holds frees in its own pile): the
                # pool's shadow holds the composite's frees, but this one releases at once.
                return self._outside_group(pool.shadow, lambda: self._free(op, forward, [part]))
            return self._free(op, forward, [part])

    def _outside_group(self, shadow: PoolShadow, call: Callable):
        """``call()`` (a free of ``shadow``'s pool that its allocator releases at once) with ``shadow`` out of
        its free group: judged and mirrored as an immediate free (a page the group holds is not in use: freeing
        it again is a double free), then the group state restored. In call order: both switches go through the
        slot tier, around the free's own queued checks when deferred."""
        saved = []

        def leave() -> None:
            saved.append(shadow.in_group)
            shadow.in_group = False

        def restore() -> None:
            shadow.in_group = saved.pop()

        self._slot_tier(leave)
        try:
            return call()
        finally:
            self._slot_tier(restore)

    # -- free ops ---------------------------------------------------------------------------------------------
    def free(self, free_index):
        return self._free_call("free", free_index, _ABSENT, "_free_parts")

    def free_full(self, free_index):
        return self._free_call("free_full", free_index, _ABSENT, "_free_full_parts")

    def free_page_ids(self, page_ids):
        return self._free_call("free_page_ids", page_ids, _ABSENT, "_page_ids_parts", arg="page_ids")

    def free_segment(self, free_index, *, start_pos):
        return self._free_call("free_segment", free_index, start_pos, "_segment_parts")

    def free_full_segment(self, free_index, *, start_pos):
        return self._free_call("free_full_segment", free_index, start_pos, "_full_segment_parts")

    def free_swa(self, free_index):
        return self._free_call("free_swa", free_index, _ABSENT, "_swa_parts")

    def free_swa_segment(self, free_index, *, start_pos):
        return self._free_call("free_swa_segment", free_index, start_pos, "_swa_segment_parts")

    @_charged
    def _free_call(self, op: str, index, start_pos, parts_of: str, *, arg: str = "free_index"):
        """Every free op: validate, then forward an empty free untouched, or check and mirror it (``_free``).
        ``parts_of``: the name of the method whose ``(index, op)`` lists what the op frees per pool; None when
        this allocator has nothing to check for it (an SWA op on a single pool). A name, looked up only when the
        fast path declines: a bound method per call costs a slow lookup on the wrapper (see _CallState)."""
        st = self._w_st  # every read below from it (see _CallState)
        with st.lock:
            st.op = op
            # The usual call (a 1-D int64 host tensor, for an allocator on the host; an aligned int start) is
            # accepted inline; anything else goes through the full argument checks, which name the fault.
            if not (
                type(index) is torch.Tensor
                and index.dtype is _TORCH_I64
                and st.host
                and index.is_cpu
                and index.dim() == 1
                and (start_pos is _ABSENT or (type(start_pos) is int and start_pos >= 0 and not start_pos % st.ps))
            ):
                if start_pos is _ABSENT:
                    self._validate(op, check_index_tensor, arg, index, st.device)
                else:
                    self._segment_args(op, index, start_pos)
            if st.fast_free and index.numel():
                result = self._free_fast(st, op, index, start_pos)
                if result is not _ABSENT:
                    return result
            forward = _inner_call(st.cost, getattr(st.inner, op), index, start_pos)
            if index.numel() == 0:
                return forward()
            parts = getattr(self, parts_of)(index, op)
            if parts is None:
                return forward()
            return self._free(op, forward, parts)

    def _free_fast(self, st: _CallState, op: str, index, start_pos):
        """Immediate verification of the usual free (power-of-two page size > 1, int64 host indices, not empty), for
        the case where every check passes: every page it releases, in each pool, is in use by one and the same
        request; no page repeats where the inner does not dedup; on an SWA allocator the SWA peers of a segment
        are all mapped (``free_swa_segment``, ``free_segment``) and a full free finds none still mapped
        (``free_full``, ``free_full_segment``). Then it forwards and mirrors what the general path mirrors and
        returns the inner's result: a free of one pool (every op but an SWA ``free_segment``) inline, the
        shadow's one-owner mirror (``PoolShadow.free_owned``) then the ledger and events as ``_after_free_one``
        makes them, with the general path's failure handling (an inner that raises after changing that pool's
        free list is mirrored first, through the general plans); two pools through ``_forward_free`` with those
        plans.
        Anything else (a fault, another op, another dtype) returns ``_ABSENT`` having changed nothing: the
        general path then checks the call and reports it. A segment's unmapped SWA peer (0, or the -1 sentinel)
        reads as page 0, reserved for good, which the owner test declines.

        The pages per pool are the general path's parts computed directly (``_full_set_part``,
        ``_full_segment_part``, ``_swa_segment_part``, ``_peer_released_check``), without their closures.
        ``st``: the wrapper's ``_CallState`` (every read from it)."""
        idx = index.numpy()
        if idx.dtype is not _I64:
            return _ABSENT
        ps, shift = st.ps, st.shift
        full, swa = st.full, st.swa
        if swa is None:
            if op == "free_segment":
                parts = ((full, idx[::ps] >> shift, False),)
            elif op == "free" or op == "free_full":
                parts = ((full, idx, True),)  # set-shaped on a single pool (slots: pages below)
            elif op == "free_full_segment":
                # A per-request SWA ring frees the segment's pages by id (see _full_segment_parts); a single
                # pool's is set-shaped.
                parts = ((full, idx[::ps] >> shift, False) if st.swa_frees == "none" else (full, idx, True),)
            else:
                return _ABSENT
        elif op == "free_swa_segment" or op == "free_segment":
            reps = idx[::ps]
            # A slot outside the mapping reads a clamped entry, as in _peers_at. An unmapped peer (0, or the -1
            # sentinel) names page 0 (or a negative page, read as page 0), reserved for good: the owner test below
            # declines it, and the general path reports it (swa_mapping_inconsistent).
            peers = st.inner.full_to_swa_index_mapping.numpy().take(reps, mode="clip")
            if op == "free_segment":
                parts = ((swa, peers >> shift, False), (full, reps >> shift, False))
            else:
                parts = ((swa, peers >> shift, False),)
        elif op == "free_full" or op == "free_full_segment":
            peers = st.inner.full_to_swa_index_mapping.numpy().take(idx, mode="clip")
            if _MAX.reduce(peers) > 0:
                return _ABSENT  # a live SWA peer: the general path reports it
            parts = ((full, idx, True) if op == "free_full" else (full, idx[::ps] >> shift, False),)
        else:
            return _ABSENT
        plans = []
        for pool, pages, dedup in parts:
            if dedup:
                pages = _distinct_pages(pages, ps, shift, pool.shadow.offsets)  # slots -> their distinct pages
            # One clipped gather (a page outside the pool reads as reserved) and one memcmp: every page owned by
            # the first page's owner, a request (>= 0). That is plan_free's usual case with the owner known.
            prev = pool.shadow._owner_ext.take(pages, mode="clip")
            if prev.item(0) < 0 or prev.tobytes() != prev[:1].tobytes() * prev.size:
                return _ABSENT
            if not dedup and has_repeat(pages):
                return _ABSENT
            plans.append((pool, (pages, pages, prev, int(pages.size), dedup)))
        method = getattr(st.inner, op)
        if len(plans) != 1:
            return self._forward_free(op, _inner_call(st.cost, method, index, start_pos), plans, st)
        # One pool: _forward_free and _apply_frees inlined, the mirror without apply_free's owner tests (done above).
        pool, plan = plans[0]
        # The free list this free releases into: the only one the mirror below changes, so the only count to
        # compare if the inner raises (one call, where _forward_free reads every pool's).
        available = None if st.atomic_free else pool.probe
        before = None if available is None else available()
        timed = st.time_free  # the duration is only read by the Free events and the step's statistics
        clock = st.clock
        t0 = clock() if timed else 0.0
        st.cost.stop_checks()
        try:
            result = method(index) if start_pos is _ABSENT else method(index, start_pos=start_pos)
        except BaseException:
            st.cost.start()
            if available is not None and before != available():
                self._apply_frees(op, plans, clock() - t0 if timed else 0.0, st)
                self._deliver()
            raise
        st.cost.start()
        dt = clock() - t0 if timed else 0.0  # the inner call's alone, as the general path's Free events
        pages, _, prev, n, dedup = plan
        s = prev.item(0)
        pool.shadow.free_owned(pages, s, n, dedup)
        # _after_free_one, inlined.
        led = st.ledger
        # A request inserting into the cache frees copies the cache holds: its lengths stay (KvLedger.inserting).
        track = st.track_lengths and not (led.inserting and s in led.inserting)
        if pool is full and track:
            # The request's allocated length follows its full-pool pages when they shrink (after its protected prefix).
            led.shrink_one(s, led.owned["full"].item(s) * ps + led.protected.item(s))
        rids = None
        if timed:
            if st.stats is not None and st.stats.free(op, pool.name, n, dt):
                self._emit_stats()
            if st.want_free:
                rids = (led.rid_of(s),)
                st.seq = seq = st.seq + 1
                st.events.append(_B_FREE(seq, clock(), st.step, op, pool.name, n, rids, dt))
        # prev[:1]: a view of a gather made for this free alone, never written.
        self._owner_freed(st, op, s, track, prev[:1], rids)
        if st.bus.active or st.to_raise or st.events:
            self._finish()
        return result

    def free_segments(self, segments):
        """SGLang's batched row free: each segment goes through the instrumented ``free_segment`` (the inner's
        own loop would call its own ``free_segment`` and bypass the checks). Malformed segments are rejected
        before any is freed."""
        for free_index, start_pos in page_disjoint(self._checked_segments("free_segments", segments), self._w_ps):
            self.free_segment(free_index, start_pos=start_pos)

    def free_full_segments(self, segments):
        for free_index, start_pos in page_disjoint(self._checked_segments("free_full_segments", segments), self._w_ps):
            self.free_full_segment(free_index, start_pos=start_pos)

    def _checked_segments(self, op: str, segments) -> list:
        with self._w_lock:
            self._w_st.op = op
            return self._validate(op, check_segments, "segments", segments, self._w_device)

    def _free(self, op: str, forward: Callable, parts: list):
        """Check (pre-call when the indices are on the host), forward, mirror. See the module contract."""
        self._w_st.op = op
        if not self._w_deferred:
            return self._free_now(op, forward, parts)
        timing = [0.0]  # wall time of the inner call alone, for the Free events

        def plan_all(arrays_per_part):
            plans = []
            for (pool, fn, _), arrays in zip(parts, arrays_per_part):
                r = fn(*arrays)
                if pool is None or r is None:
                    continue
                pages, dedup, unmapped = r
                bad, plan = pool.shadow.plan_free(pages, dedup=dedup, op=op, unmapped=unmapped)
                self._report(bad, pool.name, op)
                plans.append((pool, plan))
            return plans

        def apply_all(plans):
            touched = []
            for pool, plan in plans:
                owners = pool.shadow.apply_free(plan)
                touched.append((pool, owners, plan[3]))
            self._after_free(op, touched, timing[0])

        def timed_forward():
            t0 = self._w_clock()
            try:
                return forward()
            finally:
                timing[0] = self._w_clock() - t0

        tensors = [t for _, _, ts in parts for t in ts]
        shapes = [len(ts) for _, _, ts in parts]

        def deferred(*arrays, only=None):
            grouped, i = [], 0
            for k in shapes:
                grouped.append(arrays[i : i + k])
                i += k
            plans = plan_all(grouped)
            if only is not None:  # the inner raised: the pools it changed (see _mirror_on_failure)
                plans = [(pool, plan) for pool, plan in plans if pool.name in only]
                if not plans:
                    return
            apply_all(plans)

        def mirror_changed(changed):
            self._slot_tier(functools.partial(deferred, only=changed), *tensors)

        with self._mirror_on_failure(mirror_changed):
            result = timed_forward()
        self._slot_tier(deferred, *tensors)
        self._finish()
        return result

    def _free_now(self, op: str, forward: Callable, parts: list):
        """``_free`` with immediate verification (host tensors): check every part before the call (raise mode
        refuses a bad free there), forward, mirror. Written out without closures: this is every free's path."""
        plans = []
        for pool, fn, arrays in parts:
            if len(arrays) == 1:
                a = arrays[0]
                r = fn(a if type(a) is np.ndarray else a.numpy())
            else:
                r = fn(*(a if type(a) is np.ndarray else a.numpy() for a in arrays))
            if pool is None or r is None:
                continue
            pages, dedup, unmapped = r
            bad, plan = pool.shadow.plan_free(pages, dedup=dedup, op=op, unmapped=unmapped)
            if bad:
                self._report(bad, pool.name, op)
            plans.append((pool, plan))
        st = self._w_st
        if st.raising and st.to_raise:
            self._finish()  # raises: the inner allocator never sees the bad free
        return self._forward_free(op, forward, plans, st)

    def _forward_free(self, op: str, forward: Callable, plans: list, st: _CallState):
        """Forward a checked immediate free, then mirror its plans (and deliver). If the inner raises after
        changing its free lists (SGLang's post-condition asserts do), the change is mirrored before the exception
        propagates, pool by pool: the plans of the pools whose free lists changed (an SWA free that asserts after
        releasing its SWA pages and before its full ones mirrors the SWA plan alone); if it raised before changing
        anything, nothing is. ``st``: the wrapper's ``_CallState``."""
        # _mirror_on_failure, inlined (a generator context manager costs a few microseconds per free). Our token
        # and paged allocators change nothing when their free raises: no counts to capture for them.
        pools = st.pools.values()
        before = None if st.atomic_free else [p.probe() for p in pools]
        timed = st.time_free  # the duration is only read by the Free events and the step's statistics
        clock = st.clock
        t0 = clock() if timed else 0.0
        try:
            result = forward()
        except BaseException:
            if before is not None:
                changed = [p for p, b in zip(pools, before) if b != p.probe()]
                done = [(pool, plan) for pool, plan in plans if pool in changed]
                if done:
                    self._apply_frees(op, done, clock() - t0 if timed else 0.0, st)
                    self._deliver()
            raise
        self._apply_frees(op, plans, clock() - t0 if timed else 0.0, st)
        if st.bus.active or st.to_raise or st.events:
            self._finish()
        return result

    def _apply_frees(self, op: str, plans: list, duration: float, st: _CallState) -> None:
        if len(plans) == 1:
            pool, plan = plans[0]
            owners = pool.shadow.apply_free(plan)
            if owners.size == 1:
                self._after_free_one(op, (pool, owners, plan[3]), duration, st)
            else:
                self._after_free(op, [(pool, owners, plan[3])], duration)
        else:
            self._after_free(op, [(pool, pool.shadow.apply_free(plan), plan[3]) for pool, plan in plans], duration)

    @contextlib.contextmanager
    def _mirror_on_failure(self, mirror: Callable):
        """If the inner raises after changing its free lists (SGLang's post-condition asserts do), mirror the
        change before the exception propagates: ``mirror(changed)``, ``changed`` the names of the pools whose free
        lists changed; if it raised before changing anything, mirror nothing."""
        pools = self._w_st.pools.values()
        before = [p.entries() for p in pools]
        try:
            yield
        except BaseException:
            changed = frozenset(p.name for p, b in zip(pools, before) if b != p.entries())
            if changed:
                mirror(changed)
                self._deliver()
            raise

    def _after_free(self, op: str, touched, duration: float = 0.0) -> None:
        """Ledger and events after a free. ``touched``: (pool, distinct owner slots, entries) per pool."""
        if len(touched) == 1 and touched[0][1].size == 1:
            return self._after_free_one(op, touched[0], duration, self._w_st)
        led = self._w_st.ledger
        ps = self._w_ps
        slots_all = []
        # Requests inserting into the cache free copies the cache holds: their lengths stay (KvLedger.inserting).
        inserting = np.fromiter(led.inserting, np.int64, len(led.inserting)) if led.inserting else None
        stats = self._w_st.stats
        for pool, owners, n_entries in touched:
            if owners.size:
                slots_all.append(owners)
                if pool.name == "full" and self._w_st.track_lengths:
                    shrink = owners if inserting is None else owners[~np.isin(owners, inserting)]
                    if self._w_st.swa_frees == "pool":
                        self._one_pool_lengths(op, shrink)
                    else:
                        # The request's allocated length follows its full-pool pages when they shrink (after its
                        # protected prefix, the cache's pages).
                        led.shrink(shrink, led.owned["full"][shrink] * ps + led.protected[shrink])
            if stats is not None and stats.free(op, pool.name, int(n_entries), duration):
                self._emit_stats()
            if self._w_st.want_free:
                self._emit(
                    ev.Free,
                    op=op,
                    pool=pool.name,
                    n_pages=int(n_entries),
                    rids=tuple(led.rid_of(int(s)) for s in owners),
                    duration=duration,
                )
        if slots_all:
            slots = slots_all[0] if len(slots_all) == 1 else np.unique(np.concatenate(slots_all))
            empty = np.ones(slots.size, bool)
            for arr in led.owned.values():
                empty &= arr[slots] <= 0
            if not self._w_st.track_lengths:
                empty[:] = False  # the engine's lengths: a request with no page left keeps them until it writes
            elif inserting is not None:
                empty &= ~np.isin(slots, inserting)
            for s in slots[empty]:
                led.keep(int(s))
                led.reset(int(s))
                led.tainted.discard(int(s))
            led.dirty.update(int(s) for s in slots)
            # slots: apply_free's owners (a gather or np.unique of one: fresh) or np.unique's result; read above,
            # never written, held by no one else. A released request's slot (its pages leaked, freed since) has no
            # ledger row to update: no entry (a LedgerUpdate names rows that exist; replay would revive it).
            live = led.live[slots]
            if led.cache >= 0:
                live &= slots != led.cache  # the prefix cache's slot has no ledger row
            self._emit_ledger(op, slots if live.all() else slots[live], private=True)

    def _one_pool_lengths(self, op: str, slots: np.ndarray) -> None:
        """``_after_free``'s length update on SGLang's all-SWA allocator, whose one pool (tracked as "full") holds
        a request's pages less those its window evicted. Its SWA frees (``free_swa``, ``free_swa_segment``) are
        that eviction, which the engine records next with its ``swa_evicted_seqlen`` write (SGLang's order, in
        mem_cache/common.py): the request's lengths stay, as on the two-pool allocator. Any other free shrinks
        them to what its pages cover: the pages it still owns after its evicted length or its protected prefix (the
        cache's pages), whichever is longer, as the ledger check counts them. ``slots``: the distinct
        owner slots of the freed pages."""
        if op == "free_swa" or op == "free_swa_segment":
            return
        led = self._w_st.ledger
        led.shrink(slots, led.owned["full"][slots] * self._w_ps + np.maximum(led.evicted[slots], led.protected[slots]))

    def _after_free_one(self, op: str, touched, duration: float, st: _CallState) -> None:
        """``_after_free`` for the usual free: one request's pages in one pool, in Python ints. ``st``: the
        wrapper's ``_CallState`` (every read from it)."""
        pool, owners, n_entries = touched
        led = st.ledger
        s = int(owners[0])
        # A request inserting into the cache frees copies the cache holds: its lengths stay (KvLedger.inserting).
        track = st.track_lengths and not (led.inserting and s in led.inserting)
        if pool.name == "full" and track:
            if st.swa_frees == "pool":
                self._one_pool_lengths(op, owners)
            else:
                # The request's allocated length follows its full-pool pages when they shrink (after its protected
                # prefix, the cache's pages).
                led.shrink_one(s, led.owned["full"].item(s) * st.ps + led.protected.item(s))
        rids = None
        if st.stats is not None and st.stats.free(op, pool.name, int(n_entries), duration):
            self._emit_stats()
        if st.want_free:
            rids = (led.rid_of(s),)
            st.seq = seq = st.seq + 1
            st.events.append(_B_FREE(seq, st.clock(), st.step, op, pool.name, int(n_entries), rids, duration))
        # owners: apply_free's prev[:1], a view of a clipped gather made for this free alone: never written.
        self._owner_freed(st, op, s, track, owners, rids)

    def _owner_freed(self, st: _CallState, op: str, s: int, track: bool, slots, rids) -> None:
        """What a free of request slot ``s``'s pages leaves in its ledger (the fast path's and ``_after_free_one``'s
        common end): a request with no page left in any pool holds no KV (when its lengths are tracked), its
        ledger comparison is due, and its ``LedgerUpdate`` (``slots``: ``[s]``, an array no one writes) is built."""
        led = st.ledger
        for arr in led.owned.values():
            if arr.item(s) > 0:
                break
        else:
            if track:  # else the engine's lengths: a request with no page left keeps them
                if led.keep_records:
                    led.keep(s)
                led.reset(s)
                led.tainted.discard(s)
        led.dirty.add(s)
        # A released request's slot has no row to update, nor has the prefix cache's.
        if st.want_ledger and led.live.item(s) and s != led.cache:
            self._emit_ledger(op, slots, rids or (led.rid_of(s),), private=True)
