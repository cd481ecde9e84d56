"""OpenTelemetry traces for an ``InstrumentedAllocator``: one ``kv.request`` span per request.

Usage::

    exporter = OtelExporter(alloc)            # OTLP/HTTP, configured by the standard OTEL_* variables
    exporter.set_parent(rid, headers)         # optional, per request, before its first allocation: the
                                              # engine's span of it (W3C traceparent/tracestate, or a context)
    ...                                       # the engine runs; spans are exported in the background
    exporter.shutdown(timeout_millis=5000)    # ends still-open request spans, exports what it can in time

What is traced
- ``kv.request`` (one per request; a root span, or a child of the engine's own span of the request when the
  engine names it with ``set_parent``, in the engine's trace): starts at the first event naming the request (its
  first allocation, or a violation raised by that very call), ends at ``alloc.release_request(rid)``. Attributes:
  ``kv.request.id``, ``kv.page_size``; set at the end: ``kv.allocated_len``, ``kv.committed_len``,
  ``kv.swa_evicted_seqlen`` (the request's KV record as its allocations and checked ledger writes left it: the
  frees that tear a request down just before its release do not zero them), ``kv.pages.peak`` (the most
  full-pool pages it held at once: its KV footprint; its SWA pages come and go with the window, as the
  ``kvalloc_request_pages{pool="full"}`` histogram counts it), ``kv.pages.held_at_release`` (pages of every pool
  still held: > 0 is a leak), ``kv.violations``, ``kv.decode_steps`` (decode allocations are
  counted, never one event per token; consecutive decodes of the same requests (one ``batch()`` block, or the
  next blocks while the batch is unchanged) are folded into one update of the requests' records, applied before
  the sink handles any other event that reads or opens a record; a checked ledger write of an open request (an
  SWA eviction's ``swa_evicted_seqlen``, about one a step) and ``SwaEvict`` leave the fold open, the write replayed
  in order at the flush) and ``kv.events_dropped``.
- Span events: ``kv.prefill`` (``alloc_extend``/``alloc``: ``kv.n_slots``/``kv.n_pages`` of this request),
  ``kv.prealloc`` (``alloc_extend_swa_tail``/``alloc_logical_only``, with ``kv.swa_tail_len`` for a tail),
  ``kv.swa_evict`` (``kv.swa_evicted_seqlen.old``/``.new``, ``kv.n_pages``), ``kv.release``
  (``kv.pages_held``, ``kv.pages_peak``) and ``kv.violation`` (``kv.violation.invariant``,
  ``kv.violation.message``, ``.severity``, ``.op``, ``.pool``); the first violation sets the span's status to
  ERROR. Every event carries ``kv.step``. A plain ``alloc`` of one slot for a request that already holds KV is a
  decode (SGLang decodes with ``alloc(bs)`` at page size 1) and is counted as one.
- At most ``max_events_per_span`` events per span: the first ``max_events_per_span - 1`` events are kept and the
  last place is kept for ``kv.release``; every event beyond is counted in ``kv.events_dropped`` and in the span's
  dropped events count (OTLP ``dropped_events_count``: the two agree). (The status and ``kv.violations`` still
  count every violation.) The bound is the smaller of ``max_events_per_span`` and the span event limit: for our own
  provider ``OTEL_SPAN_EVENT_COUNT_LIMIT`` when set (unset, the SDK's default of 128 is raised to
  ``max_events_per_span`` when below it); for a provider you pass in, its ``SpanLimits.max_events`` (a limit below
  ``max_events_per_span`` is logged once, naming both). So the SDK never evicts an event of ours (it would evict the
  oldest, the prefill); should it do so anyway (a provider whose limits cannot be read), its evictions are added to
  ``kv.events_dropped``.
- A violation that names no request gets its own short ``kv.violation`` span (status ERROR, same attributes).
  One naming a request whose span already ended (a leak found by a later sweep) gets a ``kv.violation`` span in
  that request's trace, as a child of the ended span.
- ``alloc.trace_id_for`` is set to this exporter's lookup, so each ``Violation`` of a request carries the trace
  id (32 hex digits) of that request's span (None when the sampler dropped it: see Sampling below).

Threading and what is dropped when
- The sink runs on the engine thread, inside the wrapper's call, after the allocator call returned. It only
  starts and ends spans and adds events and attributes: operations in memory. It never raises into the
  wrapper: a batch it fails on is refused (returns False), so the bus counts it in ``alloc.bus.dropped["otel"]``;
  ``errors`` counts them here.
- Ended spans go to a ``CountingBatchSpanProcessor`` (the SDK's ``BatchSpanProcessor`` with exact loss counts): a
  bounded queue (``OTEL_BSP_MAX_QUEUE_SIZE``, default 2048 spans) whose ``on_end`` is a count and an append, and a
  background thread that exports in batches (``OTEL_BSP_SCHEDULE_DELAY``, ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``).
  Nothing on the engine thread waits on the network: when the collector is down or slow, the background thread
  tries within the exporter timeout (``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``) and gives the batch up.
- Every span lost after it ended is counted, under ``kvalloc_events_dropped_total{sink="otel"}``
  (``alloc.bus.add_loss_counter``) and in ``spans_dropped``: the spans of every export that returned FAILURE or
  raised (collector down, timing out, answering 500/503, or the exporter already shut down; counted by the
  ``CountingSpanExporter`` around the OTLP exporter), the spans refused because the queue was full (the newest
  span is refused rather than the SDK evicting the oldest uncounted), and, when ``shutdown()``'s wait runs out,
  what was still queued (the exporter is shut down, so those exports fail at once). With your own
  ``tracer_provider``, use ``CountingBatchSpanProcessor(your_exporter)`` as its processor (or, for the export
  failures alone, wrap your exporter in ``CountingSpanExporter``) and pass it as ``counting_exporter=`` to have its
  losses reported the same way. Exporters on one allocator that share that processor (an exporter shut down and a
  new one attached with the same provider, or two side by side) report its losses once, past ones included.
- Spans of requests still open live in memory until their release (one span object and a few counters per live
  request). ``shutdown()`` ends them (``kv.open_at_shutdown=True``) so that they are exported too.
- The fast span path (our own provider only): when the sampler is one ``OTEL_TRACES_SAMPLER`` names (unset:
  ``parentbased_always_on``; ``always_on``, ``always_off``, ``traceidratio``, ``parentbased_always_off``,
  ``parentbased_traceidratio``; or ``sampler=`` such an SDK sampler, parent-based ones with any such delegates),
  the SDK is enabled and the span limits trim nothing of ours (no ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``/
  ``OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT``, attribute count limits of at least 16), a span is not an SDK
  ``Span`` while it lives: a plain record (start time, trace and span ids from the provider's id generator,
  attributes, events, status), ended into one ``ReadableSpan`` handed straight to our
  ``CountingBatchSpanProcessor``. A request's span is the request's own record until then (its start attributes
  kept as values: the span's one attribute dict is built at the end, keys in the SDK span's order). What is
  exported is the same as the SDK's spans would give (name, ids, parent, attributes, events, status, kind,
  resource, scope, times from ``time.time_ns``); what is skipped is the SDK's per-span machinery (sampler call,
  attribute copies and checks, the span's lock). Its ``Event``s and its
  ``ReadableSpan`` are the SDK's classes filled attribute by attribute, as their constructors fill them (checked
  once, at import, against the constructors, which are used instead should an SDK version do more there).
  Processors added to our ``tracer_provider`` afterwards see none of these spans (pass your own provider for
  that). Any other sampler or limit: the SDK's spans, which apply them.
- Sampling on the fast path: the sampler's decision is made once, when the span starts, as its ``should_sample``
  makes it (``_sampling_decision``: by the trace id's low 64 bits for a ratio, by the parent's flag for a
  parent-based sampler's child; ids drawn in the SDK's order, dropped spans' included). A request whose span is
  dropped keeps only its context and counters until its release: no span event built, no ``ReadableSpan``, nothing
  queued, nothing counted as lost. So a sampler cuts the exporter's cost, where the SDK's non-recording spans
  would not (each still a span object, a sampler call and its events' attributes built).
- Tracing off: when no span can be produced (``OTEL_SDK_DISABLED``, or a provider whose tracer is a no-op; our
  provider's sampler dropping every span of ours, whatever its parent: ``always_off``, a ratio of 0; not
  ``parentbased_always_off``, which samples the child of a sampled engine span named by ``set_parent``, nor any
  ``ParentBased`` whose delegate for some parent, remote or local (an in-process engine span), samples) the
  exporter subscribes to nothing: with no other sink the wrapper builds no event, and ``trace_id_for`` is not set.
- Sampling and trace ids: ``trace_id_for`` (and so a violation's ``trace_id`` and the Prometheus exemplar) is None
  for a request whose span the sampler dropped, on either path: such a trace is never exported (the same rule as
  OpenTelemetry's trace-based exemplar filter).
- A ``tracer_provider`` passed in is used as given: a synchronous processor in it (``SimpleSpanProcessor``) would
  export on the engine thread; that is the tests' in-memory setup, not a production one.
- What the sink reads (``event_types``; ``decode_allocs = False``, ``free_ledgers = False`` and
  ``decode_ledgers = False``, see ``instrumented_alloc/events.py``): no ``Alloc`` of a decode, no ``LedgerUpdate``
  of a free and none of each decode, so that on its own neither a free call nor a decode builds an event or
  delivers a batch: a run of decodes of one batch comes as one ``DecodeFold`` (the wrapper's fold, built before
  anything changes those requests' values: it is applied as the exporter's own fold of per-decode updates would
  be, and the spans are the same; a request first heard of in a fold gets its span then). When another sink reads
  each decode's update, or verification is deferred, those come instead and the exporter folds them itself.
  A free moves only the request's current ledger values, which matter for its next allocation alone (a retracted
  request's re-prefill is measured from them): the sink reads them there from ``alloc.bus.skipped_frees``, which
  is why it must run on the wrapper's thread (behind a ``NonBlockingSink`` it receives the frees' and decodes'
  updates instead). The spans are the same either way.
- Our own OTLP exporter (``_OtlpSpanExporter``) is the SDK's ``OTLPSpanExporter`` with its request body written
  directly (``_encode_request``): byte for byte what the SDK's encoder serialises, for about a quarter of the
  worker thread's CPU per span (the SDK builds a protobuf object per attribute and value first). Resources, scopes
  and any attribute value other than str, bool, int64 and float still go through the SDK's encoder.

Request ids (``hash_request_ids=``: a ``instrumented_alloc.redact.RequestIdHasher``, a key, or True for a random
key): ``kv.request.id`` (of request and violation spans) and the request id inside ``kv.violation.message`` and the
status description are the id's keyed pseudonym (``h:`` + 16 hex digits). Share one hasher with the flight recorder
to join a recording with the spans. ``trace_id_for`` still takes the raw id (what the wrapper and the Prometheus
exporter's exemplars ask with); nothing raw leaves the process in a span.

Export configuration (read in the constructor, never at import): ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT`` (default ``http://localhost:4318/v1/traces``), ``..._HEADERS``, ``..._TIMEOUT``,
``..._COMPRESSION``, ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (service name default
``instrumented-alloc``), ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*`` (``OTEL_BSP_MAX_QUEUE_SIZE`` not positive:
``ValueError``, as the SDK's processor raises). ``endpoint=`` overrides the endpoint variables (a URL without a
path gets ``/v1/traces``, before its query if it has one). ``span_exporter=`` replaces the OTLP exporter of our own
provider (any ``SpanExporter``, e.g. an in-memory or console one; behind the same ``CountingBatchSpanProcessor``, so
its failed exports are counted the same way). ``sampler=`` replaces ``OTEL_TRACES_SAMPLER``/``..._ARG`` for our own
provider (an SDK ``Sampler``: the fast path takes every one ``_sampling_decision`` knows, e.g.
``ParentBasedTraceIdRatio(0.1)``; any other gets the SDK's spans). ``OTEL_TRACES_EXPORTER`` picks the exporters
of our own provider as the SDK's configuration reads it (``span_exporter=`` replaces it): unset, ``otlp``;
``none``, none (tracing is then off, as above: nothing exported, nothing counted as lost); ``console``, the SDK's
``ConsoleSpanExporter``; ``otlp`` by ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``:
``http/protobuf`` (and unset: the specification's default, where the SDK's own configuration defaults to gRPC) our
OTLP/HTTP exporter, ``grpc`` the SDK's gRPC exporter (package opentelemetry-exporter-otlp-proto-grpc; without it a
``ValueError`` says so); ``otlp_proto_http``, ``otlp_proto_grpc`` or any name in the
``opentelemetry_traces_exporter`` entry points; a comma list, one ``CountingBatchSpanProcessor`` each (losses
summed). An unknown name or protocol raises ``ValueError`` naming the variable and its value.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import struct
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from importlib.metadata import entry_points
from urllib.parse import urlsplit, urlunsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, Tracer, TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.semconv.attributes.http_attributes import HTTP_RESPONSE_STATUS_CODE
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from instrumented_alloc import events as ev

try:  # the SDK encoder's parts that _encode_request reuses, and the OTLP/HTTP exporter's size check
    from opentelemetry.exporter.otlp.proto.common._internal import (
        _encode_attributes,
        _encode_instrumentation_scope,
        _encode_resource,
    )
    from opentelemetry.exporter.otlp.proto.http._common import RequestPayloadTooLargeError, _is_request_too_large
except ImportError:  # another SDK version: _OtlpSpanExporter is then the SDK's exporter
    _is_request_too_large = None
from instrumented_alloc.redact import as_hasher

__all__ = ["DEFAULT_SERVICE_NAME", "CountingBatchSpanProcessor", "CountingSpanExporter", "OtelExporter"]

_logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "instrumented-alloc"
TRACER_NAME = "instrumented_alloc.exporters.otel"

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
_LEDGER_FIELDS = {
    "kv_allocated_len": "allocated",
    "kv_committed_len": "committed",
    "swa_evicted_seqlen": "evicted",
}
# Ended requests remembered so that a later violation (a sweep's leak) lands in the request's trace.
_RECENT_ENDED = 4096
_NONES = itertools.repeat(None)  # slots not read: no skipped free to look up
_BSP_DEFAULT_QUEUE = 2048  # the SDK's default OTEL_BSP_MAX_QUEUE_SIZE
_EVENT_LIMIT_ENV = "OTEL_SPAN_EVENT_COUNT_LIMIT"
# Parents named by set_parent that wait for their request's first allocation, at most.
_MAX_PARENTS = 65536
_W3C = TraceContextTextMapPropagator()
# The most attributes a span (11) or an event (8) of ours carries, with room: span limits below this (set by
# OTEL_*_ATTRIBUTE_COUNT_LIMIT) are left to the SDK's spans to apply, so the fast path never needs to trim.
_FAST_MIN_ATTRIBUTES = 16


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _attr_value(rid):
    """A request id as an attribute value: str and float as they are, an int as it is within int64 (what OTLP's
    int_value holds: the encoder drops a larger one, such as a UUID's int, with the attribute), anything else (a
    larger int included) as its str."""
    if isinstance(rid, (str, float)) or (
        isinstance(rid, int) and not isinstance(rid, bool) and _INT64_MIN <= rid <= _INT64_MAX
    ):
        return rid
    return str(rid)


def _trace_hex(ctx) -> str | None:
    """The trace id of a sampled span's context as 32 hex digits; None for no context, an invalid one or a span the
    sampler dropped (never exported: its id would link to nothing, as OpenTelemetry's trace-based exemplar filter
    keeps exemplars of sampled traces only)."""
    if ctx is None or not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return format(ctx.trace_id, "032x")


def _put_recent(recent: OrderedDict, key, value, limit: int) -> bool:
    """``recent[key] = value`` as its newest entry, then the oldest out when that makes more than ``limit`` (one in,
    at most one out). True when one went out."""
    recent[key] = value
    recent.move_to_end(key)
    if len(recent) > limit:
        recent.popitem(last=False)
        return True
    return False


def _parent_context(parent) -> SpanContext | None:
    """``OtelExporter.set_parent``'s ``parent`` as a valid ``SpanContext``, or None (None, or no valid context)."""
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


