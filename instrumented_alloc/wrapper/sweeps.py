"""Step boundaries and sweeps: ``step()``, ``flush()``, ``check_consistency()``.

Contract (``_Sweeps``, a mixin of ``InstrumentedAllocator``): a boundary never waits on the device. It verifies
the deferred checks whose copies are complete, compares each pool's free count with the shadow's, and the
ledger against the pages for the requests that changed (``ledger.dirty``, cleared here); ``flush`` and sweeps
compare every request, sweeps also the inner's free lists, leaks, the SWA mapping and the prefix cache.
Writes ``st.step``, the self-cost iteration, and the boundary's events: ``StepStats`` (the step's statistics,
handed over) at every boundary, after what the boundary's own checks counted."""

from __future__ import annotations

import numpy as np
import torch

from instrumented_alloc import events as ev
from instrumented_alloc.argcheck import (
    ArgumentTypeError,
)
from instrumented_alloc.invariants import Violation
from instrumented_alloc.shadow import (
    FREE,
    pages_list,
    sorted_unique,
)
from instrumented_alloc.wrapper.constants import _B_STEP
from instrumented_alloc.wrapper.state import _charged


class _Sweeps:
    """Step boundaries and sweeps (see the module docstring)."""

    @_charged
    def step(self) -> None:
        """A step boundary: deferred checks whose copies are complete, count conservation, the ledger against
        the pages, periodic snapshots. Never waits on the device."""
        st = self._w_st  # every read below from it (see _CallState)
        if st.off:
            return
        with st.lock:
            st.step += 1
            st.op = "step"
            cost = st.cost
            spent = cost.close_iteration()
            pending = st.pending
            if pending:
                self._drain(wait=False)
            if not pending:
                # _boundary_checks("step"), inline for the usual boundary (a method call costs what it checks):
                # every pool's count; on a mismatch the general form, which reports it; else the ledger against
                # the pages for the requests that changed.
                for count, shadow in st.counts:
                    if count() != shadow.expected_entries:
                        self._boundary_checks("step")
                        break
                else:
                    if st.ledger.dirty:
                        self._check_ledger_pages("step", False)
            bus = st.bus
            if bus.active:
                if st.want_pages:
                    self._flush_deltas()
                if st.want_step:
                    st.seq = seq = st.seq + 1
                    st.events.append(
                        _B_STEP(
                            seq,
                            st.clock(),
                            st.step,
                            {n: p.shadow.expected_entries for n, p in st.pools.items()},
                            cost.totals(),
                            spent,
                        )
                    )
                if self._w_snapshot_every and st.step % self._w_snapshot_every == 0 and bus.wants(ev.Snapshot):
                    self._emit_snapshots()
                if st.stats is not None:
                    self._emit_stats(cost.totals(), spent)
            if st.events or st.to_raise:
                self._finish()

    @_charged
    def flush(self) -> None:
        """Complete every deferred check (waits for outstanding device copies) and the count checks."""
        if self._w_off:
            return
        with self._w_lock:
            self._w_st.op = "flush"
            self._drain(wait=True)
            self._boundary_checks("flush", every_request=True)
            self._emit_stats()  # nothing counted stays pending after a final flush
            self._finish()

    @_charged
    def check_consistency(self, *, cached=None, idle: bool = False) -> list[Violation]:
        """A full sweep, for idle time: conservation against the inner's free lists, free-list duplicates,
        pages owned by finished requests, the SWA mapping, the ledger against the pages. May synchronise.

        ``cached`` (optional): the full-pool slots the engine's prefix cache holds now (SGLang's
        ``tree_cache.all_values_flatten()``). The pool identity is then checked against the cache itself: free +
        request-owned + cache-owned + staged + reserved == capacity, where the cache-owned pages are those the
        cache holds. A page the wrapper saw handed to the cache that the cache holds no more (the cache lost it:
        SGLang's idle check counts it as a leak), and a page the cache holds that was never handed to it, are
        ``pool_conservation``, named with their pages and owners.

        ``idle``: the engine says that no request holds KV now (SGLang's scheduler is fully idle, where it runs its
        own leak check). A request the wrapper still knows that owns pages was never released: ``request_leak``,
        naming it and its pages (once per request)."""
        if self._w_off:
            return []
        with self._w_lock:
            before = sum(self.violation_counts.values())
            self._w_st.op = "sweep"
            self._drain(wait=True)
            found = []
            for pool in self._w_st.pools.values():
                found += [(pool.name, b) for b in pool.shadow.check_census(pool.census())]
            for pool_name, (inv, msg, slot) in found:
                self._violate(inv, msg, slot=slot, pool=pool_name, op="sweep")
            if cached is not None:
                self._sweep_cache(cached)
            if idle:
                self._sweep_unreleased()
            self._sweep_leaks()
            if self._w_st.swa is not None:
                self._sweep_mapping()
            self._boundary_checks("sweep", every_request=True)
            new = sum(self.violation_counts.values()) - before
            recent = list(self.violations)[-new:] if new else []
            self._emit_stats()
            self._finish()
            return recent

    def _boundary_checks(self, op: str, *, every_request: bool = False) -> None:
        for pool in self._w_st.pools.values():
            shadow = pool.shadow
            entries = pool.count()
            if entries != shadow.expected_entries:  # check_count only on a mismatch (it reports, then resyncs)
                self._report(shadow.check_count(entries, op), pool.name, op)
        if every_request or self._w_st.ledger.dirty:
            self._check_ledger_pages(op, every_request)

    def _check_ledger_pages(self, op: str, every_request: bool) -> None:
        """Pages each request owns against its ledger. A step boundary compares the requests whose ledger or
        pages changed other than by the wrapper's own allocation updates (those keep both in step by
        construction, and the slot tier verifies the pages they name); flush and sweeps compare every one.
        Mismatches are reported pool by pool (full, then swa), each in the order of the compared slots."""
        led = self._w_st.ledger
        if every_request:
            slots = led.live_slots()
        else:
            dirty = led.dirty
            if not dirty:
                return
            slots = np.fromiter(dirty, np.int64, len(dirty))
            live = led.live[slots]
            if led.cache >= 0:
                live &= slots != led.cache  # the prefix cache's slot has no ledger row to compare
            slots = slots[live]
        led.dirty.clear()
        if not slots.size:
            return
        ps, shift = self._w_ps, self._w_shift
        # Shifts where the page size is a power of two (they floor as // does, for a third of the cost).
        allocated = led.allocated[slots] + (ps - 1)
        want_full = allocated >> shift if shift is not None else allocated // ps
        # The request's own pages are those of [cache_protected_len, kv_allocated_len): the protected prefix (whole
        # pages) is the prefix cache's, for its SWA KV too.
        protected = led.protected[slots]
        pages_protected = protected >> shift if shift is not None else protected // ps
        checks = [("full", want_full - pages_protected)]
        if "swa" in led.owned or self._w_st.swa_frees == "pool":
            evicted = np.maximum(led.evicted[slots], protected)
            want_swa = want_full - (evicted >> shift if shift is not None else evicted // ps)
            # The all-SWA allocator's one pool is its SWA pool (tracked as "full"): evicted pages leave it.
            checks = [("full", want_swa)] if "swa" not in led.owned else [*checks, ("swa", want_swa)]
        for name, want in checks:
            have = led.owned[name][slots]
            # The usual boundary: equal int64 arrays, one memcmp (np.flatnonzero is a Python-level wrapper: only
            # on a mismatch).
            if have.tobytes() == want.tobytes():
                continue
            for i in np.flatnonzero(have != want):
                self._ledger_mismatch(op, name, int(slots[i]), int(want[i]), int(have[i]))

    def _ledger_mismatch(self, op: str, name: str, s: int, want: int, have: int) -> None:
        """Report that request slot ``s`` owns ``have`` pages of pool ``name`` where its ledger means ``want``:
        once per distinct fact, and not for a request whose root cause (a rejected ledger write) was reported."""
        led = self._w_st.ledger
        if s in led.tainted:
            return
        key, fact = (name, s), (want, have)
        reported = self._w_mismatch_reported
        if reported.get(key) == fact:
            return
        reported[key] = fact
        protected = int(led.protected[s])
        self._violate(
            "ledger_matches_pages",
            f"request {led.rid_of(s)!r}: kv_allocated_len={int(led.allocated[s])}"
            + (f", cache_protected_len={protected}" if protected else "")
            + (f", swa_evicted_seqlen={int(led.evicted[s])}" if name == "swa" or self._w_st.swa_frees == "pool" else "")
            + f" means {want} {name} pages, it owns {have}",
            slot=s,
            op=op,
            pool=name,
        )

    def _sweep_cache(self, cached) -> None:
        """``check_consistency``'s comparison of the full pool's cache-owned pages with the cache's own."""
        if not isinstance(cached, torch.Tensor) or cached.dim() != 1:
            raise ArgumentTypeError("cached", f"expected a 1-D index tensor, got {type(cached).__name__}")
        st = self._w_st
        led = st.ledger
        shadow = st.full.shadow
        owner = shadow.owner
        held = cached.detach().to("cpu").numpy().astype(np.int64, copy=False) // st.ps
        held = sorted_unique(held[(held > 0) & (held < owner.size)])
        cache = led.cache
        ours = np.flatnonzero(owner == cache) if cache >= 0 else np.zeros(0, np.int64)
        lost = np.setdiff1d(ours, held, assume_unique=True)
        if lost.size and ("cache-lost", tuple(lost[:16].tolist())) not in shadow.reported:
            shadow.reported.add(("cache-lost", tuple(lost[:16].tolist())))
            self._violate(
                "pool_conservation",
                f"sweep: full pages {pages_list(lost)} were handed to the prefix cache, which holds them no more "
                "and never freed them: neither free nor owned",
                op="sweep",
                pool="full",
            )
        foreign = held[owner[held] != cache] if cache >= 0 else held
        if foreign.size and ("cache-foreign", tuple(foreign[:16].tolist())) not in shadow.reported:
            shadow.reported.add(("cache-foreign", tuple(foreign[:16].tolist())))
            first = int(owner[foreign[0]])
            what = (
                f"owned by request {led.rid_of(first)!r}"
                if first >= 0
                else "free"
                if first <= FREE
                else "handed out to no known request"
            )
            self._violate(
                "pool_conservation",
                f"sweep: the prefix cache holds full pages {pages_list(foreign)} that were never handed to it "
                f"(page {int(foreign[0])} is {what})",
                slot=first if first >= 0 else -1,
                op="sweep",
                pool="full",
            )

    def _sweep_unreleased(self) -> None:
        """``check_consistency(idle=True)``: the requests still known that own pages were never released."""
        st = self._w_st
        led = st.ledger
        for s in led.live_slots().tolist():
            held = {n: int(a[s]) for n, a in led.owned.items() if a[s] > 0 and n in st.pools}
            if not held or ("unreleased", s) in st.full.shadow.reported:
                continue
            st.full.shadow.reported.add(("unreleased", s))
            detail = "; ".join(f"{n}: {pages_list(np.flatnonzero(st.pools[n].shadow.owner == s))}" for n in held)
            self._violate(
                "request_leak",
                f"the engine is idle, yet request {led.rid_of(s)!r} still owns {sum(held.values())} pages "
                f"({detail}): it was never released",
                slot=s,
                op="sweep",
                pool=next(iter(held)),
            )

    def _sweep_leaks(self) -> None:
        led = self._w_st.ledger
        for pool in self._w_st.pools.values():
            owners = pool.shadow.owner
            used = np.unique(owners[owners >= 0])
            dead = used[~led.live[used]]
            for s in dead:
                s = int(s)
                key = ("leak", pool.name, s)
                if key in pool.shadow.reported or led.leaked[s]:
                    continue
                pool.shadow.reported.add(key)
                pages = np.flatnonzero(owners == s)
                self._violate(
                    "request_leak",
                    f"{pool.name} pages {pages_list(pages)} are owned by request {led.rid_of(s)!r} (slot {s}), "
                    f"released at step {led.released_step.item(s)} without freeing them",
                    slot=s,
                    op="sweep",
                    pool=pool.name,
                )

    def _sweep_mapping(self) -> None:
        mapping = self._w_inner.full_to_swa_index_mapping[:-1].detach().to("cpu").numpy()
        ps = self._w_ps
        full, swa = self._w_st.full.shadow, self._w_st.swa.shadow
        mapped = np.flatnonzero(mapping > 0)
        if not mapped.size:
            return
        swa_pages = mapping[mapped] // ps
        in_range = swa_pages < swa.owner.size
        swa_owner = np.full(swa_pages.shape, -100, np.int64)
        swa_owner[in_range] = swa.owner[swa_pages[in_range]]
        full_owner = full.owner[np.minimum(mapped // ps, full.owner.size - 1)]
        dead_peer = swa_owner < -1
        mismatch = (swa_owner >= 0) & (full_owner >= 0) & (swa_owner != full_owner)
        for mask, what in (
            (dead_peer, "point at SWA pages that are not in use"),
            (mismatch, "point at SWA pages owned by another request"),
        ):
            pages = np.unique(mapped[mask] // ps)
            key = ("map", what, tuple(pages[:16].tolist()))
            if pages.size and key not in swa.reported:
                swa.reported.add(key)
                self._violate(
                    "swa_mapping_inconsistent",
                    f"sweep: full pages {pages[:8].tolist()} ({pages.size}) {what}",
                    op="sweep",
                    pool="swa",
                )
