"""Transitions of whole pools: free groups, merges, ``clear()`` and ``resize()``.

Contract (``_PoolTransitions``, a mixin of ``InstrumentedAllocator``): each is forwarded, then mirrored in the
shadows in call order (behind the queued checks when deferred); a ``free_group_end`` that raises is mirrored as
far as the inner got. ``clear``/``resize`` reset the shadows and the live requests' ledger rows (their records
kept: a clear is no allocation)."""

from __future__ import annotations

from collections.abc import Callable

from instrumented_alloc.wrapper.constants import _ABSENT
from instrumented_alloc.wrapper.state import _CallState, _charged, _make_pool


class _PoolTransitions:
    """Whole-pool transitions (see the module docstring)."""

    @_charged
    def resize(self, config):
        """Forwarded, then every pool's shadow is rebuilt for the new size (the inner clears itself)."""
        inner = self._w_inner
        with self._w_lock:
            self._w_st.op = "resize"
            self._drain(wait=True)
            self._w_st.cost.stop_checks()
            try:
                result = inner.resize(config)
            finally:
                self._w_st.cost.start()
            led = self._w_st.ledger
            need_sort = self._w_need_sort
            pools = {n: _make_pool(n, p.allocator, led, need_sort) for n, p in self._w_st.pools.items()}
            object.__setattr__(self, "_w_pools", pools)
            object.__setattr__(self, "_w_full", pools["full"])
            object.__setattr__(self, "_w_swa", pools.get("swa"))
            self._set_counts()
            self._sync_deltas()
            self._cleared()
            self._finish()
            return result

    def free_group_begin(self):
        return self._forward_then_mirror("free_group_begin", self._group_begin)

    def free_group_end(self):
        return self._forward_then_mirror("free_group_end", self._group_end)

    def merge_and_sort_free(self):
        return self._forward_then_mirror("merge_and_sort_free", self._merged)

    @_charged
    def _forward_then_mirror(self, name: str, mirror: Callable):
        """Argument-free state transitions: forward, then mirror them in the shadow in call order. A
        ``free_group_end`` that raises (SGLang's post-condition asserts fire inside its free of the held pages) is
        mirrored as far as the inner got: ``_group_end_failed``."""
        st = self._w_st
        with st.lock:
            st.op = name
            pools = st.pools.values()
            ending = name == "free_group_end"
            # The free counts before the call, to tell which pools a raising free_group_end changed: only when
            # the group may hold some free (an engine opens and ends a group every iteration, most of them empty;
            # deferred verification mirrors the frees later, so its shadow cannot say).
            held = ending and (st.deferred or any(p.shadow.held_set or p.shadow.held_ids for p in pools))
            before = [p.entries() for p in pools] if held else None
            st.cost.stop_checks()
            try:
                result = getattr(st.inner, name)()
            except BaseException:
                st.cost.start()
                if ending:
                    changed = () if before is None else (p.name for p, b in zip(pools, before) if b != p.entries())
                    self._group_end_failed(st, frozenset(changed))
                raise
            st.cost.start()
            if st.deferred:
                self._slot_tier(mirror)  # behind the queued checks
            else:
                mirror()  # what _slot_tier does at once in immediate mode
            if st.events or st.to_raise or st.want_pages:
                self._finish()
            return result

    @_charged
    def clear(self):
        inner = self._w_inner
        with self._w_lock:
            self._w_st.op = "clear"
            # Rare and never on the hot path: finish the queued checks first, so that nothing queued before the
            # clear lands after it (the host-side page counts are reset now, with the shadow).
            self._drain(wait=True)
            self._w_st.cost.stop_checks()
            try:
                result = inner.clear()
            finally:
                self._w_st.cost.start()
            self._cleared()
            self._finish()
            return result

    def _group_begin(self) -> None:
        st = self._w_st
        pools = st.pools
        if len(pools) == 1 and st.full.allocator is not st.inner and st.swa_frees == "peers":
            # HiSparse (one pool, its logical allocator: see __init__): free groups are no-ops (frees happen at
            # once), so nothing is held. Not SGLang's one-pool SWA layouts, whose groups hold: a per-request SWA
            # ring's opens one on its full allocator; the all-SWA allocator holds every free itself until the
            # group ends (and frees the held slots once more through its own free, no dedup at page size 1).
            return
        for p in pools.values():
            p.shadow.group_begin()

    def _group_end(self) -> None:
        for p in self._w_st.pools.values():
            p.shadow.group_end()

    def _group_end_failed(self, st: _CallState, changed: frozenset) -> None:
        """The inner's ``free_group_end`` raised. The pools whose free lists changed released their held pages:
        their group ends in the shadow. The others' held pages were not released; if the inner left its group
        (``free_group`` None, as SGLang's and ours leave it before freeing), they are lost to it: the shadow
        leaves the group and keeps them held (``PoolShadow.group_abandon``). If the inner changed nothing and is
        still in its group, nothing is mirrored. In call order (behind the queued checks, when deferred)."""
        group = getattr(st.inner, "free_group", _ABSENT)
        left = bool(changed) if group is _ABSENT else group is None
        if not changed and not left:
            return

        def mirror():
            for p in st.pools.values():
                if p.name in changed:
                    p.shadow.group_end()
                elif left:
                    p.shadow.group_abandon()

        if st.deferred:
            self._slot_tier(mirror)
        else:
            mirror()
        self._deliver()

    def _merged(self) -> None:
        for p in self._w_st.pools.values():
            p.shadow.merged()

    def _cleared(self) -> None:
        led = self._w_st.ledger
        for p in self._w_st.pools.values():
            p.shadow.clear()
            led.owned[p.name][:] = 0
        for s in led.live_slots():
            led.keep(int(s))  # a clear is no allocation: the requests' records stay what they were
            led.reset(int(s))
        led.tainted.clear()