def _sampling_decision(sampler):
    """``decide(parent, trace_id) -> bool``: whether ``sampler.should_sample`` samples a span of ours whose parent
    is ``parent`` (a valid ``SpanContext``, local or remote, or None for a root span) and trace id ``trace_id``.
    Exact for the SDK's own samplers as their classes define them (``StaticSampler`` deciding DROP or
    RECORD_AND_SAMPLE: ALWAYS_OFF/ALWAYS_ON; ``TraceIdRatioBased``; ``ParentBased`` and
    ``ParentBasedTraceIdRatio`` over such samplers, with any such delegates): what every ``OTEL_TRACES_SAMPLER``
    value builds. None for anything else (a subclass that overrides ``should_sample``, RECORD_ONLY, another
    sampler): the SDK's spans then apply it."""
    should = getattr(type(sampler), "should_sample", None)
    if isinstance(sampler, sampling.StaticSampler) and should is sampling.StaticSampler.should_sample:
        decision = getattr(sampler, "_decision", None)
        if decision is sampling.Decision.RECORD_AND_SAMPLE:
            return lambda parent, trace_id: True
        if decision is sampling.Decision.DROP:
            return lambda parent, trace_id: False
        return None
    if isinstance(sampler, sampling.TraceIdRatioBased) and should is sampling.TraceIdRatioBased.should_sample:
        bound, limit = sampler.bound, sampler.TRACE_ID_LIMIT
        return lambda parent, trace_id: trace_id & limit < bound
    if isinstance(sampler, sampling.ParentBased) and should is sampling.ParentBased.should_sample:
        names = (
            "_root",
            "_local_parent_sampled",
            "_local_parent_not_sampled",
            "_remote_parent_sampled",
            "_remote_parent_not_sampled",
        )
        parts = [_sampling_decision(getattr(sampler, name, None)) for name in names]
        if None in parts:
            return None
        root, local_sampled, local_unsampled, remote_sampled, remote_unsampled = parts

        def decide(parent, trace_id):
            if parent is None or not parent.is_valid:
                return root(None, trace_id)
            if parent.is_remote:
                d = remote_sampled if parent.trace_flags.sampled else remote_unsampled
            else:
                d = local_sampled if parent.trace_flags.sampled else local_unsampled
            return d(parent, trace_id)

        return decide
    return None


def _samples_nothing(sampler) -> bool:
    """Whether ``sampler`` (one ``_sampling_decision`` reads) drops every span of ours: each root span, each child of
    an engine's span handed to ``OtelExporter.set_parent`` (a remote parent, from a W3C carrier, or a local one, an
    in-process engine span or its context; sampled or not) and each child of a dropped span."""
    if isinstance(sampler, sampling.StaticSampler):
        return getattr(sampler, "_decision", None) is sampling.Decision.DROP
    if isinstance(sampler, sampling.TraceIdRatioBased):
        return sampler.bound <= 0
    if isinstance(sampler, sampling.ParentBased):
        return all(
            _samples_nothing(getattr(sampler, name, None))
            for name in (
                "_root",
                "_local_parent_sampled",
                "_local_parent_not_sampled",
                "_remote_parent_sampled",
                "_remote_parent_not_sampled",
            )
        )
    return False


