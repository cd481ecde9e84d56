"""Export of ended spans: which exporters ``OTEL_*`` names, and loss counting around the SDK's batch processor.

Contracts:
- ``CountingSpanExporter`` wraps any ``SpanExporter``: spans of an ``export`` that returned anything but SUCCESS, or
  raised, are counted in ``dropped``. It runs on the batch processor's worker thread; counts are read from any.
- ``CountingBatchSpanProcessor`` is the SDK's ``BatchSpanProcessor`` (its queue, thread and exporter calls) with an
  exact loss count, through public methods only: ``on_end`` hands a span on while fewer than ``max_queue_size``
  handed spans are unsettled (queued or in an export call), else refuses it and counts it in ``queue_full``. So
  the SDK's queue never overflows (the SDK would evict its oldest span; its own drop count is an opt-in internal
  metric, not a public number). ``dropped`` = failed exports' spans + ``queue_full``: never decreases.
- ``EventsDroppedSpanExporter`` (our own provider's exporters sit behind it) hands a ``kv.request`` span on with
  its dropped events count (OTLP ``dropped_events_count``) equal to ``kv.events_dropped``: the events our bound
  dropped are never the SDK span's, and no public API sets its count.
- Nothing here runs on the engine thread but ``on_end``: a lock, a comparison and the SDK's enqueue.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from importlib.metadata import entry_points
from urllib.parse import urlsplit, urlunsplit

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.sdk.util import BoundedList

__all__ = [
    "CountingBatchSpanProcessor",
    "CountingSpanExporter",
    "EventsDroppedSpanExporter",
    "env_span_exporters",
    "run_bounded",
]

_logger = logging.getLogger(__name__)

_BSP_DEFAULT_QUEUE = 2048  # the SDK's default OTEL_BSP_MAX_QUEUE_SIZE
_TRACES_EXPORTER_ENV = "OTEL_TRACES_EXPORTER"
_OTLP_PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_OTLP_BY_PROTOCOL = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}
_GRPC_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"


def traces_url(endpoint: str) -> str:
    """``endpoint=`` as the full OTLP/HTTP traces URL: a URL without a path gets ``/v1/traces`` (before its query)."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return urlunsplit(parts._replace(path="/v1/traces"))
    return endpoint


def _otlp_exporter_name() -> str:
    """``otlp`` as ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` names it: ``http/protobuf`` or unset (the specification's
    default) -> ``otlp_proto_http``, ``grpc`` -> ``otlp_proto_grpc``; anything else raises ``ValueError``."""
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


def env_span_exporters(endpoint: str | None) -> list:
    """The span exporters ``OTEL_TRACES_EXPORTER`` names, as the SDK's configuration reads it: unset, ``otlp``;
    ``none``, none; else a comma list (each once, in order) of ``otlp``, ``otlp_proto_http`` (the SDK's
    ``OTLPSpanExporter``), ``otlp_proto_grpc``, ``console`` or a name in the ``opentelemetry_traces_exporter`` entry
    points. An unknown name raises ``ValueError`` naming the variable. ``endpoint``: the OTLP endpoint, or None for
    the environment's."""
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
            out.append(OTLPSpanExporter(endpoint=traces_url(endpoint)) if endpoint else OTLPSpanExporter())
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


def env_queue_size() -> int:
    """``OTEL_BSP_MAX_QUEUE_SIZE`` as the SDK reads it (unparsable: logged, 2048); not positive: ``ValueError``."""
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


def run_bounded(fn, timeout_s: float, name: str):
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


def _reinit_after_fork(obj) -> None:
    """Call ``obj.at_fork_reinit()`` in every child forked after this, while ``obj`` lives (a weak reference)."""
    if hasattr(os, "register_at_fork"):
        ref = weakref.WeakMethod(obj.at_fork_reinit)

        def after_in_child() -> None:
            reinit = ref()
            if reinit is not None:
                reinit()

        os.register_at_fork(after_in_child=after_in_child)


