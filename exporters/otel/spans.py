"""Events to spans: the per-request records and the sink's handlers (``SpanSink``, mixed into ``OtelExporter``).

Contracts:
- A request's span is an SDK span from ``tracer.start_span`` at the first event naming the request; the SDK's
  sampler decides there. A dropped span (``is_recording()`` False) keeps only its record's counters: no event
  attributes are built for it. Everything runs under the exporter's lock, on the engine thread, in memory.
- A span's totals (``kv.allocated_len``, ``kv.committed_len``, ``kv.swa_evicted_seqlen``, ``kv.decode_steps``,
  ``kv.pages.*``) come from ``RequestReleased``, the core's per-request record. ``_Req`` only keeps the ledger's
  current lengths (frees and checked writes included, decodes not read), which the next non-decode allocation's
  per-request share (``kv.n_slots`` of its event) is measured from. When the shares miss the call's total (a
  cached prefix, or a request that decoded since its last allocation or free) a batched call's events carry the
  batch's figures (``kv.batch_n_slots``/``kv.batch_n_pages``) instead.
- Decodes are not read one by one: a decode's ``LedgerUpdate`` costs one comparison. A request first heard of at
  its release (attached mid-run, only decoded since) gets its span there.
- A span keeps at most ``max_events`` events: the first ``max_events - 1`` and ``kv.release``; the rest are
  counted in ``kv.events_dropped`` (plus any the SDK itself evicted, read from the span's ``dropped_events``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from instrumented_alloc import events as ev

_logger = logging.getLogger("exporters.otel")

SPAN_REQUEST = "kv.request"
SPAN_VIOLATION = "kv.violation"
EV_PREFILL = "kv.prefill"
EV_PREALLOC = "kv.prealloc"
EV_SWA_EVICT = "kv.swa_evict"
EV_RELEASE = "kv.release"
EV_VIOLATION = "kv.violation"

PREFILL_OPS = frozenset({"alloc_extend", "alloc"})
PREALLOC_OPS = frozenset({"alloc_extend_swa_tail", "alloc_logical_only"})
DECODE_OPS = frozenset({"alloc_decode"})
_ALLOC_OPS = PREFILL_OPS | PREALLOC_OPS | DECODE_OPS
# The ledger fields whose checked writes name a request (opening its span), and the current length each moves
# (what the next allocation is measured from; None: none).
_LEDGER_FIELDS = {"kv_allocated_len": "cur_allocated", "kv_committed_len": "cur_committed", "swa_evicted_seqlen": None}
# Ended requests remembered so that a later violation (a sweep's leak) lands in the request's trace.
_RECENT_ENDED = 4096
_W3C = TraceContextTextMapPropagator()
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def attr_value(rid):
    """A request id as an attribute value: str, float and an int within int64 (OTLP's int_value) as they are;
    anything else (a larger int, such as a UUID's) as its str."""
    if isinstance(rid, (str, float)) or (
        isinstance(rid, int) and not isinstance(rid, bool) and _INT64_MIN <= rid <= _INT64_MAX
    ):
        return rid
    return str(rid)


def put_recent(recent: OrderedDict, key, value, limit: int) -> bool:
    """``recent[key] = value`` as its newest entry, the oldest out past ``limit``. True when one went out."""
    recent[key] = value
    recent.move_to_end(key)
    if len(recent) > limit:
        recent.popitem(last=False)
        return True
    return False


def parent_context(parent) -> SpanContext | None:
    """``OtelExporter.set_parent``'s ``parent`` as a valid ``SpanContext``, or None."""
    if parent is None:
        return None
    if isinstance(parent, SpanContext):
        ctx = parent
    elif isinstance(parent, trace.Span):
        ctx = parent.get_span_context()
    elif isinstance(parent, Context):
        ctx = trace.get_current_span(parent).get_span_context()
    elif isinstance(parent, Mapping):
        ctx = trace.get_current_span(_W3C.extract(parent)).get_span_context()
    else:
        raise TypeError(
            "set_parent: expected a SpanContext, a Span, a Context or a W3C trace-context carrier (a mapping with "
            f"'traceparent'), got {type(parent).__name__}"
        )
    return ctx if ctx is not None and ctx.is_valid else None


def _context_of(parent: SpanContext | None) -> Context:
    # A root span unless the engine named its own span of the request: the engine's current context (whatever
    # runs at the allocator call) is no parent of a request's KV.
    return Context() if parent is None else trace.set_span_in_context(NonRecordingSpan(parent), Context())


class _Req:
    """An open request: its SDK span, the ledger's current lengths and the span's counters."""

    __slots__ = ("cur_allocated", "cur_committed", "dropped", "n_events", "parent", "sampled", "span", "violations")

    def __init__(self, span, parent: SpanContext | None = None):
        self.span = span
        self.sampled = span.is_recording()  # False: the sampler dropped it, no event attributes are built
        self.parent = parent  # the engine's span of the request (set_parent), or None
        self.cur_allocated = self.cur_committed = 0
        self.n_events = self.dropped = self.violations = 0

    def context(self) -> SpanContext:
        return self.span.get_span_context()

    def finish(self, record: tuple | None, held: int | None = None, peak: int | None = None, *, at_shutdown=False):
        """Set the final attributes and end the span. ``record``: ``(allocated, committed, evicted, decode_steps)``
        (None: unknown). Returns the events the SDK itself evicted (its limit was below our bound: a provider
        passed in), already added to ``kv.events_dropped``."""
        span = self.span
        if at_shutdown:
            span.set_attribute("kv.open_at_shutdown", True)
        evicted = getattr(span, "dropped_events", 0) or 0
        attrs = {}
        if record is not None:
            attrs["kv.allocated_len"], attrs["kv.committed_len"], attrs["kv.swa_evicted_seqlen"] = record[:3]
        attrs["kv.violations"] = self.violations
        if record is not None:
            attrs["kv.decode_steps"] = record[3]
        attrs["kv.events_dropped"] = self.dropped + evicted
        if peak is not None:
            attrs["kv.pages.peak"] = peak
        if held is not None:
            attrs["kv.pages.held_at_release"] = held
        span.set_attributes(attrs)
        span.end()
        return evicted


class SpanSink:
    """The sink half of ``OtelExporter``: ``__call__(batch)`` and one handler per event type it reads. The state it
    uses is set up by ``OtelExporter.__init__`` (``_open``, ``_ended``, ``_parents``, ``_pending``, ...)."""

    def __call__(self, batch) -> bool:
        with self._lock:
            if self._closed:
                return False
            later = self._later  # empty between batches
            try:
                handlers = self._handlers
                for e in batch:
                    h = handlers.get(type(e))
                    if h is not None:
                        h(e, later)
                if later:
                    limit = self._max_events - 1  # the last place is kept for kv.release
                    for r, name, attrs in later:
                        if r.n_events < limit:
                            r.n_events += 1
                            r.span.add_event(name, attrs)
                        else:
                            r.dropped += 1
                    later.clear()
                return True
            except Exception as exc:
                later.clear()  # the refused batch's events are not added
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                return False
            finally:
                if self._pending:
                    self._pending.clear()

    # -- spans ------------------------------------------------------------------------------------------------
    def _start(self, rid) -> _Req:
        # The engine's span of this request, if it named one (set_parent; or, for a later span of the same request,
        # a retracted request's re-prefill, the one its previous span had): the span is its child, in its trace.
        parent = self._parents.pop(rid, None) if self._parents else None
        if self._ended_parents:
            earlier = self._ended_parents.pop(rid, None)
            if parent is None:
                parent = earlier
        span = self._tracer.start_span(
            SPAN_REQUEST,
            context=_context_of(parent),
            kind=SpanKind.INTERNAL,
            attributes={"kv.request.id": self._id_attr(rid), "kv.page_size": self._ps},
        )
        r = _Req(span, parent)
        if self._seed:  # attached mid-run: the lengths the request already had
            first = self._seed.pop(rid, None)
            if first is not None:
                r.cur_allocated, r.cur_committed = first
        self._open[rid] = r
        self._ended.pop(rid, None)
        return r

    def _end(self, r: _Req, record, held=None, peak=None, *, at_shutdown: bool = False) -> None:
        if r.finish(record, held, peak, at_shutdown=at_shutdown) and not self._warned_evictions:
            self._warned_evictions = True
            _logger.warning(
                "the tracer provider's span event limit is below max_events_per_span (%d): the SDK evicted a "
                "kv.request span's oldest events; they are counted in kv.events_dropped",
                self._max_events,
            )

    # -- event handlers ---------------------------------------------------------------------------------------
    def _on_ledger_update(self, e: ev.LedgerUpdate, later: list) -> None:
        op = e.op
        if op in DECODE_OPS:
            return  # the per-token call: its count comes with RequestReleased
        get = self._open.get
        if op not in _ALLOC_OPS:
            # A free: a request torn down before its release keeps its record (RequestReleased says so); only the
            # current lengths move (a retracted request's next prefill is measured from them).
            for rid, a, c in zip(e.rids, e.allocated.tolist(), e.committed.tolist()):
                r = get(rid)
                if r is not None:
                    r.cur_allocated, r.cur_committed = a, c
            return
        pending = self._pending
        for rid, a, c in zip(e.rids, e.allocated.tolist(), e.committed.tolist()):
            if rid is None:
                continue
            r = get(rid)
            if r is None:
                r = self._start(rid)
            # rid -> (committed delta, allocated delta, committed before, record): this call's shares.
            pending[rid] = (c - r.cur_committed, a - r.cur_allocated, r.cur_committed, r)
            r.cur_allocated, r.cur_committed = a, c

    def _on_alloc(self, e: ev.Alloc, later: list) -> None:
        rids = e.rids
        if not rids:
            return  # not bound to requests: nothing to attribute
        op = e.op
        if op in DECODE_OPS:
            return  # built for another sink: a decode makes no span event
        if e.pool != "full":
            if op == "alloc_extend_swa_tail":  # the SWA side of a prealloc: its tail length
                reqs = {id(self._open.get(rid)) for rid in rids}
                for r, name, attrs in later:
                    if name == EV_PREALLOC and id(r) in reqs:
                        attrs["kv.swa_tail_len"] = e.n_slots
            return
        pending = self._pending
        deltas = [pending.get(rid) for rid in rids]
        # Per-request shares from this call's ledger update, when they account for the whole allocation (a
        # cached prefix of a new request would make them overcount).
        exact = None not in deltas and sum(d[0] for d in deltas) == e.n_slots
        single = len(rids) == 1
        for rid, delta in zip(rids, deltas):
            if rid is None:
                continue
            # The record this call's ledger update found or opened (both events come from the one call).
            r = delta[3] if delta is not None else (self._open.get(rid) or self._start(rid))
            if op == "alloc" and exact and delta[0] == 1 and delta[2] > 0:
                continue  # SGLang's decode at page size 1: counted in RequestReleased.decode_steps
            if not r.sampled:
                continue  # no span: no event to build
            attrs = {"kv.op": op, "kv.step": e.step}
            if exact:
                attrs["kv.n_slots"] = delta[0]
                attrs["kv.n_pages"] = delta[1] // self._ps
            elif single:
                attrs["kv.n_slots"] = e.n_slots
                attrs["kv.n_pages"] = e.n_pages
            if not single:
                attrs["kv.batch_size"] = len(rids)
                if not exact:
                    attrs["kv.batch_n_slots"] = e.n_slots
                    attrs["kv.batch_n_pages"] = e.n_pages
            later.append((r, EV_PREALLOC if op in PREALLOC_OPS else EV_PREFILL, attrs))

    def _on_ledger_write(self, e: ev.LedgerWrite, later: list) -> None:
        if e.field not in _LEDGER_FIELDS or e.rid is None:
            return
        r = self._open.get(e.rid)
        if r is None:
            r = self._start(e.rid)
        column = _LEDGER_FIELDS[e.field]
        if column is not None:
            setattr(r, column, e.new)

    def _on_swa_evict(self, e: ev.SwaEvict, later: list) -> None:
        if e.rid is None:
            return
        r = self._open.get(e.rid)
        if r is None:
            r = self._start(e.rid)
        if not r.sampled:
            return
        attrs = {
            "kv.swa_evicted_seqlen.old": e.old,
            "kv.swa_evicted_seqlen.new": e.new,
            "kv.n_pages": e.n_pages,
            "kv.step": e.step,
        }
        later.append((r, EV_SWA_EVICT, attrs))

    def _on_released(self, e: ev.RequestReleased, later: list) -> None:
        r = self._open.pop(e.rid, None)
        if r is None:
            if not (e.allocated or e.committed or e.decode_steps or e.pages_peak or e.pages_held):
                if self._parents:
                    self._parents.pop(e.rid, None)  # a parent set for a request that never allocated
                return  # nothing was allocated for it: no span
            # First heard of at its release (attached mid-run and only decoded since): its span is opened here.
            r = self._start(e.rid)
            del self._open[e.rid]
        if self._seed:
            self._seed.pop(e.rid, None)
        if r.parent is not None:  # a later span of this request (a re-prefill after a retraction) joins that trace
            put_recent(self._ended_parents, e.rid, r.parent, _RECENT_ENDED)
        if r.sampled:
            if later:  # this batch's earlier events first, then the release in its reserved place
                limit = self._max_events - 1
                for item in later:
                    if item[0] is r:
                        if r.n_events < limit:
                            r.n_events += 1
                            r.span.add_event(item[1], item[2])
                        else:
                            r.dropped += 1
                later[:] = [item for item in later if item[0] is not r]
            held, peak = e.pages_held, e.pages_peak
            if r.n_events < self._max_events:  # the place kept for kv.release
                r.n_events += 1
                r.span.add_event(EV_RELEASE, {"kv.pages_held": held, "kv.pages_peak": peak, "kv.step": e.step})
            else:
                r.dropped += 1
            self._end(r, (e.allocated, e.committed, e.evicted, e.decode_steps), held, peak)
        put_recent(self._ended, e.rid, r.context(), _RECENT_ENDED)  # its context, for later violations in its trace

    def _on_violation(self, e: ev.ViolationEvent, later: list) -> None:
        v = e.violation
        rid = v.rid
        message = v.message if self._hasher is None else self._hasher.message(v.message, rid)
        attrs = {
            "kv.violation.invariant": v.invariant,
            "kv.violation.message": message,
            "kv.violation.severity": v.severity,
            "kv.violation.op": v.op,
            "kv.step": e.step,
        }
        if v.pool is not None:
            attrs["kv.violation.pool"] = v.pool
        r = self._open.get(rid) if rid is not None else None
        if r is None and rid is not None and rid in self._ledger:
            r = self._start(rid)
        if r is not None:
            r.violations += 1
            if r.violations == 1:
                r.span.set_status(Status(StatusCode.ERROR, f"{v.invariant}: {message}"))
            if r.sampled:
                later.append((r, EV_VIOLATION, attrs))
            return
        ctx = None
        if rid is not None:
            attrs["kv.request.id"] = self._id_attr(rid)
            ctx = self._ended.get(rid)
        span = self._tracer.start_span(
            SPAN_VIOLATION, context=_context_of(ctx), kind=SpanKind.INTERNAL, attributes=attrs
        )
        span.add_event(EV_VIOLATION, attrs)
        span.set_status(Status(StatusCode.ERROR, f"{v.invariant}: {message}"))
        span.end()
