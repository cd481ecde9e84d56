"""Prometheus exporter for an ``InstrumentedAllocator``: the metric catalog, nothing more.

``PrometheusExporter(alloc, *, registry=None, const_labels=None, multiprocess=None, refresh_interval=1.0,
clock=time.monotonic)`` subscribes one sink (``"prometheus"``) to ``alloc`` and registers the catalog in
``registry``; ``serve(port=0, addr="127.0.0.1")`` serves it (OpenMetrics when asked) and returns the port;
``close()`` stops serving, unsubscribes and unregisters (idempotent; also a context manager).

Modules, one job each:
- ``catalog``: names, types, help texts, labels, buckets (public, stable).
- ``running``: single-process sink, engine thread: events into plain running totals.
- ``collectors``: single-process, scrape time: families from the totals and from a snapshot.
- ``multiprocess``: ``PROMETHEUS_MULTIPROC_DIR`` mode: file-backed metrics, gauge refresh, disk-space reservation.
- ``exporter``: the class, its lifecycle and its HTTP server.

Values read through the registry are exact at every collection; the gauges and ``kvalloc_events_dropped_total``
(every sink's lost events, from ``alloc.bus.drop_counts()``) are computed from a snapshot at scrape time
(multiprocess mode: refreshed at step boundaries, at most once per ``refresh_interval``). The latest violation's
trace id is the exemplar of ``kvalloc_invariant_violations_total`` (single-process, OpenMetrics).
"""

from exporters.prometheus.catalog import (
    OP_DURATION_BUCKETS,
    OVERHEAD_BUCKETS,
    PREFIX,
    REQUEST_PAGES_BUCKETS,
    SINK_NAME,
)
from exporters.prometheus.exporter import (
    PrometheusExporter,
    _Sink,  # noqa: F401  (benchmarks.event_floor reads its declarations)
)

__all__ = [
    "OP_DURATION_BUCKETS",
    "OVERHEAD_BUCKETS",
    "PREFIX",
    "REQUEST_PAGES_BUCKETS",
    "SINK_NAME",
    "PrometheusExporter",
]
