"""Building and delivering events, and reporting violations.

Contract (``_Events``, a mixin of ``InstrumentedAllocator``): events are built only for kinds some sink reads
(``want_*`` on the per-call state, refreshed by ``_sync_deltas`` whenever the sinks change) and delivered once
per call (``_finish``, or ``_deliver`` on an error path), page deltas first; then raise mode raises the first
violation. ``_violate`` records a ``Violation`` (the bounded ``violations`` deque and ``violation_counts``) and
taints the request's ledger comparison for page-level faults."""

from __future__ import annotations

import numpy as np

from instrumented_alloc import events as ev
from instrumented_alloc.invariants import SEVERITY, InvariantViolation, Violation
from instrumented_alloc.stepstats import StepAccumulator
from instrumented_alloc.wrapper.constants import _B_ALLOC, _B_LEDGER, _B_PAGES, _B_STATS, _TAINTING, _make_event


class _Events:
    """Events and violations (see the module docstring)."""

    def subscribe(self, sink) -> None:
        with self._w_lock:
            self.bus.subscribe(sink)
            self._sync_deltas()

    def unsubscribe(self, sink) -> None:
        with self._w_lock:
            self.bus.unsubscribe(sink)
            self._sync_deltas()

    def _set_counts(self) -> None:
        # What step() reads for the count checks, in one attribute: (count, shadow) of each pool, in pool order.
        st = self._w_st
        st.counts = tuple((p.count, p.shadow) for p in st.pools.values())

    def _sync_deltas(self) -> None:
        # Page deltas and ledger updates are built only while some sink reads them.
        want = self.bus.wants(ev.PageUpdate)
        for p in self._w_st.pools.values():
            if want and p.shadow.deltas is None:
                p.shadow.deltas = []
            elif not want:
                p.shadow.deltas = None
        st, wants = self._w_st, self.bus.wants
        st.want_ledger = wants(ev.LedgerUpdate)
        st.want_pages = want
        # The step's statistics are kept only while a sink names StepStats; kept across a change of sinks that
        # still reads them (what the step so far counted stays).
        if st.bus.wants_named(ev.StepStats):
            if st.stats is None:
                st.stats = StepAccumulator()
        else:
            st.stats = None
        counting = st.stats is not None
        # The per-call kinds are built only for a sink that reads them too (seq stays gap-free: it counts the
        # events built). Frees are timed only when their Free event is built or counted in the step's statistics.
        st.want_alloc = wants(ev.Alloc)
        st.note_alloc = st.want_alloc or counting
        # A decode is timed only for its Alloc events, a refusal's AllocFailed and the step's statistics.
        st.time_decode = st.note_alloc or wants(ev.AllocFailed)
        st.want_free = wants(ev.Free)
        st.time_free = st.want_free or counting
        st.want_released = wants(ev.RequestReleased)
        # The requests' records (what RequestReleased carries) are kept through their frees only while read.
        st.ledger.keep_records = st.want_released
        if not st.want_released:
            st.ledger.kept.clear()
        st.want_step = wants(ev.StepBoundary)
        st.want_write = wants(ev.LedgerWrite)
        st.want_evict = wants(ev.SwaEvict)
        st.note_evict = st.want_evict or counting

    # -- reporting ----------------------------------------------------------------------------------------
    def _report(self, bad, pool: str | None, op: str) -> None:
        for inv, msg, slot in bad:
            self._violate(inv, msg, slot=slot, op=op, pool=pool)

    def _violate(
        self, invariant: str, message: str, *, slot: int = -1, op: str = "", pool: str | None = None, rid=None
    ):
        """Record a violation. Its request id: the owner of ``slot`` when one is given, else ``rid`` (an id the
        message names that owns no slot). A message names a request id only as ``request {rid!r}`` or
        ``request id {rid!r}`` with ``rid`` the violation's own (what ``redact.RequestIdHasher`` replaces)."""
        rid = self._w_st.ledger.rid_of(slot) if slot is not None and slot >= 0 else rid
        if rid is not None and invariant in _TAINTING:
            # The request's pages and its ledger no longer agree for a reason already reported.
            self._w_st.ledger.tainted.add(slot)
        trace = None
        if self.trace_id_for is not None and rid is not None:
            try:
                trace = self.trace_id_for(rid)
            except Exception:
                trace = None
        v = Violation(
            invariant=invariant,
            message=message,
            pool=pool,
            rid=rid,
            step=self._w_st.step,
            op=op,
            ts=self._w_clock(),
            trace_id=trace,
            severity=SEVERITY.get(invariant, "error"),
        )
        self.violations.append(v)
        self.violation_counts[invariant] += 1
        if self.bus.wants(ev.ViolationEvent):
            self._emit(ev.ViolationEvent, violation=v)
        if self._w_raise:
            self._w_to_raise.append(v)
        return v

    def _emit(self, cls, **fields) -> None:
        st = self._w_st
        st.seq += 1
        st.events.append(_make_event(cls, st.seq, st.clock(), st.step, fields))

    def _emit_alloc(self, op: str, n_slots: int, n_pages: int, dt: float, pool: str = "full") -> None:
        st = self._w_st
        stats = st.stats
        if stats is not None and stats.alloc(op, pool, n_pages, dt):
            self._emit_stats()
        if st.want_alloc:
            bound = getattr(st.tls, "bound", None)
            st.seq = seq = st.seq + 1
            st.events.append(
                _B_ALLOC(seq, st.clock(), st.step, op, pool, n_slots, n_pages, bound[0] if bound else (), dt)
            )

    def _emit_stats(self, overhead: tuple = (), iteration_seconds: float = 0.0) -> None:
        """At a boundary: the step's statistics as a ``StepStats`` (while a sink reads them), handed over."""
        st = self._w_st
        stats = st.stats
        if stats is not None:
            st.seq = seq = st.seq + 1
            st.events.append(_B_STATS(seq, st.clock(), st.step, *stats.take(), overhead, iteration_seconds))

    def _emit_snapshots(self) -> None:
        led = self._w_st.ledger
        slots = led.live_slots()
        ledger_rows = tuple(
            (led.rid_of(int(s)), int(led.allocated[s]), int(led.committed[s]), int(led.evicted[s])) for s in slots
        )
        for p in self._w_st.pools.values():
            owner = p.shadow.owner
            used = np.unique(owner[owner >= 0])
            self._emit(
                ev.Snapshot,
                pool=p.name,
                page_size=p.page_size,
                num_pages=p.shadow.num_pages,
                owner=owner.astype("<i4", copy=False).tobytes(),
                rids=tuple((int(s), led.rid_of(int(s))) for s in used),
                ledger=ledger_rows,
            )

    def _flush_deltas(self) -> None:
        st = self._w_st
        if not st.want_pages:
            return
        for p in st.pools.values():
            shadow = p.shadow
            deltas = shadow.deltas
            if deltas:  # take_deltas, inlined: most calls have nothing to publish in some pool
                shadow.deltas = []
                clock, op, step, events, name = st.clock, st.op, st.step, st.events, p.name
                for pages, owners in deltas:
                    st.seq = seq = st.seq + 1
                    events.append(_B_PAGES(seq, clock(), step, op, name, pages, owners))

    def _emit_ledger(self, op: str, slots: np.ndarray, rids: tuple | None = None, *, private: bool = False) -> None:
        """A ``LedgerUpdate`` of ``slots`` (when some sink reads them). ``private``: the caller guarantees that
        nothing ever writes ``slots`` again (a fresh array no one else holds, or a read-only one whose memory no
        one writes), so the event may keep it as it is instead of a copy."""
        st = self._w_st
        if st.want_ledger and slots.size:
            led = st.ledger
            st.seq = seq = st.seq + 1
            st.events.append(
                _B_LEDGER(
                    seq,
                    st.clock(),
                    st.step,
                    op,
                    rids if rids is not None else tuple(led.rid_of(int(x)) for x in slots),
                    slots if private else slots.copy(),
                    # Gathers by an index array: already copies, owned by the event.
                    led.allocated[slots],
                    led.committed[slots],
                    led.evicted[slots],
                )
            )

    def _deliver(self) -> None:
        """Hand the call's events (page deltas first published as events when read) to the sinks, as one batch."""
        st = self._w_st
        if st.want_pages:
            self._flush_deltas()
        if st.events:
            batch, st.events = st.events, []
            cost = st.cost
            if cost.open:
                cost.stop_checks()
                st.bus.deliver(batch)
                cost.stop_exporters()
            else:
                st.bus.deliver(batch)

    def _finish(self) -> None:
        """End of a call: hand the events to the sinks, then (raise mode) raise the first violation."""
        # _deliver, inlined: every call that built an event ends here (one method call less per call).
        st = self._w_st
        if st.want_pages:
            self._flush_deltas()
        if st.events:
            batch, st.events = st.events, []
            cost = st.cost
            if cost.open:  # inside a charged call (subscribe() delivers outside one)
                cost.stop_checks()
                st.bus.deliver(batch)
                cost.stop_exporters()
            else:
                st.bus.deliver(batch)
        to_raise = st.to_raise
        if to_raise:
            first = to_raise[0]
            to_raise.clear()
            raise InvariantViolation(first)
