"""The metric catalog: every family's name, type, help text and labels, and the histograms' bucket bounds.

Public and stable: the Grafana dashboard, the alert rules and users' queries read these names. Labels are bounded
(pool, state, invariant, op, sink, part, plus the caller's const labels); a request id is never a label.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from instrumented_alloc import stepstats

PREFIX = "kvalloc_"
SINK_NAME = "prometheus"

# Inner allocator calls take from about a microsecond (a host-side decode of a small batch) to milliseconds
# (a large prefill, or a free that sorts); 0.1 s catches pauses (GC, a device sync) without an open-ended +Inf.
OP_DURATION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 1e-1)
# The instrumentation's own host time per scheduler iteration: a microsecond (a step with nothing to check) to
# 10 ms (a GPU decode step: past it the overlap scheduler cannot hide it).
OVERHEAD_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
# Peak pages per request: 1 .. 4096 pages, doubling (a 4096-page request at page size 64 is 256k tokens).
REQUEST_PAGES_BUCKETS = tuple(float(2**i) for i in range(13))


class Family(NamedTuple):
    """One metric family: ``name`` without ``PREFIX`` (and without a counter's ``_total``), its own labels (the
    const labels come first), and for a gauge its multiprocess mode (see ``GAUGES``)."""

    name: str
    kind: str  # "counter", "histogram" or "gauge"
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    mode: str | None = None


# Counters and histograms fed by the wrapper's events, in exposition order.
VIOLATIONS = Family("invariant_violations", "counter", "Invariant violations seen, by invariant id.", ("invariant",))
FAILURES = Family("alloc_failures", "counter", "Allocations refused for lack of pages.", ("pool", "op"))
ALLOCATED = Family("pages_allocated", "counter", "Pages handed out.", ("pool",))
FREED = Family("pages_freed", "counter", "Pages released.", ("pool",))
EVICTED = Family("swa_evicted_tokens", "counter", "SWA tokens evicted (sliding window).")
OP_DURATION = Family(
    "op_duration_seconds", "histogram", "Wall time of the inner allocator call.", ("op",), OP_DURATION_BUCKETS
)
REQUEST_PAGES = Family(
    "request_pages",
    "histogram",
    "Peak pages held per request, observed when the request is released.",
    ("pool",),
    REQUEST_PAGES_BUCKETS,
)
OVERHEAD = Family(
    "overhead_seconds",
    "counter",
    "Host seconds the instrumentation spent on the engine's thread, by part (hooks, ledger, checks, exporters).",
    ("part",),
)
OVERHEAD_ITERATION = Family(
    "overhead_iteration_seconds",
    "histogram",
    "Host seconds the instrumentation added to one scheduler iteration (observed at each step boundary; its count "
    "is the iterations).",
    (),
    OVERHEAD_BUCKETS,
)
EVENT_FAMILIES = (
    VIOLATIONS,
    FAILURES,
    ALLOCATED,
    FREED,
    EVICTED,
    OP_DURATION,
    REQUEST_PAGES,
    OVERHEAD,
    OVERHEAD_ITERATION,
)

# Gauges, from a snapshot. Modes (multiprocess only; ranks differ by const labels, so a mode only decides how
# processes that share one label set combine, and whether a dead process's value stays):
# - "live*" everywhere: a gauge describes the state of a running allocator; once a process is marked dead its
#   pages, requests and ratios must not linger in the aggregate.
# - pages, requests, free runs, outside-window tokens: "livesum" (they are amounts: processes add up).
# - page size: "livemax" (a configuration constant, equal in every process; max is exact and, unlike
#   mostrecent, does not depend on the wall clock of the last write).
# - fragmentation ratios and the largest free run: "livemax" (a ratio or a maximum cannot be summed; the worst
#   process is what alerts must see, and mostrecent would flap between processes).
GAUGES = (
    Family(
        "pages",
        "gauge",
        "Pages by state (free/used/staged/reserved); the states sum to the pool's capacity.",
        ("pool", "state"),
        mode="livesum",
    ),
    Family("page_size_tokens", "gauge", "Tokens per KV page.", mode="livemax"),
    Family("requests_live", "gauge", "Requests that hold KV (kv_allocated_len > 0).", mode="livesum"),
    Family(
        "internal_fragmentation_ratio",
        "gauge",
        "1 - committed tokens / allocated slots of live requests.",
        ("pool",),
        mode="livemax",
    ),
    Family(
        "external_fragmentation_ratio",
        "gauge",
        "1 - largest free run / free pages (0 when nothing is free).",
        ("pool",),
        mode="livemax",
    ),
    Family("free_runs", "gauge", "Number of maximal runs of consecutive free pages.", ("pool",), mode="livesum"),
    Family("largest_free_run_pages", "gauge", "The longest run of consecutive free pages.", ("pool",), mode="livemax"),
    Family(
        "swa_outside_window_tokens",
        "gauge",
        "Tokens still holding SWA KV though outside the sliding window.",
        mode="livesum",
    ),
)
# Mirrors alloc.bus.drop_counts(): every sink's lost events, this exporter's included.
DROPPED = Family("events_dropped", "counter", "Events a sink could not take (refused or failed batches).", ("sink",))

# The ops whose failure series exist from the start (alert rules and rate() must see them before the first one).
ALLOC_OPS = ("alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail")
# Ops that touch only the SWA pool (their durations count once per call): defined with the step statistics.
SWA_ONLY_OPS = stepstats.SWA_ONLY_OPS

_RESERVED_LABELS = frozenset({"pool", "state", "invariant", "op", "sink", "part", "le", "quantile", "pid"})
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_MAX_EXEMPLAR_RUNES = 128  # OpenMetrics: label names + values of one exemplar


def check_const_labels(const_labels: Mapping | None) -> dict[str, str]:
    """The caller's const labels as strings; a ``ValueError`` for an invalid name or one the catalog uses."""
    out: dict[str, str] = {}
    for k, v in (const_labels or {}).items():
        if not isinstance(k, str) or not _LABEL_RE.match(k) or k.startswith("__"):
            raise ValueError(f"const_labels: {k!r} is not a valid Prometheus label name")
        if k in _RESERVED_LABELS:
            raise ValueError(f"const_labels: {k!r} is a label of the metric catalog (or reserved); pick another name")
        out[k] = str(v)
    return out


def exemplar_labels(trace_id) -> dict[str, str] | None:
    """A violation's exemplar, ``{"trace_id": ...}``, or None (no trace id, or one too long for OpenMetrics)."""
    if trace_id is None:
        return None
    s = str(trace_id)
    if not s or len("trace_id") + len(s) > _MAX_EXEMPLAR_RUNES:
        return None
    return {"trace_id": s}