class CountingSpanExporter(SpanExporter):
    """A ``SpanExporter`` that forwards to ``inner`` and counts what was lost at export.

    ``dropped``: spans of every ``export`` that returned anything but SUCCESS or raised (re-raised);
    ``failed_exports``: those calls; ``exported``: spans of the calls that succeeded. Thread-safe.

    With your own provider::

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
        # exported + dropped as one int, read without the lock by the processor's on_end (one read is atomic).
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
        """Spans whose export call finished, either way. Lock-free: never ahead of the true count (it only grows)."""
        return self._settled

    def at_fork_reinit(self) -> None:
        # The parent's lock may have been held by its export thread at the fork; that thread does not exist here.
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


class EventsDroppedSpanExporter(SpanExporter):
    """Forwards to ``inner``; a span whose ``kv.events_dropped`` exceeds the events the SDK itself dropped goes as a
    copy (``ReadableSpan``'s public constructor) whose events list counts ``kv.events_dropped`` as dropped. Other
    spans pass as they are. Runs on the batch processor's worker thread, never on the engine's."""

    def __init__(self, inner: SpanExporter):
        self.inner = inner

    def export(self, spans) -> SpanExportResult:
        out = None
        for i, s in enumerate(spans):
            n = (s.attributes or {}).get("kv.events_dropped")
            if isinstance(n, int) and n > s.dropped_events:
                if out is None:
                    out = list(spans)
                out[i] = _with_dropped_events(s, n)
        return self.inner.export(spans if out is None else out)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        flush = getattr(self.inner, "force_flush", None)
        return True if flush is None else flush(timeout_millis)


def _with_dropped_events(span, dropped: int) -> ReadableSpan:
    events = BoundedList.from_seq(None, span.events)
    events.dropped = dropped
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=span.attributes,
        events=events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """A ``BatchSpanProcessor`` that loses no span without counting it (see the module docstring).

    Its exporter is wrapped in ``CountingSpanExporter`` (unless it is one). Spans refused because the queue is
    full, or handed after ``shutdown``, count in ``queue_full``. Not counted: spans left queued when the SDK's own
    shutdown wait runs out while an export still hangs (``OtelExporter.shutdown`` shuts the exporter down then,
    so that those exports fail at once, counted). In a child forked after it was built, the SDK empties the queue
    (the parent exports it); nothing handed is unsettled there any more. ``dropped`` never decreases.
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
            max_queue_size = env_queue_size()
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
        self._handed = counting.settled()  # a CountingSpanExporter passed in may have exported before
        self._queue_full = 0
        self._closed = False
        _reinit_after_fork(self)  # after the SDK's own hook (registered in its constructor), which empties the queue

    def at_fork_reinit(self) -> None:
        # Without this a child would count the parent's queued spans as unsettled and refuse its own as queue-full.
        self._count_lock = threading.Lock()
        self._handed = self.counting.settled()

    def on_end(self, span) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return  # the SDK's processor ignores unsampled spans too
        # A stale settled() only makes the queue look fuller (a span refused early, never an SDK queue overflow).
        settled = self.counting.settled()
        with self._count_lock:
            if self._closed or self._handed - settled >= self.max_queue_size:
                self._queue_full += 1
                return
            self._handed += 1
        super().on_end(span)

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


class CountingProcessors:
    """Several ``CountingBatchSpanProcessor``s (``OTEL_TRACES_EXPORTER=a,b``) counted as one: the sums (a span lost
    by two exporters counts twice: each exporter's loss is one)."""

    def __init__(self, processors: list):
        self.processors = processors

    queue_full = property(lambda self: sum(p.queue_full for p in self.processors))
    dropped = property(lambda self: sum(p.dropped for p in self.processors))
    exported = property(lambda self: sum(p.exported for p in self.processors))
    failed_exports = property(lambda self: sum(p.failed_exports for p in self.processors))
