"""OpenTelemetry traces for an ``InstrumentedAllocator``: one ``kv.request`` span per request.

Usage::

    exporter = OtelExporter(alloc)            # OTLP/HTTP, configured by the standard OTEL_* variables
    exporter.set_parent(rid, headers)         # optional, before the request's first allocation: the engine's
                                              # span of it (W3C traceparent/tracestate, a Span or a Context)
    ...                                       # the engine runs; spans are exported in the background
    exporter.shutdown(timeout_millis=5000)    # ends still-open request spans, exports what it can in time

Span catalog (public)
- ``kv.request``: starts at the first event naming the request, ends at ``alloc.release_request(rid)``; a root
  span, or a child of the engine's span named by ``set_parent``. Attributes: ``kv.request.id``, ``kv.page_size``;
  at the end ``kv.allocated_len``, ``kv.committed_len``, ``kv.swa_evicted_seqlen`` (the request's KV record as
  allocations and checked writes left it; teardown frees do not zero it), ``kv.pages.peak`` (most full-pool
  pages held at once), ``kv.pages.held_at_release`` (> 0 is a leak), ``kv.violations``, ``kv.decode_steps``
  (decodes are counted, never one event per token), ``kv.events_dropped``; ``kv.open_at_shutdown`` for a span
  ended by ``shutdown()``. The first violation sets status ERROR.
- Span events (each with ``kv.step``): ``kv.prefill`` / ``kv.prealloc`` (``kv.op``, ``kv.n_slots``,
  ``kv.n_pages``; ``kv.batch_size`` and ``kv.batch_n_*`` for a batch; ``kv.swa_tail_len`` for an SWA tail),
  ``kv.swa_evict`` (``kv.swa_evicted_seqlen.old``/``.new``, ``kv.n_pages``), ``kv.release`` (``kv.pages_held``,
  ``kv.pages_peak``), ``kv.violation`` (``kv.violation.invariant``, ``.message``, ``.severity``, ``.op``, ``.pool``).
  At most ``max_events_per_span`` per span: the first ones and ``kv.release``; the rest counted in
  ``kv.events_dropped`` (our own provider's spans also say it as their OTLP ``dropped_events_count``).
- ``kv.violation`` span (status ERROR): a violation naming no request, or a request whose span already ended (a
  child of that span, in its trace).
- ``alloc.trace_id_for(rid)``: the trace id of the request's span (None when the sampler dropped it), which
  violations and Prometheus exemplars carry.

Sampling is the SDK's, at each span's start (``OTEL_TRACES_SAMPLER`` or ``sampler=``); a dropped request builds
no event attributes. Request ids can be pseudonymised (``hash_request_ids=``: ``h:`` + 16 hex digits). Export is
the SDK's ``OTLPSpanExporter`` behind ``CountingBatchSpanProcessor``; every span lost after it ended is counted in
``kvalloc_events_dropped_total{sink="otel"}`` and ``spans_dropped`` (see ``export``).

Configuration (read in the constructor): ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`` (or ``endpoint=``; a URL without
a path gets ``/v1/traces``), ``..._HEADERS``, ``..._TIMEOUT``, ``..._COMPRESSION``, ``..._PROTOCOL``,
``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (default service ``instrumented-alloc``),
``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, ``none``, a comma list, entry points), ``OTEL_TRACES_SAMPLER``,
``OTEL_BSP_*``, ``OTEL_SPAN_EVENT_COUNT_LIMIT``. ``span_exporter=`` replaces the exporters of our own provider;
``tracer_provider=`` (with ``counting_exporter=`` for its losses) uses yours as given.
"""

from exporters.otel.export import CountingBatchSpanProcessor, CountingSpanExporter
from exporters.otel.exporter import DEFAULT_SERVICE_NAME, TRACER_NAME, OtelExporter

__all__ = ["DEFAULT_SERVICE_NAME", "TRACER_NAME", "CountingBatchSpanProcessor", "CountingSpanExporter", "OtelExporter"]