def _traces_url(endpoint: str) -> str:
    """``endpoint=`` as the full OTLP/HTTP traces URL: a URL without a path (``scheme://host:port``, or ``/``) gets
    the path ``/v1/traces``; its query and fragment, if any, stay where they were (after the path)."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return urlunsplit(parts._replace(path="/v1/traces"))
    return endpoint


_TRACES_EXPORTER_ENV = "OTEL_TRACES_EXPORTER"
_OTLP_PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_OTLP_BY_PROTOCOL = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}
_GRPC_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"


def _otlp_exporter_name() -> str:
    """``otlp`` as the exporter ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` names:
    ``otlp_proto_http`` for ``http/protobuf`` and when neither is set (the specification's default, and this
    exporter's), ``otlp_proto_grpc`` for ``grpc``. Any other value raises ``ValueError`` naming it (the SDK's
    configuration raises for it too)."""
    for var in _OTLP_PROTOCOL_ENVS:
        raw = os.environ.get(var)
        if raw:
            name = _OTLP_BY_PROTOCOL.get(raw.strip())
            if name is None:
                raise ValueError(
                    f"{var}={raw!r}: unsupported OTLP protocol for traces (supported: {', '.join(_OTLP_BY_PROTOCOL)})"
                )
            return name
    return "otlp_proto_http"


def _env_span_exporters(endpoint: str | None) -> list:
    """The span exporters ``OTEL_TRACES_EXPORTER`` names, as the SDK's configuration reads it: unset or empty,
    ``otlp``; ``none`` (alone), none; otherwise a comma-separated list (each name once, in order) of ``otlp`` (by
    ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL``: see ``_otlp_exporter_name``), ``otlp_proto_http`` (our
    ``_OtlpSpanExporter``), ``otlp_proto_grpc`` (the SDK's gRPC exporter, from the package
    opentelemetry-exporter-otlp-proto-grpc), ``console`` (the SDK's ``ConsoleSpanExporter``), or any other name
    registered in the ``opentelemetry_traces_exporter`` entry point group. A name that is none of them raises
    ``ValueError`` naming the variable and its value (the SDK's configuration raises for it too). ``endpoint``: the
    OTLP exporters' endpoint (HTTP: ``_traces_url`` of it; gRPC: as given), None for theirs from the environment."""
    raw = os.environ.get(_TRACES_EXPORTER_ENV, "")
    if raw.strip().lower() == "none":
        return []
    names = [n.strip() for n in raw.split(",")] if raw.strip() else ["otlp"]
    resolved: list = []
    for name in names:
        name = _otlp_exporter_name() if name == "otlp" else name
        if name not in resolved:
            resolved.append(name)
    out = []
    for name in resolved:
        if name == "otlp_proto_http":
            out.append(_OtlpSpanExporter(endpoint=_traces_url(endpoint) if endpoint else None))
        elif name == "otlp_proto_grpc":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
            except ImportError as exc:
                raise ValueError(
                    f"{_TRACES_EXPORTER_ENV}={raw!r} with the OTLP protocol grpc needs the package {_GRPC_PACKAGE} "
                    f"(pip install {_GRPC_PACKAGE}), which is not installed ({exc}); or set "
                    f"{_OTLP_PROTOCOL_ENVS[0]}=http/protobuf"
                ) from exc
            out.append(GrpcExporter(endpoint=endpoint) if endpoint else GrpcExporter())
        elif name == "console":
            out.append(ConsoleSpanExporter())
        else:
            found = list(entry_points(group="opentelemetry_traces_exporter", name=name)) if name else []
            if not found:
                raise ValueError(
                    f"{_TRACES_EXPORTER_ENV}={raw!r}: unknown span exporter {name!r} (known: otlp, otlp_proto_http, "
                    "otlp_proto_grpc, console, none, or a name in the opentelemetry_traces_exporter entry points)"
                )
            out.append(found[0].load()())
    return out


def _no_loss() -> int:
    return 0


def _run_bounded(fn, timeout_s: float, name: str):
    """Run ``fn`` on a daemon thread and wait at most ``timeout_s``: (finished, result)."""
    out: list = []

    def target():
        try:
            out.append(fn())
        except Exception as exc:
            _logger.warning("%s failed: %s: %s", name, type(exc).__name__, exc)
            out.append(False)

    t = threading.Thread(target=target, name=f"otel-exporter-{name}", daemon=True)
    t.start()
    t.join(max(0.0, timeout_s))
    return (True, out[0]) if out else (False, None)


class CountingSpanExporter(SpanExporter):
    """A ``SpanExporter`` that forwards to ``inner`` and counts what was lost at export.

    ``dropped``: spans of every ``export`` call that returned anything but SUCCESS or raised (the exception is
    re-raised: the batch processor logs it as before); ``failed_exports``: those calls; ``exported``: spans of
    the calls that succeeded. Thread-safe: ``export`` runs on the batch processor's worker thread (and on a
    flushing thread), the counts are read from any thread. ``shutdown`` and ``force_flush`` are forwarded.

    Usage with your own provider::

        counting = CountingSpanExporter(OTLPSpanExporter())
        provider.add_span_processor(BatchSpanProcessor(counting))
        OtelExporter(alloc, tracer_provider=provider, counting_exporter=counting)
    """

    def __init__(self, inner: SpanExporter):
        if not callable(getattr(inner, "export", None)):
            raise TypeError(f"inner: expected a SpanExporter, got {type(inner).__name__}")
        self.inner = inner
        self._lock = threading.Lock()
        self._dropped = 0
        self._failed = 0
        self._exported = 0
        # _exported + _dropped, kept as one int so that settled() reads it without the lock (one attribute read
        # is atomic): the batch processor's admit() asks on every span, on the engine thread.
        self._settled = 0
        _reinit_after_fork(self)

    def export(self, spans) -> SpanExportResult:
        n = len(spans)
        ok = False
        try:
            result = self.inner.export(spans)
            ok = result is SpanExportResult.SUCCESS
            return result
        finally:
            with self._lock:
                if ok:
                    self._exported += n
                else:
                    self._dropped += n
                    self._failed += 1
                self._settled += n

    def settled(self) -> int:
        """Spans whose export call finished, either way. Lock-free: a value the count had at the moment of the
        call or just before (it only grows), never one ahead of it."""
        return self._settled

    def _at_fork_reinit(self) -> None:
        # In a forked child: a fresh lock (the parent's may have been held by its export thread at the fork, and
        # that thread does not exist here). The counts carry on as the process's other counters do.
        self._lock = threading.Lock()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        flush = getattr(self.inner, "force_flush", None)
        return True if flush is None else flush(timeout_millis)

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._dropped

    @property
    def failed_exports(self) -> int:
        with self._lock:
            return self._failed

    @property
    def exported(self) -> int:
        with self._lock:
            return self._exported


def _reinit_after_fork(obj) -> None:
    """Call ``obj._at_fork_reinit()`` in every child forked after this, for as long as ``obj`` lives (a weak
    reference: the hook keeps nothing alive), as the SDK's batch processor does for its own queue and thread."""
    if hasattr(os, "register_at_fork"):
        ref = weakref.WeakMethod(obj._at_fork_reinit)

        def after_in_child() -> None:
            reinit = ref()
            if reinit is not None:
                reinit()

        os.register_at_fork(after_in_child=after_in_child)


def _env_queue_size() -> int:
    """``OTEL_BSP_MAX_QUEUE_SIZE`` as the SDK's ``BatchSpanProcessor`` reads it: an int (one that does not parse is
    logged and the default, 2048, used instead). A value that is not positive raises ``ValueError`` here, naming the
    variable, where the SDK's processor raises its own ``ValueError`` for it."""
    raw = os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE")
    if raw is None:
        return _BSP_DEFAULT_QUEUE
    try:
        n = int(raw)
    except ValueError:
        _logger.exception(
            "Unable to parse value for %s as integer. Defaulting to %s.", "OTEL_BSP_MAX_QUEUE_SIZE", _BSP_DEFAULT_QUEUE
        )
        return _BSP_DEFAULT_QUEUE
    if n <= 0:
        raise ValueError(f"OTEL_BSP_MAX_QUEUE_SIZE={raw!r}: max_queue_size must be a positive integer.")
    return n


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """A ``BatchSpanProcessor`` that loses no span without counting it.

    The SDK's batch processor silently evicts its oldest queued span when its queue is full (it only logs), and
    spans still queued when its ``shutdown`` gives up are never exported. This one keeps the count exact:

    - Its exporter is wrapped in ``CountingSpanExporter`` (unless it is one), which counts the spans of failed
      exports.
    - ``on_end`` hands a span to the queue only while fewer than ``max_queue_size`` handed spans are unsettled
      (queued or in an export call); otherwise it refuses the newest span and counts it in ``queue_full``. The
      SDK's queue therefore never overflows (it holds at most the unsettled spans), so nothing is evicted
      uncounted. The price: while a batch is being exported the queue admits up to its size fewer spans.
    - At ``shutdown`` the queue is exported (our ``OtelExporter.shutdown`` shuts the exporter down when its own
      wait runs out, so that what is left fails at once, counted). Not counted: spans left in the queue when the
      SDK's own shutdown wait (30 s) runs out while an export call still hangs.

    - In a child forked after it was built (``os.fork``), the SDK's at-fork hook empties the queue and starts a new
      worker (the parent exports what was queued); this one then counts nothing handed as unsettled and takes a new
      lock, so the child's spans are admitted as a fresh processor's would be. The counts carry on from the parent's.

    ``dropped`` = spans of failed exports + ``queue_full``: a running total that never decreases.
    Thread-safe: ``on_end`` runs on the thread that ends the span (the engine's), exports on the processor's
    worker; the counts are read from any thread. ``on_end`` costs a lock and a comparison; it never waits.
    ``admit(span)`` is ``on_end`` without the sampled check, for a span known to be sampled (``OtelExporter``'s
    fast path hands its spans there).
    """

    def __init__(
        self,
        span_exporter: SpanExporter,
        max_queue_size: int | None = None,
        schedule_delay_millis: float | None = None,
        max_export_batch_size: int | None = None,
        export_timeout_millis: float | None = None,
    ):
        counting = span_exporter if isinstance(span_exporter, CountingSpanExporter) else CountingSpanExporter(
            span_exporter
        )
        if max_queue_size is None:
            max_queue_size = _env_queue_size()
        super().__init__(
            counting,
            max_queue_size=max_queue_size,
            schedule_delay_millis=schedule_delay_millis,
            max_export_batch_size=max_export_batch_size,
            export_timeout_millis=export_timeout_millis,
        )
        self.counting = counting
        self.max_queue_size = max_queue_size
        self._count_lock = threading.Lock()
        self._handed = self.counting.settled()  # a CountingSpanExporter passed in may have exported before
        self._queue_full = 0
        self._closed = False
        # The SDK's on_end is its own sampled check, then this queue's emit: call emit directly when it is there.
        inner = getattr(self, "_batch_processor", None)
        self._emit = getattr(inner, "emit", None) or super().on_end
        # Registered after the SDK's own hook (in the constructor above), which empties the queue in a child.
        _reinit_after_fork(self)

    def _at_fork_reinit(self) -> None:
        # In a forked child the SDK's hook has emptied the queue (the parent exports what it held) and started a
        # new worker: nothing handed here is unsettled any more. Without this the child would count the parent's
        # queued spans as still queued and refuse its own as "queue full". A fresh lock too: the parent's may have
        # been held at the fork by a thread the child does not have.
        self._count_lock = threading.Lock()
        self._handed = self.counting._settled

    def on_end(self, span) -> None:
        if span.context and span.context.trace_flags.sampled:  # the SDK's processor ignores unsampled spans too
            self.admit(span)

    def admit(self, span) -> None:
        """``on_end`` of a span known to be sampled (``OtelExporter``'s fast path builds only such spans)."""
        # settled() without the call, read lock-free: a count that only grows, so a stale value only makes the
        # queue look fuller than it is (a span refused early, never an SDK queue that overflows).
        settled = self.counting._settled
        with self._count_lock:
            if self._closed:
                self._queue_full += 1  # the SDK would ignore it (shut down): lost all the same
                return
            if self._handed - settled >= self.max_queue_size:
                self._queue_full += 1
                return
            self._handed += 1
        self._emit(span)

    def shutdown(self) -> None:
        with self._count_lock:
            self._closed = True
        super().shutdown()

    @property
    def queue_full(self) -> int:
        with self._count_lock:
            return self._queue_full

    @property
    def dropped(self) -> int:
        with self._count_lock:
            own = self._queue_full
        return own + self.counting.dropped

    @property
    def exported(self) -> int:
        return self.counting.exported

    @property
    def failed_exports(self) -> int:
        return self.counting.failed_exports


class _CountingProcessors:
    """Our own provider's ``CountingBatchSpanProcessor``s, one per exporter ``OTEL_TRACES_EXPORTER`` names, as one:
    ``admit`` hands a span to each; the counts are their sums (a span lost by two exporters counts twice: each
    exporter's loss is one)."""

    def __init__(self, processors: list):
        self.processors = processors

    def admit(self, span) -> None:
        for p in self.processors:
            p.admit(span)

    def _total(name: str) -> property:  # a helper of the class body (deleted below), not a method
        return property(lambda self: sum(getattr(p, name) for p in self.processors))

    queue_full = _total("queue_full")
    dropped = _total("dropped")
    exported = _total("exported")
    failed_exports = _total("failed_exports")
    del _total


# -- OTLP encoding ----------------------------------------------------------------------------------------------
# The SDK's encoder (encode_spans) builds one protobuf message object per span, event, attribute and value before
# serialising them: about 90 us of the batch processor's worker per request span of ours (5-6 events), CPU of the
# engine's process. _encode_request writes the same ExportTraceServiceRequest bytes directly (field by field, in
# field-number order, as the serialiser does); resources and scopes, and any attribute value that is not a str,
# bool, int in int64 range or float, are encoded by the SDK's own functions (the latter per value, so that what
# the SDK does with them, a list or a value it refuses and logs, stays its own).
def _varint(n: int) -> bytes:
    """A non-negative int as a protobuf varint (a negative int64 is written as its 64-bit two's complement)."""
    if n < 0:
        n += 1 << 64
    if n < 0x80:
        return _BYTE[n]
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_BYTE = [bytes((i,)) for i in range(256)]
_SMALL_INT = [b"\x18" + bytes((i,)) for i in range(128)]  # AnyValue.int_value of 0..127
_FIXED64 = struct.Struct("<Q").pack
_DOUBLE = struct.Struct("<d").pack
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
# Span.kind values (opentelemetry/proto/trace/v1/trace.proto: SpanKind), as the SDK's encoder maps them.
_KIND = {
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x100)  # Span.flags (16, fixed32): CONTEXT_HAS_IS_REMOTE
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x300)  # ... | CONTEXT_IS_REMOTE (a remote parent)


def _len_field(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


class _KeyCache(dict):
    """Attribute key -> its KeyValue.key field bytes (a few dozen keys in practice; cleared past 4096)."""

    def __missing__(self, key: str) -> bytes:
        if len(self) >= 4096:
            self.clear()
        b = self[key] = _len_field(b"\x0a", key.encode())
        return b


def _key_values(tag: bytes, attributes, keys: _KeyCache) -> list:
    """The KeyValue fields (``tag``: the field's tag byte) of an attribute mapping, in its order, as the SDK's
    ``_encode_attributes`` gives them (a value the SDK refuses is logged and left out by the SDK's own code)."""
    out = []
    if not attributes:
        return out
    byte, small = _BYTE, _SMALL_INT
    for key, value in attributes.items():
        t = type(value)
        v = None
        try:
            if t is int:
                if 0 <= value < 128:
                    v = small[value]
                elif _I64_MIN <= value <= _I64_MAX:
                    v = b"\x18" + _varint(value)
            elif t is str:
                s = value.encode()
                n = len(s)
                v = b"\x0a" + (byte[n] if n < 128 else _varint(n)) + s
            elif t is bool:
                v = b"\x10\x01" if value else b"\x10\x00"
            elif t is float:
                v = b"\x21" + _DOUBLE(value)
            if v is not None and type(key) is str:
                n = len(v)
                kv = keys[key] + b"\x12" + (byte[n] if n < 128 else _varint(n)) + v
            else:
                v = None
        except UnicodeEncodeError:  # a lone surrogate: the SDK's protobuf refuses it
            v = None
        if v is None:
            # Anything else (a sequence, bytes, a subclass, a value the SDK rejects): the SDK's own encoding.
            encoded = _encode_attributes({key: value})
            if not encoded:
                continue
            kv = encoded[0].SerializeToString()
        n = len(kv)
        out.append(tag + (byte[n] if n < 128 else _varint(n)) + kv)
    return out


def _status_bytes(status) -> bytes:
    """Span.status (15): always present, as the SDK sets it (code 0 and no message: an empty message)."""
    if status is None:
        return b""
    payload = b""
    message = status.description
    if message:
        m = message.encode()
        payload = b"\x12" + _varint(len(m)) + m
    code = status.status_code.value
    if code:
        payload += b"\x18" + _varint(code)
    return b"\x7a" + _varint(len(payload)) + payload


def _span_bytes(span, keys: _KeyCache) -> bytes:
    ctx = span.get_span_context()
    parts = [b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big"), b"\x12\x08" + ctx.span_id.to_bytes(8, "big")]
    trace_state = ctx.trace_state
    if trace_state:
        ts = ",".join([f"{k}={v}" for k, v in trace_state.items()]).encode()
        parts.append(b"\x1a" + _varint(len(ts)) + ts)
    parent = span.parent
    if parent:
        parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    name = span.name.encode()
    if name:
        parts.append(b"\x2a" + _varint(len(name)) + name)
    kind = _KIND[span.kind]
    if kind:
        parts.append(b"\x30" + _BYTE[kind])
    if span.start_time:
        parts.append(b"\x39" + _FIXED64(span.start_time))
    if span.end_time:
        parts.append(b"\x41" + _FIXED64(span.end_time))
    # dropped_* are 0 unless the container is the SDK's bounded one (the properties' isinstance checks are ABC
    # checks: a third of a small event's encoding); a plain dict or list, as our fast spans hold, drops nothing.
    attributes = getattr(span, "_attributes", None)
    parts += _key_values(b"\x4a", span.attributes, keys)
    n = 0 if type(attributes) is dict else span.dropped_attributes
    if n:
        parts.append(b"\x50" + _varint(n))
    for event in span.events:
        ev_parts = []
        if event.timestamp:
            ev_parts.append(b"\x09" + _FIXED64(event.timestamp))
        en = event.name.encode()
        if en:
            ev_parts.append(b"\x12" + _varint(len(en)) + en)
        attributes = event.attributes
        ev_parts += _key_values(b"\x1a", attributes, keys)
        n = 0 if type(attributes) is dict else event.dropped_attributes
        if n:
            ev_parts.append(b"\x20" + _varint(n))
        payload = b"".join(ev_parts)
        parts.append(b"\x5a" + _varint(len(payload)) + payload)
    n = 0 if type(getattr(span, "_events", None)) is list else span.dropped_events
    if n:
        parts.append(b"\x60" + _varint(n))
    links = span.links
    if links:
        # Links (none of ours have any): the SDK's encoding of the span, its links field taken as they are.
        for link in encode_spans([span]).resource_spans[0].scope_spans[0].spans[0].links:
            lb = link.SerializeToString()
            parts.append(b"\x6a" + _varint(len(lb)) + lb)
    n = 0 if type(getattr(span, "_links", None)) is tuple else span.dropped_links
    if n:
        parts.append(b"\x70" + _varint(n))
    parts.append(_status_bytes(span.status))
    parts.append(_FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL)
    return b"".join(parts)


def _encode_request(spans, keys: _KeyCache, cache: dict) -> bytes:
    """``encode_spans(spans).SerializePartialToString()``, written directly (see above). ``cache``: encoded
    resources and scopes by object (bounded by the caller)."""
    grouped: dict = {}
    first = spans[0] if spans else None
    if first is not None and all(
        s.resource is first.resource and s.instrumentation_scope is first.instrumentation_scope for s in spans
    ):
        # The usual batch: one resource object, one scope object (ours). The SDK groups by equality, which hashes
        # the resource per span (a JSON dump of its attributes); one object is one group all the same.
        grouped[first.resource] = {first.instrumentation_scope or None: [_span_bytes(s, keys) for s in spans]}
    else:
        for span in spans:
            scope = span.instrumentation_scope or None
            grouped.setdefault(span.resource, {}).setdefault(scope, []).append(_span_bytes(span, keys))
    out = []
    for resource, scopes in grouped.items():
        rs = []
        r = cache.get(("r", resource))
        if r is None:
            r = cache[("r", resource)] = _len_field(b"\x0a", _encode_resource(resource).SerializeToString())
        rs.append(r)
        for scope, span_bytes in scopes.items():
            s = cache.get(("s", scope))
            if s is None:
                s = cache[("s", scope)] = _len_field(b"\x0a", _encode_instrumentation_scope(scope).SerializeToString())
            ss = [s]
            ss += [b"\x12" + _varint(len(b)) + b for b in span_bytes]
            if scope is not None and scope.schema_url:
                ss.append(_len_field(b"\x1a", scope.schema_url.encode()))
            rs.append(_len_field(b"\x12", b"".join(ss)))
        if resource.schema_url:
            rs.append(_len_field(b"\x1a", resource.schema_url.encode()))
        out.append(_len_field(b"\x0a", b"".join(rs)))
    return b"".join(out)


class _OtlpSpanExporter(OTLPSpanExporter):
    """``OTLPSpanExporter`` (OTLP/HTTP, protobuf) whose request body is ``_encode_request``'s: the same bytes as the
    SDK's ``encode_spans(spans).SerializePartialToString()`` for a fraction of the worker thread's CPU. Everything
    else is the SDK's: configuration, the HTTP client (retries, timeout, compression), the exporter's metrics.
    ``export`` is the SDK's ``export`` (1.45) with that encoder: its steps, logs, metrics and results, a request
    over ``max_request_size`` included. It is the SDK's own after shutdown and when this SDK version lacks what it
    uses."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._keys = _KeyCache()
        self._encoded: dict = {}
        self._direct = _is_request_too_large is not None and all(
            hasattr(self, n) for n in ("_metrics", "_client", "_max_request_size", "_shutdown")
        )

    def export(self, spans) -> SpanExportResult:
        if not self._direct or self._shutdown:
            return super().export(spans)
        with self._metrics.export_operation(len(spans)) as result:
            try:
                if len(self._encoded) > 64:  # resources and scopes: one or two in practice
                    self._encoded.clear()
                data = _encode_request(spans, self._keys, self._encoded)
            except Exception as error:
                _logger.error("Failed to encode span batch: %s", error)
                result.error = error
                return SpanExportResult.FAILURE
            if _is_request_too_large(data, self._max_request_size):
                _logger.warning(
                    "Dropping span batch: serialized size %d bytes exceeds max_request_size %d bytes.",
                    len(data),
                    self._max_request_size,
                )
                result.error = RequestPayloadTooLargeError(
                    f"Serialized span request size {len(data)} bytes exceeds max_request_size "
                    f"{self._max_request_size} bytes."
                )
                return SpanExportResult.FAILURE
            export_result = self._client.export(data)
            if not export_result.success:
                result.error = export_result.error
                result.error_attrs = (
                    {HTTP_RESPONSE_STATUS_CODE: export_result.status_code}
                    if export_result.status_code is not None
                    else None
                )
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS


class _FastTracer:
    """What ``_FastSpan`` needs from our own provider: its id generator, resource, our processor and the scope, and
    its sampler's decision (``decide``, see ``_sampling_decision``); ``roots``: the same for a root span, or None
    when every root span is sampled (no decision to make: the usual case)."""

    __slots__ = ("decide", "ids", "processor", "provider", "rand", "resource", "roots", "scope")

    def __init__(self, provider: TracerProvider, processor: CountingBatchSpanProcessor, decide, roots):
        self.provider = provider
        self.decide = decide
        self.roots = roots
        self.resource = provider.resource
        self.ids = provider.id_generator
        # The SDK's RandomIdGenerator draws random.getrandbits(128) / (64) until non-zero: new_ids draws the same
        # itself (two Python calls less per request). Any other generator is called.
        self.rand = random.getrandbits if type(self.ids) is RandomIdGenerator else None
        self.processor = processor
        # What ``provider.get_tracer(TRACER_NAME)`` gives its spans (version "", no schema URL, no attributes).
        self.scope = InstrumentationScope(TRACER_NAME, "", None, None)

    def new_ids(self) -> tuple[int, int]:
        """A new span's trace id and span id, drawn as the SDK's tracer draws them (the trace id first; for the
        SDK's RandomIdGenerator, its two calls inlined: the same draws, in the same order)."""
        rand = self.rand
        if rand is None:
            ids = self.ids
            return ids.generate_trace_id(), ids.generate_span_id()
        tid = rand(128)
        while not tid:
            tid = rand(128)
        return tid, self.new_span_id()

    def new_span_id(self) -> int:
        """A span id alone (a child's: its trace id is the parent's), as ``new_ids`` draws it."""
        rand = self.rand
        if rand is None:
            return self.ids.generate_span_id()
        sid = rand(64)
        while not sid:
            sid = rand(64)
        return sid

    def start_span(self, name: str, attributes: dict, parent: SpanContext | None = None) -> _FastSpan | None:
        """A span, or None when the sampler drops it (its ids drawn all the same, as the SDK draws them for the
        non-recording span it returns then: the id sequence does not depend on the decisions)."""
        ids = self.ids
        if parent is None:
            roots = self.roots
            if roots is None:
                return _FastSpan(self, name, attributes, None)
            tid = ids.generate_trace_id()
            sampled = roots(None, tid)
        else:
            tid = parent.trace_id
            sampled = self.decide(parent, tid)
        if sampled:
            return _FastSpan(self, name, attributes, parent, tid)
        ids.generate_span_id()
        return None


_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_INTERNAL = SpanKind.INTERNAL
_TRACE_ID_MAX = 2**128 - 1
_SPAN_ID_MAX = 2**64 - 1
_UNSET = Status(StatusCode.UNSET)


def _plain(cls, fill, sample_args: tuple):
    """``fill`` (``*args -> instance``, filling the instance dict directly) when it builds what ``cls(*args)``
    builds for ``sample_args``: the same class, the same instance dict (keys in the same order, equal values), and
    nothing else. Otherwise ``cls`` itself. The SDK's ``Event`` and ``ReadableSpan`` constructors only store their
    arguments (through one or two Python-level ``__init__``s: half an Event's cost, a third of a ReadableSpan's);
    checking here, once, keeps the shortcut honest should an SDK version compute or validate anything there."""
    try:
        want, got = cls(*sample_args), fill(*sample_args)
        # Nothing kept outside the instance dict: no slots in the class or its bases (abc.ABC's empty ones aside).
        slotted = any(set(vars(k).get("__slots__", ())) - {"__dict__", "__weakref__"} for k in cls.__mro__)
        same = type(got) is cls and not slotted and list(vars(got).items()) == list(vars(want).items())
    except Exception:
        same = False
    return fill if same else cls


# Plain attribute stores, in the constructors' order (not the instance __dict__: touching it would give every
# instance a dict object of its own, one more object for the cyclic GC to track).
def _fill_event(name, attributes, timestamp, _new=object.__new__, _cls=Event):
    e = _new(_cls)
    e._name = name
    e._timestamp = timestamp
    e._attributes = attributes
    return e


def _fill_readable(
    name, context, parent, resource, attributes, events, links, kind, info, status, start, end, scope,
    _new=object.__new__, _cls=ReadableSpan,
):  # fmt: skip
    s = _new(_cls)
    s._name = name
    s._context = context
    s._kind = kind
    s._instrumentation_info = info
    s._instrumentation_scope = scope
    s._parent = parent
    s._start_time = start
    s._end_time = end
    s._attributes = attributes
    s._events = events
    s._links = links
    s._resource = resource
    s._status = status
    return s


# Event(name, attributes, timestamp) and ReadableSpan(13 positional arguments, in __init__'s order), as the fast
# path builds them (see _plain). The samples are arbitrary distinct values: only what gets stored is compared.
_make_event = _plain(Event, _fill_event, ("kv.sample", {"k": 1}, 7))
_make_readable = _plain(
    ReadableSpan,
    _fill_readable,
    (
        "kv.sample",
        SpanContext(1, 2, False, _SAMPLED, DEFAULT_TRACE_STATE),
        SpanContext(1, 3, False, _SAMPLED, DEFAULT_TRACE_STATE),
        Resource({"k": "v"}),
        {"k": 1},
        [],
        (),
        SpanKind.INTERNAL,
        None,
        _UNSET,
        5,
        6,
        InstrumentationScope(TRACER_NAME, "", None, None),
    ),
)


class _FastSpan:
    """A span of our own provider while it lives: a plain record, ended into one ``ReadableSpan`` for our processor.

    Implements the part of the SDK ``Span`` API this module uses (``set_attribute``, ``set_attributes``,
    ``add_event``, ``set_status``, ``end``, ``get_span_context``, ``is_recording``), with the SDK span's results
    under the conditions ``OtelExporter`` checks before using it (see ``_fast_tracer``): sampled (built only when
    the provider's sampler, decided by ``_FastTracer.start_span``/``OtelExporter._start``, samples it), ids from
    the provider's id generator, times from ``time.time_ns``, no attribute to trim (the limits leave room for all
    of ours; events are bounded by ``OtelExporter`` itself). Not thread-safe: used under the exporter's lock. What
    it skips: the sampler call, ``SpanLimits``/``BoundedAttributes`` copies and checks, the span's lock, and the
    provider's ``on_start``/``on_end`` fan-out (the span goes to our ``CountingBatchSpanProcessor`` alone).
    """

    __slots__ = (
        "_ctx",
        "_tracer",
        "attributes",
        "end_time",
        "events",
        "name",
        "parent",
        "span_id",
        "start_time",
        "status",
        "trace_id",
    )

    def __init__(self, tracer: _FastTracer, name: str, attributes: dict, parent: SpanContext | None, trace_id: int = 0):
        ids = tracer.ids
        self._tracer = tracer
        self.name = name
        self.parent = parent
        if not trace_id:  # else drawn already (a sampling decision read it)
            trace_id = ids.generate_trace_id() if parent is None else parent.trace_id
        self.trace_id = trace_id
        self.span_id = ids.generate_span_id()
        self.attributes = attributes  # owned by the span from here on
        self.events: list = []
        self.status = _UNSET
        self._ctx: SpanContext | None = None
        self.end_time: int | None = None
        self.start_time = time.time_ns()

    def get_span_context(self) -> SpanContext:
        ctx = self._ctx
        if ctx is None:
            # What SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED) builds, without its
            # defaults handling (is_valid computed the same way).
            tid, sid = self.trace_id, self.span_id
            valid = 0 < tid <= _TRACE_ID_MAX and 0 < sid <= _SPAN_ID_MAX
            # A child carries its parent's trace state, as the SDK's samplers hand it on.
            state = DEFAULT_TRACE_STATE if self.parent is None else self.parent.trace_state
            ctx = self._ctx = tuple.__new__(SpanContext, (tid, sid, False, _SAMPLED, state, valid))
        return ctx

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value) -> None:
        if self.end_time is None:
            self.attributes[key] = value

    def set_attributes(self, attributes: dict) -> None:
        if self.end_time is None:
            self.attributes.update(attributes)

    def add_event(self, name: str, attributes: dict | None = None, timestamp: int | None = None) -> None:
        if self.end_time is None:
            self.events.append(_make_event(name, attributes, time.time_ns() if timestamp is None else timestamp))

    def set_status(self, status: Status) -> None:
        if self.end_time is None:
            self.status = status

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return  # ended once, exported once (the SDK only logs a second end)
        self.end_time = time.time_ns() if end_time is None else end_time
        tracer = self._tracer
        # Positional, in ReadableSpan.__init__'s order (cheaper than keywords): name, context, parent, resource,
        # attributes, events, links, kind, instrumentation_info, status, start_time, end_time, scope.
        tracer.processor.admit(
            _make_readable(
                self.name,
                self.get_span_context(),
                self.parent,
                tracer.resource,
                self.attributes,
                self.events,  # no copy: nothing is added once ended, and ReadableSpan.events hands out a tuple
                (),
                SpanKind.INTERNAL,
                None,
                self.status,
                self.start_time,
                self.end_time,
                tracer.scope,
            )
        )


class _Req:
    """An open request span (an SDK span: a provider passed in, or a sampler or limits the fast path leaves to the
    SDK) and what will be set on it at the end. ``_FastReq`` is the same record holding the span itself."""

    __slots__ = (
        "allocated",
        "committed",
        "cur_allocated",
        "cur_committed",
        "decode_steps",
        "dropped",
        "evicted",
        "mark",
        "n_events",
        "parent",
        "span",
        "violations",
    )
    sampled = True  # the sampler's decision is the span's (the SDK's spans) or made at the start (_Unsampled)

    def __init__(self, span, parent: SpanContext | None = None):
        self.span = span
        self.parent = parent  # the engine's span of the request (set_parent), or None
        # Reported: the record as allocations and checked writes left it. Current: the ledger's values now
        # (frees included), what the next allocation's per-request share is measured from.
        self.allocated = self.committed = self.evicted = 0
        self.cur_allocated = self.cur_committed = 0
        self.decode_steps = self.n_events = self.dropped = self.violations = 0
        # seq of the latest event that set cur_*: a free skipped after it (bus.skipped_frees) moved them since.
        self.mark = 0

    def add_event(self, name: str, attrs: dict) -> None:
        self.span.add_event(name, attrs)

    def set_status(self, status: Status) -> None:
        self.span.set_status(status)

    def context(self) -> SpanContext:
        return self.span.get_span_context()

    def release(self, attrs: dict | None, held: int, peak: int) -> SpanContext:
        """The request was released: its ``kv.release`` event (``attrs``; None: dropped), then ``finish``. Returns
        the span's context."""
        if attrs is not None:
            self.span.add_event(EV_RELEASE, attrs)
        self.finish(held, peak)
        return self.span.get_span_context()

    def finish(self, held: int | None = None, peak: int | None = None, *, at_shutdown: bool = False) -> None:
        """Set the final attributes (in the order below) and end the span."""
        span = self.span
        if at_shutdown:
            span.set_attribute("kv.open_at_shutdown", True)
        # Events the SDK itself evicted (a provider's limit we could not read: see _bound_by_provider_limits), and
        # ours, counted in the span's dropped events too (an SDK span's bounded list), so that the two agree.
        dropped = self.dropped + (getattr(span, "dropped_events", 0) or 0)
        if self.dropped:
            kept = getattr(span, "_events", None)
            if isinstance(kept, BoundedList):
                kept.dropped += self.dropped
        attrs = {
            "kv.allocated_len": self.allocated,
            "kv.committed_len": self.committed,
            "kv.swa_evicted_seqlen": self.evicted,
            "kv.violations": self.violations,
            "kv.decode_steps": self.decode_steps,
            "kv.events_dropped": dropped,
        }
        if peak is not None:
            attrs["kv.pages.peak"] = peak
        if held is not None:
            attrs["kv.pages.held_at_release"] = held
        span.set_attributes(attrs)
        span.end()


def _with_dropped(events: list, dropped: int) -> BoundedList:
    """``events`` as the SDK span's bounded list holding them, ``dropped`` more counted as dropped: what an SDK span
    that dropped them would hand its exporters (``ReadableSpan.dropped_events``, OTLP ``dropped_events_count``)."""
    kept = BoundedList.from_seq(None, events)
    kept.dropped = dropped
    return kept


class _FastReq(_Req):
    """A request span of the fast path (see ``_FastSpan``, whose results it gives) and its record in one object:
    the start attributes are kept as values, the events in a list, and ``finish`` builds the span's one attribute
    dict and its ``ReadableSpan`` at the end (no span object lives in between). ``span`` is None. Not thread-safe:
    used under the exporter's lock; finished once (the exporter drops it from its open requests as it does)."""

    __slots__ = ("ctx", "events", "id_attr", "page_size", "start_time", "status", "tracer")

    def __init__(self, tracer: _FastTracer, id_attr, page_size: int, tid: int = 0, sid: int = 0, parent=None):
        # ``span`` is left unset: nothing reads it (the methods below replace _Req's).
        self.allocated = self.committed = self.evicted = 0
        self.cur_allocated = self.cur_committed = 0
        self.decode_steps = self.n_events = self.dropped = self.violations = 0
        # seq of the latest event that set cur_*: a free skipped after it (bus.skipped_frees) moved them since.
        self.mark = 0
        self.tracer = tracer
        self.id_attr = id_attr
        self.page_size = page_size
        if not tid:  # else drawn by the caller (a sampling decision read the trace id)
            tid, sid = tracer.new_ids()
        self.parent = parent  # the engine's span of the request (set_parent), or None: a root span
        # What SpanContext(tid, sid, is_remote=False, trace_flags=_SAMPLED) builds (see _FastSpan.get_span_context).
        valid = 0 < tid <= _TRACE_ID_MAX and 0 < sid <= _SPAN_ID_MAX
        state = DEFAULT_TRACE_STATE if parent is None else parent.trace_state
        self.ctx = tuple.__new__(SpanContext, (tid, sid, False, _SAMPLED, state, valid))
        self.events: list = []
        self.status = _UNSET
        self.start_time = time.time_ns()

    def add_event(self, name: str, attrs: dict) -> None:
        self.events.append(_make_event(name, attrs, time.time_ns()))

    def set_status(self, status: Status) -> None:
        self.status = status

    def context(self) -> SpanContext:
        return self.ctx

    def release(self, attrs: dict | None, held: int, peak: int) -> SpanContext:
        # A release builds the span itself (finish() serves every other end): once per request. The release event
        # and the span's end share one clock read (the same moment: the release ends the span).
        now = time.time_ns()
        events = self.events
        if attrs is not None:
            events.append(_make_event(EV_RELEASE, attrs, now))
        if self.dropped:  # rare: the span's dropped events count says what kv.events_dropped says
            events = _with_dropped(events, self.dropped)
        tracer = self.tracer
        tracer.processor.admit(
            _make_readable(
                SPAN_REQUEST,
                self.ctx,
                self.parent,
                tracer.resource,
                {
                    "kv.request.id": self.id_attr,
                    "kv.page_size": self.page_size,
                    "kv.allocated_len": self.allocated,
                    "kv.committed_len": self.committed,
                    "kv.swa_evicted_seqlen": self.evicted,
                    "kv.violations": self.violations,
                    "kv.decode_steps": self.decode_steps,
                    "kv.events_dropped": self.dropped,
                    "kv.pages.peak": peak,
                    "kv.pages.held_at_release": held,
                },
                events,
                (),
                _INTERNAL,
                None,
                self.status,
                self.start_time,
                now,
                tracer.scope,
            )
        )
        return self.ctx

    def finish(self, held: int | None = None, peak: int | None = None, *, at_shutdown: bool = False) -> None:
        # Every end but a release (which release() builds itself): one dict, keys in the order the SDK span's would
        # have, the start attributes, then what is set at the end.
        attrs = {"kv.request.id": self.id_attr, "kv.page_size": self.page_size}
        if at_shutdown:
            attrs["kv.open_at_shutdown"] = True
        attrs["kv.allocated_len"] = self.allocated
        attrs["kv.committed_len"] = self.committed
        attrs["kv.swa_evicted_seqlen"] = self.evicted
        attrs["kv.violations"] = self.violations
        attrs["kv.decode_steps"] = self.decode_steps
        attrs["kv.events_dropped"] = self.dropped
        if peak is not None:
            attrs["kv.pages.peak"] = peak
        if held is not None:
            attrs["kv.pages.held_at_release"] = held
        tracer = self.tracer
        # Positional, in ReadableSpan.__init__'s order (see _FastSpan.end).
        tracer.processor.admit(
            _make_readable(
                SPAN_REQUEST,
                self.ctx,
                self.parent,
                tracer.resource,
                attrs,
                _with_dropped(self.events, self.dropped) if self.dropped else self.events,
                (),
                SpanKind.INTERNAL,
                None,
                self.status,
                self.start_time,
                time.time_ns(),
                tracer.scope,
            )
        )


class _Unsampled(_Req):
    """A request whose span the fast path's sampler dropped: its context (ids drawn, not sampled) and the record's
    counters, and nothing else. No span is built, no event kept, nothing handed to the processor; the handlers
    skip the span events' attributes for it. ``trace_id_for`` gives None for it (see ``_trace_hex``); a violation
    span in its trace after its release is decided by the sampler against this context (ParentBased: dropped).
    A child of the engine's span (``set_parent``) keeps that span's trace id and trace state."""

    __slots__ = ("ctx",)
    sampled = False

    def __init__(self, tid: int, sid: int, parent: SpanContext | None = None):
        _Req.__init__(self, None, parent)  # the counters; no span
        trace_state = DEFAULT_TRACE_STATE if parent is None else parent.trace_state
        valid = 0 < tid <= _TRACE_ID_MAX and 0 < sid <= _SPAN_ID_MAX
        self.ctx = tuple.__new__(SpanContext, (tid, sid, False, _NOT_SAMPLED, trace_state, valid))

    def add_event(self, name: str, attrs: dict) -> None:
        pass

    def set_status(self, status: Status) -> None:
        pass

    def context(self) -> SpanContext:
        return self.ctx

    def release(self, attrs: dict | None, held: int, peak: int) -> SpanContext:
        return self.ctx

    def finish(self, held: int | None = None, peak: int | None = None, *, at_shutdown: bool = False) -> None:
        pass


class OtelExporter:
    """Subscribe to ``alloc``'s events and trace its requests. See the module docstring for the contract."""

    name = "otel"  # the bus counts what this sink refused under this name
    # What the spans read: the wrapper then skips building page deltas for us.
    event_types = frozenset(
        {ev.Alloc, ev.LedgerUpdate, ev.LedgerWrite, ev.SwaEvict, ev.RequestReleased, ev.ViolationEvent}
    )
    # A decode is counted, and its requests' records taken, from the call's LedgerUpdate: alloc_decode's Alloc
    # events are not read (ignored when another sink has them built), so the wrapper need not build them for us.
    decode_allocs = False
    # A free's LedgerUpdate only moves the current values (cur_*), which matter for the request's next allocation
    # alone: the wrapper keeps them in bus.skipped_frees instead, read at that allocation (this sink runs on the
    # wrapper's thread, as that requires), and a free call delivers no batch to us.
    free_ledgers = False
    # Nor each decode's LedgerUpdate: the wrapper folds a run of decodes of one batch into one DecodeFold, built
    # before anything else changes those requests' values, so that on its own a decode builds no event for us
    # either (the decode fold below is then the wrapper's). When another sink reads the per-decode updates (or
    # verification is deferred) they come as before and are folded here.
    decode_ledgers = False

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
        self._id_attr = _attr_value if self._hasher is None else self._hasher
        self._alloc = alloc
        self._ledger = alloc.ledger
        self._skipped_frees = {}  # the bus keeps no skipped frees any more: every free's update is delivered
        self._ps = int(alloc.page_size)
        self._max_events = max_events_per_span
        self._owns_provider = tracer_provider is None
        self._span_exporters: list = []  # our own provider's, each a CountingSpanExporter
        self._counting = counting_exporter
        self._limits: SpanLimits | None = None
        if tracer_provider is None:
            tracer_provider = self._build_provider(endpoint, span_exporter, sampler)
        self._provider = tracer_provider
        if not self._owns_provider:
            self._bound_by_provider_limits(tracer_provider)
        self._tracer = tracer_provider.get_tracer(TRACER_NAME)
        self._fast = self._fast_tracer()
        # Tracing that can produce no span (the SDK disabled: a no-op tracer; our provider's sampler dropping every
        # span of ours): the exporter then subscribes to nothing and costs the engine nothing.
        self._off = (
            isinstance(self._tracer, trace.NoOpTracer)
            or (self._fast is not None and self._fast.roots is not None and _samples_nothing(tracer_provider.sampler))
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
        # Consecutive decode steps of the same requests in the same order (one batch() block, or the next blocks
        # of an unchanged batch: the rids tuples are equal, not necessarily the same object), folded:
        # [rids tuple, latest LedgerUpdate, decodes not yet applied]; when all their spans are already open, the
        # first decode is folded too (one pass over the batch per run of equal decodes, at the flush). Applied to
        # the requests' records before any other event this sink reads them for is handled (and at shutdown), so
        # every reader of those records sees what per-step updates would have left; events it does not read (Free,
        # StepBoundary) leave the fold open, and so do two it reads without reading a record's values (a LedgerWrite
        # and a SwaEvict of an open request: an SWA eviction, about one a step in a sliding-window engine): the
        # write is kept in the fold's fourth item, [(record, column, value, seq)...], and the flush replays it
        # after the decodes' values, where per-event updates would have left it (see _flush_decode).
        # Valid while the set of open spans is unchanged since the tuple's requests were all found open
        # (``_open_version``). Equal tuples name the same requests: ``==`` on rids is the open dict's key match.
        self._dec: list | None = None
        self._dec_version = -1
        self._open_version = 0
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
        # Attached mid-run: the ledger values of the requests that already hold KV, what their next allocation's
        # share is measured from (a page-size-1 decode is told from a prefill by it); taken once, here.
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
        exporters = _env_span_exporters(endpoint) if span_exporter is None else [span_exporter]
        self._span_exporters = [
            e if isinstance(e, CountingSpanExporter) else CountingSpanExporter(e) for e in exporters
        ]
        # One batch processor per exporter, as the SDK's configuration builds them (OTEL_TRACES_EXPORTER=a,b);
        # none for OTEL_TRACES_EXPORTER=none (tracing is then off: nothing would be exported).
        processors = [CountingBatchSpanProcessor(e) for e in self._span_exporters]
        if len(processors) == 1:
            self._counting = processors[0]
        elif processors:
            self._counting = _CountingProcessors(processors)
        limits = SpanLimits()
        if limits.max_events is not None and limits.max_events < self._max_events:
            if _EVENT_LIMIT_ENV in os.environ:
                # Set lower on purpose: it bounds our spans, by our policy (the first events and kv.release kept,
                # the others counted in kv.events_dropped and the span's dropped events), so the SDK trims nothing.
                self._max_events = limits.max_events
            else:  # the SDK's default (128) below max_events_per_span: raised to it
                limits = SpanLimits(max_events=self._max_events)
        self._limits = limits
        # sampler None: the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (default parentbased_always_on).
        provider = TracerProvider(resource=resource, span_limits=limits, sampler=sampler)
        for processor in processors:
            provider.add_span_processor(processor)
        return provider

    def _bound_by_provider_limits(self, provider) -> None:
        """A provider passed in whose ``SpanLimits.max_events`` is below ``max_events_per_span``: the SDK would evict
        a span's oldest events (its first prefill) past that limit. Our bound becomes the provider's limit instead
        (our policy: the first events and ``kv.release`` kept, the rest counted), with one warning naming both."""
        n = getattr(getattr(provider, "_span_limits", None), "max_events", None)
        if isinstance(n, int) and not isinstance(n, bool) and 0 <= n < self._max_events:
            _logger.warning(
                "tracer_provider's SpanLimits.max_events (%d) is below max_events_per_span (%d): each kv.request span "
                "keeps at most %d events (the first ones and kv.release); the others are counted in "
                "kv.events_dropped and in the span's dropped events count",
                n,
                self._max_events,
                n,
            )
            self._max_events = n

    def _fast_tracer(self) -> _FastTracer | None:
        """Spans as ``_FastSpan`` records when they would come out the same as the SDK's: our own provider, enabled
        (not ``OTEL_SDK_DISABLED``), a sampler whose decision ``_sampling_decision`` makes exactly (any that
        ``OTEL_TRACES_SAMPLER`` names) and limits that trim nothing of ours. Otherwise None: the SDK's spans, which
        apply the sampler and limits."""
        limits = self._limits
        if not self._owns_provider or limits is None or type(self._tracer) is not Tracer or self._counting is None:
            return None
        sampler = self._provider.sampler
        decide = _sampling_decision(sampler)
        if decide is None:
            return None
        if limits.max_attribute_length is not None or limits.max_span_attribute_length is not None:
            return None
        for n in (limits.max_span_attributes, limits.max_event_attributes):
            if n is not None and n < _FAST_MIN_ATTRIBUTES:
                return None
        if limits.max_events is not None and limits.max_events < self._max_events:
            return None
        # Every root span sampled: no decision to make for one (the usual case: only a parent can say otherwise).
        every_root = sampler is sampling.DEFAULT_ON or sampler is sampling.ALWAYS_ON
        return _FastTracer(self._provider, self._counting, decide, None if every_root else decide)

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
        ctx = _parent_context(parent)
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
            if _put_recent(parents, rid, ctx, _MAX_PARENTS):
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
                return _trace_hex(r.context())
            if self._closed:
                return None
            if rid in self._ledger:
                return _trace_hex(self._start(rid).context())
            return _trace_hex(self._ended.get(rid))

    def _trace_hook(self, rid) -> str | None:
        """``alloc.trace_id_for`` while this exporter is attached: ``trace_id_for``, else the hook it replaced
        (another exporter's, attached before it), which shutdown puts back."""
        tid = self.trace_id_for(rid)
        if tid is None and self._prev_hook is not None:
            with contextlib.suppress(Exception):  # a foreign hook must not break the violation being reported
                return self._prev_hook(rid)
        return tid

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export the ended spans now, waiting at most ``timeout_millis``. Blocks: never call it on the engine
        thread's hot path. False when it timed out or the provider reported a failure."""
        flush = getattr(self._provider, "force_flush", None)
        if flush is None:
            return True
        done, ok = _run_bounded(lambda: flush(timeout_millis), timeout_millis / 1000, "force_flush")
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
            self._flush_decode()
            self._open_version += 1
            still_open, self._open = self._open, {}
            for r in still_open.values():
                r.finish(at_shutdown=True)
        timeout_s = timeout_millis / 1000
        if not self._owns_provider:
            return self.force_flush(timeout_millis)
        done, _ = _run_bounded(self._provider.shutdown, timeout_s, "shutdown")
        if not done:
            # Abandon what is still queued: the worker's further exports fail at once instead of retrying. Not
            # waited for: an exporter whose shutdown waits for its hanging export must not hold us past the time.
            for exporter in self._span_exporters:
                _run_bounded(exporter.shutdown, 0.0, "span exporter shutdown")
        return done

    # -- the sink ---------------------------------------------------------------------------------------------
    def __call__(self, batch) -> bool:
        with self._lock:
            if self._closed:
                return False
            later = self._later  # empty between batches
            try:
                handlers = self._handlers
                # Each handler that reads a request's record applies the folded decodes first (_flush_decode); an
                # event we do not read (Free, StepBoundary, ...) has no handler: no record is read or moved.
                for e in batch:
                    h = handlers.get(type(e))
                    if h is not None:
                        h(e, later)
                if later:
                    limit = self._max_events - 1  # _add_event, inlined
                    for r, name, attrs in later:
                        if r.n_events < limit:
                            r.n_events += 1
                            r.add_event(name, attrs)
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
        fast = self._fast
        if fast is not None:
            if parent is not None:
                tid = parent.trace_id  # the SDK draws only the span id of a child, after its sampling decision
                sampled = fast.decide(parent, tid)
                sid = fast.new_span_id()
                if sampled:
                    r = _FastReq(fast, self._id_attr(rid), self._ps, tid, sid, parent)
                else:
                    r = _Unsampled(tid, sid, parent)
            elif fast.roots is None:
                r = _FastReq(fast, self._id_attr(rid), self._ps)
            else:
                tid, sid = fast.new_ids()
                if fast.roots(None, tid):
                    r = _FastReq(fast, self._id_attr(rid), self._ps, tid, sid)
                else:
                    r = _Unsampled(tid, sid)
        else:
            r = _Req(
                self._tracer.start_span(
                    SPAN_REQUEST,
                    # A root span unless the engine named its own span of the request: the engine's current context
                    # (whatever runs at the allocator call) is no parent of a request's KV.
                    context=Context()
                    if parent is None
                    else trace.set_span_in_context(NonRecordingSpan(parent), Context()),
                    kind=SpanKind.INTERNAL,
                    attributes={"kv.request.id": self._id_attr(rid), "kv.page_size": self._ps},
                ),
                parent,
            )
        self._open[rid] = r
        self._open_version += 1
        self._ended.pop(rid, None)
        return r

    def _req(self, rid) -> _Req:
        r = self._open.get(rid)
        return r if r is not None else self._start(rid)

    def _add_event(self, r: _Req, name: str, attrs: dict, *, reserved: bool = False) -> None:
        limit = self._max_events if reserved else self._max_events - 1
        if r.n_events < limit:
            r.n_events += 1
            r.add_event(name, attrs)
        else:
            r.dropped += 1

    # -- event handlers ---------------------------------------------------------------------------------------
    def _on_ledger_update(self, e: ev.LedgerUpdate, later: list) -> None:
        op = e.op
        if op in DECODE_OPS:
            d = self._dec
            rids = e.rids
            if d is not None and (d[0] is rids or d[0] == rids) and self._dec_version == self._open_version:
                d[1] = e  # the hot path: the next decode of the same requests is folded (see __init__)
                d[2] += 1
                return
            if d is not None:
                self._flush_decode()
            if all(map(self._open.__contains__, rids)):
                # Every request's span is open: this decode starts a fold without touching them; the one pass over
                # the batch is the flush's, however many equal decodes follow.
                self._dec = [rids, e, 1, []]
                self._dec_version = self._open_version
                return
        else:
            if self._dec is not None:
                self._flush_decode()
            if op not in _ALLOC_OPS:
                # Frees: a request torn down before its release keeps its last allocated record on the span; only
                # the current values move (a retracted request's next prefill is measured from them).
                get = self._open.get
                seq = e.seq
                for rid, a, c in zip(e.rids, e.allocated.tolist(), e.committed.tolist()):
                    r = get(rid)
                    if r is not None:
                        r.cur_allocated, r.cur_committed = a, c
                        r.mark = seq
                return
        if op in DECODE_OPS:
            # A decode naming a request with no open span (or None): one pass now, opening spans as needed, counted
            # here, not per Alloc event; the decodes after it fold.
            self._apply_decodes(e, 1)
            self._dec = [e.rids, e, 0, []]
            self._dec_version = self._open_version
            return
        alloc, comm = e.allocated.tolist(), e.committed.tolist()
        pending = self._pending
        get = self._open.get
        seq = e.seq
        skipped = self._skipped_frees
        for rid, a, c, v, slot in zip(e.rids, alloc, comm, e.evicted.tolist(), e.slots.tolist() if skipped else _NONES):
            if rid is None:
                continue
            r = get(rid)
            if r is None:
                r = self._start(rid)
                if self._seed:
                    first = self._seed.pop(rid, None)
                    if first is not None:
                        r.cur_allocated, r.cur_committed = first
            if skipped:
                # A free since the record's latest update whose LedgerUpdate was not built (free_ledgers = False):
                # the values it left are what this allocation's share is measured from, as its update would have
                # set them. Before this update only (mark < seq): a free later in the same call is not yet.
                f = skipped.get(slot)
                if f is not None and r.mark <= f[0] < seq:
                    r.cur_allocated, r.cur_committed = f[1], f[2]
            pending[rid] = (c - r.cur_committed, a - r.cur_allocated, r.cur_committed, r)
            r.allocated, r.committed, r.evicted = a, c, v
            r.cur_allocated, r.cur_committed = a, c
            r.mark = seq

    def _flush_decode(self) -> None:
        """Apply the folded decode steps (see ``__init__``): each request's record as the latest decode left it,
        then the deferred ledger writes, each where the per-event order puts it: one made after the latest folded
        decode (seq above it), or to a request the decodes do not name, is applied; one made before it, to a
        request it names, is what that decode's values replaced (the decode carries the ledger as of its call)."""
        d, self._dec = self._dec, None
        if d is None:
            return
        _, e, n, writes = d
        seq = e.seq
        if n:
            # map(get, ...) rather than get(rid) in the loop: one C call per request instead of a Python-level call.
            for r, a, c, v in zip(
                map(self._open.get, e.rids), e.allocated.tolist(), e.committed.tolist(), e.evicted.tolist()
            ):
                if r is None:
                    continue  # rid None (unattributed)
                r.allocated = r.cur_allocated = a
                r.committed = r.cur_committed = c
                r.evicted = v
                r.decode_steps += n
                r.mark = seq
        # Every request the fold names has mark == seq here (set above, or by the decode applied at once when the
        # fold began; a deferred write does not move mark until now), and no other request can: seq is the
        # latest decode's, and the writes are later than the fold's first decode.
        for r, column, value, wseq in writes:
            if wseq > seq or r.mark != seq:
                self._apply_write(r, column, value, wseq)

    def _on_decode_fold(self, e: ev.DecodeFold, later: list) -> None:
        """``e.n`` decodes of ``e.rids`` folded by the wrapper: each request's record as ``e`` leaves it (the values
        when the fold was built), ``e.n`` decode steps more, as that many per-decode updates would have left it;
        a request with no open span gets one now (its decodes are the first we hear of it)."""
        if self._dec is not None:
            self._flush_decode()
        self._apply_decodes(e, e.n)

    def _apply_decodes(self, e, n: int) -> None:
        """``n`` decodes of ``e.rids`` (a decode's LedgerUpdate, or a DecodeFold): each request's record as ``e``
        leaves it, ``n`` decode steps more; a request with no open span gets one (an unattributed one is skipped)."""
        get = self._open.get
        seq = e.seq
        for rid, a, c, v in zip(e.rids, e.allocated.tolist(), e.committed.tolist(), e.evicted.tolist()):
            r = get(rid)
            if r is None:
                if rid is None:
                    continue
                r = self._start(rid)
            r.allocated = r.cur_allocated = a
            r.committed = r.cur_committed = c
            r.evicted = v
            r.decode_steps += n
            r.mark = seq

    def _on_alloc(self, e: ev.Alloc, later: list) -> None:
        rids = e.rids
        if not rids:
            return  # not bound to requests: nothing to attribute
        op = e.op
        if op in DECODE_OPS:
            return  # counted from this call's ledger update
        if self._dec is not None:
            self._flush_decode()
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
            # The record this batch's ledger update found or opened (released by no event in between: both
            # come from the one allocation call).
            r = delta[3] if delta is not None else self._req(rid)
            if op == "alloc" and exact and delta[0] == 1 and delta[2] > 0:
                r.decode_steps += 1
                continue
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
        column = _LEDGER_FIELDS.get(e.field)
        if column is None or e.rid is None:
            return
        r = self._open.get(e.rid)
        if self._dec is not None:
            if r is not None:
                self._dec[3].append((r, column, e.new, e.seq))  # replayed by the flush (see __init__)
                return
            self._flush_decode()
        if r is None:
            r = self._start(e.rid)
        self._apply_write(r, column, e.new, e.seq)

    @staticmethod
    def _apply_write(r: _Req, column: str, value: int, seq: int) -> None:
        setattr(r, column, value)
        if column != "evicted":
            setattr(r, "cur_" + column, value)
            r.mark = seq

    def _on_swa_evict(self, e: ev.SwaEvict, later: list) -> None:
        if e.rid is None:
            return
        # Reads no record's values (its span event counts at the batch's end): an open request's leaves the fold
        # open. Opening a span first applies the fold, as every other event that changes the open set does.
        r = self._open.get(e.rid)
        if r is None:
            if self._dec is not None:
                self._flush_decode()
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
        if self._dec is not None:
            self._flush_decode()
        r = self._open.pop(e.rid, None)
        if self._seed:
            self._seed.pop(e.rid, None)
        if r is None:
            if self._parents:
                self._parents.pop(e.rid, None)  # a parent set for a request that never allocated
            return  # released without any traced event: nothing was allocated for it
        self._open_version += 1
        if r.parent is not None:  # a later span of this request (a re-prefill after a retraction) joins that trace
            _put_recent(self._ended_parents, e.rid, r.parent, _RECENT_ENDED)
        if r.sampled:
            if later:  # this batch's earlier events first, then the release in its reserved place
                for item in later:
                    if item[0] is r:
                        self._add_event(r, item[1], item[2])
                later[:] = [item for item in later if item[0] is not r]
            held, peak = e.pages_held, e.pages_peak
            if r.n_events < self._max_events:  # _add_event(..., reserved=True), inlined: once per request
                r.n_events += 1
                release = {"kv.pages_held": held, "kv.pages_peak": peak, "kv.step": e.step}
            else:
                r.dropped += 1
                release = None
            ctx = r.release(release, held, peak)
        else:
            ctx = r.ctx  # no span to end (nothing of it in ``later`` either)
        _put_recent(self._ended, e.rid, ctx, _RECENT_ENDED)  # its context, for later violations in its trace

    def _on_violation(self, e: ev.ViolationEvent, later: list) -> None:
        if self._dec is not None:
            self._flush_decode()
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
                r.set_status(Status(StatusCode.ERROR, f"{v.invariant}: {message}"))
            if r.sampled:
                later.append((r, EV_VIOLATION, attrs))
            return
        ctx = None
        if rid is not None:
            attrs["kv.request.id"] = self._id_attr(rid)
            ctx = self._ended.get(rid)
        if self._fast is not None:
            span = self._fast.start_span(SPAN_VIOLATION, dict(attrs), ctx)  # its own dict: the event keeps attrs
            if span is None:
                return  # the sampler dropped it
        else:
            parent = Context() if ctx is None else trace.set_span_in_context(NonRecordingSpan(ctx), Context())
            span = self._tracer.start_span(SPAN_VIOLATION, context=parent, kind=SpanKind.INTERNAL, attributes=attrs)
        span.add_event(EV_VIOLATION, attrs)
        span.set_status(Status(StatusCode.ERROR, f"{v.invariant}: {message}"))
        span.end()
