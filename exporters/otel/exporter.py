"""``OtelExporter``: configuration, lifetime and the public API of the OpenTelemetry exporter.

Contracts:
- Constructed on an ``InstrumentedAllocator``, it subscribes as the sink ``"otel"`` (see ``spans.SpanSink``) and
  sets ``alloc.trace_id_for``; ``shutdown`` undoes both. The sink never raises into the wrapper: a batch it fails
  on is refused (the bus counts it in ``dropped["otel"]``; ``errors`` here).
- Its own provider (no ``tracer_provider=``): the SDK's ``TracerProvider`` configured by the ``OTEL_*`` variables
  (read here, never at import), one ``CountingBatchSpanProcessor`` per exporter; its losses are registered with
  ``alloc.bus.add_loss_counter("otel", ...)``. A provider passed in is used as given.
- Tracing off (no span can be produced: ``OTEL_SDK_DISABLED``, ``OTEL_TRACES_EXPORTER=none``, a sampler of ours
  that drops everything): it subscribes to nothing and ``trace_id_for`` is not set.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider, sampling
from opentelemetry.sdk.trace.export import SpanExporter

from exporters.otel.export import (
    CountingBatchSpanProcessor,
    CountingProcessors,
    CountingSpanExporter,
    EventsDroppedSpanExporter,
    env_span_exporters,
    run_bounded,
)
from exporters.otel.sampling import samples_nothing, trace_hex
from exporters.otel.spans import SpanSink, attr_value, parent_context, put_recent
from instrumented_alloc import events as ev
from instrumented_alloc.redact import as_hasher

DEFAULT_SERVICE_NAME = "instrumented-alloc"
TRACER_NAME = "instrumented_alloc.exporters.otel"
_EVENT_LIMIT_ENV = "OTEL_SPAN_EVENT_COUNT_LIMIT"
# Parents named by set_parent that wait for their request's first allocation, at most.
_MAX_PARENTS = 65536


def _no_loss() -> int:
    return 0


class OtelExporter(SpanSink):
    """Subscribe to ``alloc``'s events and trace its requests (the span catalog: ``exporters.otel``)."""

    name = "otel"  # the bus counts what this sink refused under this name
    # What the spans read (typed subscription: the wrapper builds nothing else for us). Decodes' updates come
    # too and cost one comparison each; a span's totals come with RequestReleased.
    event_types = frozenset(
        {ev.Alloc, ev.LedgerUpdate, ev.LedgerWrite, ev.SwaEvict, ev.RequestReleased, ev.ViolationEvent}
    )

    def __init__(
        self,
        alloc,
        *,
        tracer_provider=None,
        max_events_per_span: int = 64,
        endpoint: str | None = None,
        span_exporter: SpanExporter | None = None,
        hash_request_ids=None,
        counting_exporter: CountingSpanExporter | CountingBatchSpanProcessor | None = None,
        sampler: sampling.Sampler | None = None,
    ):
        if isinstance(max_events_per_span, bool) or not isinstance(max_events_per_span, int):
            raise TypeError(f"max_events_per_span: expected an int, got {type(max_events_per_span).__name__}")
        if max_events_per_span < 1:
            raise ValueError(f"max_events_per_span: expected >= 1, got {max_events_per_span}")
        if tracer_provider is not None and endpoint is not None:
            raise ValueError("endpoint= configures the exporter's own provider; it cannot apply to a tracer_provider")
        if span_exporter is not None and (tracer_provider is not None or endpoint is not None):
            raise ValueError("span_exporter= is for the own provider: not with tracer_provider= or endpoint=")
        if span_exporter is not None and not callable(getattr(span_exporter, "export", None)):
            raise TypeError(f"span_exporter: expected a SpanExporter, got {type(span_exporter).__name__}")
        if counting_exporter is not None and not isinstance(
            counting_exporter, (CountingSpanExporter, CountingBatchSpanProcessor)
        ):
            raise TypeError(
                "counting_exporter: expected a CountingSpanExporter or a CountingBatchSpanProcessor, got "
                f"{type(counting_exporter).__name__}"
            )
        if counting_exporter is not None and tracer_provider is None:
            raise ValueError("counting_exporter= is for a tracer_provider passed in (our own provider counts already)")
        if sampler is not None and not isinstance(sampler, sampling.Sampler):
            raise TypeError(f"sampler: expected an OpenTelemetry SDK Sampler, got {type(sampler).__name__}")
        if sampler is not None and tracer_provider is not None:
            raise ValueError("sampler= configures the exporter's own provider; a tracer_provider has its own sampler")
        self._hasher = as_hasher(hash_request_ids)
        self._id_attr = attr_value if self._hasher is None else self._hasher
        self._alloc = alloc
        self._ledger = alloc.ledger
        self._ps = int(alloc.page_size)
        self._max_events = max_events_per_span
        self._owns_provider = tracer_provider is None
        self._span_exporters: list = []  # our own provider's, each a CountingSpanExporter
        self._counting = counting_exporter
        if tracer_provider is None:
            tracer_provider = self._build_provider(endpoint, span_exporter, sampler)
        self._provider = tracer_provider
        self._tracer = tracer_provider.get_tracer(TRACER_NAME)
        self._warned_evictions = False  # the SDK evicted events of ours (a provider's lower limit): logged once
        # Tracing that can produce no span (the SDK disabled: a no-op tracer; our provider's sampler dropping every
        # span of ours): the exporter then subscribes to nothing and costs the engine nothing.
        self._off = (
            isinstance(self._tracer, trace.NoOpTracer)
            or (self._owns_provider and samples_nothing(tracer_provider.sampler))
            or (self._owns_provider and self._counting is None)  # OTEL_TRACES_EXPORTER=none: nothing to export to
        )
        self._lock = threading.RLock()
        self._open: dict = {}
        self._ended: OrderedDict = OrderedDict()  # rid -> SpanContext of its ended span
        # rid -> the engine's SpanContext of the request (set_parent), until its span starts.
        self._parents: OrderedDict = OrderedDict()
        # rid -> the engine's SpanContext of its ended span: the parent of the request's next span, if any.
        self._ended_parents: OrderedDict = OrderedDict()
        self.parents_dropped = 0
        # rid -> (committed delta, allocated delta, committed before, record), this batch
        self._pending: dict = {}
        # This batch's span events, added once its events are all handled (a prealloc's SWA tail length comes in
        # the batch's next Alloc): (record, name, attributes).
        self._later: list = []
        self._closed = False
        self.errors = 0
        self.last_error: str | None = None
        self._handlers = {
            ev.LedgerUpdate: self._on_ledger_update,
            ev.Alloc: self._on_alloc,
            ev.LedgerWrite: self._on_ledger_write,
            ev.SwaEvict: self._on_swa_evict,
            ev.RequestReleased: self._on_released,
            ev.ViolationEvent: self._on_violation,
        }
        # Attached mid-run: the lengths of the requests that already hold KV, what their next allocation's share
        # is measured from (a page-size-1 decode is told from a prefill by it); taken once, here.
        self._seed: dict = {}
        self._prev_hook = None
        if self._off:
            self._handlers = {}  # a batch handed over directly is read and produces nothing
        else:
            led = getattr(alloc, "ledger", None)
            if led is not None:
                with contextlib.suppress(Exception):  # a ledger we cannot read: measured from 0, as before
                    for rid in led:
                        info = led[rid]
                        if info.kv_allocated_len or info.kv_committed_len:
                            self._seed[rid] = (int(info.kv_allocated_len), int(info.kv_committed_len))
            # The hook the wrapper asks for a violation's trace id: ours, then (for a request we have no span of)
            # the one it had before, so that exporters attached one after another each keep theirs.
            self._prev_hook = getattr(alloc, "trace_id_for", None)
            alloc.trace_id_for = self._trace_hook
            alloc.subscribe(self)
        if self._counting is not None:
            counting = self._counting  # the total outlives this exporter: a counter never goes back
            # Keyed by the CountingSpanExporter whose failed exports it counts: exporters attached to this allocator
            # with the same counting processor (or its exporter), one after the other or side by side, count those
            # losses once (the processor's total, which includes its exporter's).
            key = counting.counting if isinstance(counting, CountingBatchSpanProcessor) else counting
            alloc.bus.add_loss_counter(self.name, lambda: counting.dropped, key=key)
        elif self._owns_provider:  # OTEL_TRACES_EXPORTER=none: nothing is exported, so nothing is lost (0, listed)
            alloc.bus.add_loss_counter(self.name, _no_loss, key=_no_loss)

    def _build_provider(self, endpoint: str | None, span_exporter: SpanExporter | None, sampler) -> TracerProvider:
        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        exporters = env_span_exporters(endpoint) if span_exporter is None else [span_exporter]
        # Each behind the dropped-events fix-up, then counted (a CountingSpanExporter passed in is used as given).
        self._span_exporters = [
            e if isinstance(e, CountingSpanExporter) else CountingSpanExporter(EventsDroppedSpanExporter(e))
            for e in exporters
        ]
        # One batch processor per exporter, as the SDK's configuration builds them (OTEL_TRACES_EXPORTER=a,b);
        # none for OTEL_TRACES_EXPORTER=none (tracing is then off: nothing would be exported).
        processors = [CountingBatchSpanProcessor(e) for e in self._span_exporters]
        if len(processors) == 1:
            self._counting = processors[0]
        elif processors:
            self._counting = CountingProcessors(processors)
        limits = SpanLimits()
        if limits.max_events is not None and limits.max_events < self._max_events:
            if _EVENT_LIMIT_ENV in os.environ:
                # Set lower on purpose: it bounds our spans, by our policy (the first events and kv.release kept,
                # the others counted in kv.events_dropped and the span's dropped events), so the SDK trims nothing.
                self._max_events = limits.max_events
            else:  # the SDK's default (128) below max_events_per_span: raised to it
                limits = SpanLimits(max_events=self._max_events)
        # sampler None: the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (default parentbased_always_on).
        provider = TracerProvider(resource=resource, span_limits=limits, sampler=sampler)
        for processor in processors:
            provider.add_span_processor(processor)
        return provider

    # -- public -----------------------------------------------------------------------------------------------
    @property
    def tracer_provider(self):
        return self._provider

    @property
    def open_requests(self) -> int:
        return len(self._open)

    @property
    def spans_dropped(self) -> int:
        """Spans lost after they ended (see ``CountingBatchSpanProcessor``); 0 with a provider passed in and no
        ``counting_exporter``."""
        return 0 if self._counting is None else self._counting.dropped

    def set_parent(self, rid, parent) -> bool:
        """Make ``rid``'s ``kv.request`` span a child of the engine's own span of that request, in its trace.

        ``parent``: a ``SpanContext``, a ``Span``, a ``Context`` holding a span, or a W3C trace-context carrier (a
        mapping with a ``traceparent`` and maybe a ``tracestate`` entry: the headers SGLang's tokenizer propagates
        with a request, ``sglang.srt.observability.trace.extract_trace_headers``; parsed here by the W3C
        propagator, whatever the process's global propagator is). None forgets a parent set before.

        Call it before the request's first allocation (its span starts there). A later span of the same request
        id (a retracted request's re-prefill, after its release) stays a child of the same parent unless
        ``set_parent`` names another (or None) before it starts. The span then takes the parent's
        trace id and trace state, and the sampler decides as the SDK's does for a child: a parent-based sampler
        (the default) follows the engine's decision, remote or local, so a request the engine does not trace
        builds no span here either. ``trace_id_for`` (and the violations' trace ids, the exemplars) then name the
        engine's trace. Returns True when a parent was set; False when ``parent`` holds no valid span context (no
        or a malformed ``traceparent``: the span stays a root, as the SDK treats an invalid parent) or tracing is
        off. Raises ``TypeError`` for any other type of ``parent`` and ``ValueError`` when ``rid`` already has its
        span (too late to move it into another trace). A parent waits for the request's first allocation: an
        engine that drops a request before that forgets it with ``set_parent(rid, None)``. At most
        ``_MAX_PARENTS`` wait; beyond, the oldest is forgotten (counted in ``parents_dropped``). Thread-safe (under
        the exporter's lock); never waits on anything else."""
        ctx = parent_context(parent)
        if self._off:
            return False
        with self._lock:
            if rid in self._open:
                raise ValueError(
                    f"set_parent: request {rid!r} already has its kv.request span (it starts at the request's first "
                    "allocation): set its parent before that"
                )
            parents = self._parents
            if ctx is None:
                parents.pop(rid, None)
                self._ended_parents.pop(rid, None)
                return False
            if put_recent(parents, rid, ctx, _MAX_PARENTS):
                self.parents_dropped += 1
            return True

    def trace_id_for(self, rid) -> str | None:
        """The trace id (32 hex digits) of ``rid``'s span; opens it when the request is live and has none yet
        (the violation is raised by the request's first call, before this sink saw its allocation). None for a
        span the sampler dropped, and always when tracing is off (no span can be produced)."""
        if self._off:
            return None
        with self._lock:
            r = self._open.get(rid)
            if r is not None:
                return trace_hex(r.context())
            if self._closed:
                return None
            if rid in self._ledger:
                return trace_hex(self._start(rid).context())
            return trace_hex(self._ended.get(rid))

    def _trace_hook(self, rid) -> str | None:
        """``alloc.trace_id_for`` while this exporter is attached: ``trace_id_for``, else the hook it replaced
        (another exporter's, attached before it), which shutdown puts back."""
        tid = self.trace_id_for(rid)
        if tid is None and self._prev_hook is not None:
            with contextlib.suppress(Exception):  # a foreign hook must not break the violation being reported
                return self._prev_hook(rid)
        return tid

    def _ledger_record(self, rid) -> tuple | None:
        """``(allocated, committed, evicted, decode_steps)`` of a live request, as its release would report them;
        None when the ledger no longer knows it."""
        led = self._ledger
        with contextlib.suppress(Exception):  # read at shutdown: a request gone meanwhile has no record
            slot = led[rid].slot
            return (*led.record(slot), led.decode_steps.item(slot))
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export the ended spans now, waiting at most ``timeout_millis``. Blocks: never call it on the engine
        thread's hot path. False when it timed out or the provider reported a failure."""
        flush = getattr(self._provider, "force_flush", None)
        if flush is None:
            return True
        done, ok = run_bounded(lambda: flush(timeout_millis), timeout_millis / 1000, "force_flush")
        return bool(done and ok is not False)

    def shutdown(self, timeout_millis: int = 30000) -> bool:
        """Stop tracing: unsubscribe, end the spans of requests still open, export what is left (waiting at most
        ``timeout_millis``; what could not be exported by then is dropped) and shut our own provider down (a
        provider passed in is only flushed). Returns whether that finished in time. Idempotent."""
        alloc = self._alloc
        # Outside our lock: unsubscribe takes the wrapper's lock, whose holder may be waiting in our sink.
        if self in alloc.bus.sinks:
            alloc.unsubscribe(self)
        if alloc.trace_id_for == self._trace_hook:
            alloc.trace_id_for = self._prev_hook  # the exporter attached before us, if any, keeps its trace ids
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            still_open, self._open = self._open, {}
            for rid, r in still_open.items():
                if r.sampled:
                    self._end(r, self._ledger_record(rid), at_shutdown=True)
        timeout_s = timeout_millis / 1000
        if not self._owns_provider:
            return self.force_flush(timeout_millis)
        done, _ = run_bounded(self._provider.shutdown, timeout_s, "shutdown")
        if not done:
            # Abandon what is still queued: the worker's further exports fail at once instead of retrying. Not
            # waited for: an exporter whose shutdown waits for its hanging export must not hold us past the time.
            for exporter in self._span_exporters:
                run_bounded(exporter.shutdown, 0.0, "span exporter shutdown")
        return done
