"""Prometheus exporter for an ``InstrumentedAllocator``: DESIGN.md's metric catalog, nothing more.

Contract
--------
``PrometheusExporter(alloc, *, registry=None, const_labels=None, multiprocess=None, refresh_interval=1.0,
clock=time.monotonic)`` subscribes one sink (named ``"prometheus"``) to ``alloc`` and registers the catalog's
metrics in ``registry`` (default: a private ``CollectorRegistry``, ``exporter.registry``; pass
``prometheus_client.REGISTRY`` to add them to an application's existing /metrics). ``serve(port=0,
addr="127.0.0.1")`` starts prometheus_client's HTTP server (it negotiates OpenMetrics from the Accept header) on a
daemon thread and returns the bound port; ``close()`` stops the server, unsubscribes the sink and unregisters the
metrics (idempotent; also a context manager).

What is computed when
- Counters and histograms (violations, alloc failures, pages allocated/freed, SWA-evicted tokens, op durations,
  peak pages per request, the instrumentation's own cost: ``kvalloc_overhead_seconds_total{part}`` and
  ``kvalloc_overhead_iteration_seconds``, from each ``StepBoundary``'s ``overhead`` and ``iteration_seconds``)
  come from the wrapper's events, through the sink. The sink runs on the engine thread
  (the allocator caller's thread, inside the wrapper's lock): it does a few dictionary look-ups and
  ``inc``/``observe`` calls per event, no I/O, no snapshot (single-process mode), and never raises: a failure is
  caught, kept in ``last_error``/``sink_errors``, and the batch is reported to the bus as refused, so the bus
  counts it in ``alloc.bus.dropped["prometheus"]``.
- Single-process mode aggregates on the engine thread and publishes at scrape time: the sink adds page counts and
  histogram observations (bucket index by ``bisect``, plus the sum) into running totals in plain dictionaries and
  lists that only it writes (the wrapper serialises its calls; the engine thread takes no lock of ours), and
  collecting any of those metrics (a scrape, ``generate_latest``, ``get_sample_value``, a restricted registry)
  first publishes what changed since the last collection into the prometheus_client children (a histogram's sum
  is set to the running sum); so does ``close()``. Values read through the registry are therefore exact at every
  collection (one on another thread while the engine runs reads the totals as of some update: possibly one
  observation in a histogram's sum and not yet in its buckets, see ``_flush_pending``); the children's own values
  lag until then. Violations and allocation failures (rare, and the
  violation carries an exemplar) update their counters at once. Multiprocess mode updates the children at once
  (their values live in files other processes read).
- ``kvalloc_events_dropped_total{sink}`` mirrors ``alloc.bus.drop_counts()`` (every sink: this one, the recorder,
  ...): the bus's ``dropped`` plus what a sink lost after taking the events (the OTel exporter's spans whose export
  failed, counted under ``otel``).
- Single-process mode (the default): the gauges and the dropped counter are computed at SCRAPE time by a custom
  collector over ``alloc.snapshot(wait=False)`` (never waits for deferred device checks) and ``stats.figures``
  -- never per allocator call. The collector runs on
  the HTTP server's thread; ``alloc.snapshot()`` takes the wrapper's lock briefly (an O(num_pages) copy of each
  pool's owner array), so a scrape delays the engine by about that copy. A failing collector is caught and
  logged: the gauge families are then left out of that scrape (absent, not wrong).
- Multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set, as SGLang runs; read in the constructor; ``multiprocess=``
  overrides): the gauges are plain ``Gauge``s in prometheus_client's mmap files, refreshed from a snapshot when the
  sink sees a ``StepBoundary`` event, at most once per ``refresh_interval`` seconds of ``clock`` (and once at
  construction, and by ``refresh()``); the dropped counter is brought up to date at the same time. Each process
  (rank) must carry distinguishing ``const_labels`` (``engine``, ``tp_rank``, ``dp_rank``, ...). ``serve()``
  then exposes a registry holding a ``MultiProcessCollector`` over the directory (every process's metrics).
  The per-gauge ``multiprocess_mode`` is documented at ``_GAUGES``; the ``live*`` modes drop a process's gauges
  once the parent calls ``prometheus_client.multiprocess.mark_process_dead(pid)``, while its counters stay
  (counters of dead processes must keep counting into the sums). prometheus_client itself chooses its value
  class when it is first imported: the variable must be set before that import (a clear error says so).
  Exemplars are not stored by prometheus_client in multiprocess mode.
- Multiprocess claims (``exporters.mpclaims``): the constructor claims its const-label set in the directory and
  ``serve()`` claims the directory's one server; a label set or server held by another live exporter (this
  process or another) raises ``mpclaims.ClaimError`` (a ``ValueError``), since the collector would merge the two
  silently (or expose every rank twice). A label set whose holder died is taken over, its gauges dropped as
  ``mark_process_dead`` does. ``close()`` gives the server claim up and keeps the label set's while the process
  lives (its gauges stay in its files until it exits).
- Multiprocess refresh thread (``_trailing_refresher``, a daemon per exporter, holding it weakly): a refresh the
  rate limit held back is made once the interval has passed, so that an engine that goes idle does not leave the
  gauges showing the busy state. A clock that goes back counts as the interval passed.
- Multiprocess disk space: prometheus_client grows its files with ``truncate`` (a sparse file) and writes a new
  series' key through the mapping; on a full filesystem that write is a SIGBUS, which kills the process (no
  exception to catch). So before anything of ours may add a series (a new child, a gauge or a sink name seen for
  the first time), the space it will be written into is reserved with ``posix_fallocate`` in this process's files
  (``_MpSpace``): the used part plus ``_MP_HEADROOM`` bytes, in the sizes prometheus_client grows them to. When
  the reservation fails (ENOSPC, a quota), that raises ``OSError`` naming the directory instead: from the
  constructor, or, in the sink, a refused batch (counted in ``alloc.bus.dropped["prometheus"]``, ``last_error``)
  while the allocator goes on. Series that exist are updated in place (their pages are allocated), so a full disk
  only stops new series. Not covered: a process forked after the exporter was built writes fresh files on its first
  update (prometheus_client re-creates every series after a fork), unreserved; build the exporter in the process
  that uses it.
- Exemplars (single-process): ``kvalloc_invariant_violations_total`` carries ``{trace_id="..."}`` of the latest
  violation that had one (``alloc.trace_id_for``); visible in the OpenMetrics exposition.

Labels are bounded: pool, state, invariant, op, sink, part (the four of ``selfcost.PARTS``), plus the caller's
const labels. Request ids are never labels.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import os
import re
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, mmap_dict, start_http_server, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from exporters import mpclaims
from instrumented_alloc import INVARIANTS, stats
from instrumented_alloc import events as ev
from instrumented_alloc.selfcost import PARTS

__all__ = ["OP_DURATION_BUCKETS", "OVERHEAD_BUCKETS", "REQUEST_PAGES_BUCKETS", "PrometheusExporter"]

log = logging.getLogger(__name__)

SINK_NAME = "prometheus"
PREFIX = "kvalloc_"

# Inner allocator calls take from about a microsecond (a host-side decode of a small batch) to milliseconds
# (a large prefill, or a free that sorts); 0.1 s catches pauses (GC, a device sync) without an open-ended +Inf.
OP_DURATION_BUCKETS = (
    1e-6,
    2.5e-6,
    5e-6,
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    1e-1,
)
# The instrumentation's own host time per scheduler iteration: a microsecond (a step with nothing to check) to
# 10 ms (a GPU decode step: past it the overlap scheduler cannot hide it).
OVERHEAD_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
# Peak pages per request: 1 .. 4096 pages, doubling (a 4096-page request at page size 64 is 256k tokens).
REQUEST_PAGES_BUCKETS = tuple(float(2**i) for i in range(13))

# Gauges: (name, help, labels, multiprocess_mode). Modes (multiprocess only; ranks differ by const labels, so a
# mode only decides how processes that share one label set combine, and whether a dead process's value stays):
# - "live*" everywhere: a gauge describes the state of a running allocator; once a process is marked dead its
#   pages, requests and ratios must not linger in the aggregate.
# - pages, requests, free runs, outside-window tokens: "livesum" (they are amounts: processes add up).
# - page size: "livemax" (a configuration constant, equal in every process; max is exact and, unlike
#   mostrecent, does not depend on the wall clock of the last write).
# - fragmentation ratios and the largest free run: "livemax" (a ratio or a maximum cannot be summed; the worst
#   process is what alerts must see, and mostrecent would flap between processes).
_GAUGES = (
    (
        "pages",
        "Pages by state (free/used/staged/reserved); the states sum to the pool's capacity.",
        ("pool", "state"),
        "livesum",
    ),
    ("page_size_tokens", "Tokens per KV page.", (), "livemax"),
    ("requests_live", "Requests that hold KV (kv_allocated_len > 0).", (), "livesum"),
    ("internal_fragmentation_ratio", "1 - committed tokens / allocated slots of live requests.", ("pool",), "livemax"),
    (
        "external_fragmentation_ratio",
        "1 - largest free run / free pages (0 when nothing is free).",
        ("pool",),
        "livemax",
    ),
    ("free_runs", "Number of maximal runs of consecutive free pages.", ("pool",), "livesum"),
    ("largest_free_run_pages", "The longest run of consecutive free pages.", ("pool",), "livemax"),
    ("swa_outside_window_tokens", "Tokens still holding SWA KV though outside the sliding window.", (), "livesum"),
)

_RESERVED_LABELS = frozenset({"pool", "state", "invariant", "op", "sink", "part", "le", "quantile", "pid"})
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_ALLOC_OPS = ("alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail")
# Ops that touch only the SWA pool: the SWA frees, and every call on the SWA pool's own allocator (its checked
# view, see the wrapper's _PoolView). Every other call emits a "full" event, which carries the call's duration.
_SWA_ONLY_OPS = frozenset(
    {
        "free_swa",
        "free_swa_segment",
        "swa_attn_allocator.alloc",
        "swa_attn_allocator.free",
        "swa_attn_allocator.free_segment",
        "swa_attn_allocator.free_page_ids",
    }
)
_MAX_EXEMPLAR_RUNES = 128  # OpenMetrics: label names + values of one exemplar
# The sink's per-event type tests, as module globals (one dictionary look-up each instead of two).
_ALLOC, _FREE, _RELEASED, _EVICT = ev.Alloc, ev.Free, ev.RequestReleased, ev.SwaEvict
_VIOLATION, _FAILED, _STEP = ev.ViolationEvent, ev.AllocFailed, ev.StepBoundary
_bisect_left = bisect.bisect_left
_PEAK = None  # the request-pages histogram's key among the pending observations (the others: op names)
_ITERATION = 0  # the per-iteration self-cost histogram's key among them


def _check_const_labels(const_labels: Mapping | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in (const_labels or {}).items():
        if not isinstance(k, str) or not _LABEL_RE.match(k) or k.startswith("__"):
            raise ValueError(f"const_labels: {k!r} is not a valid Prometheus label name")
        if k in _RESERVED_LABELS:
            raise ValueError(f"const_labels: {k!r} is a label of the metric catalog (or reserved); pick another name")
        out[k] = str(v)
    return out


def _multiproc_dir() -> str | None:
    # prometheus_client still honours the deprecated lower-case name (and copies it to the upper-case one).
    env = os.environ
    return env.get("PROMETHEUS_MULTIPROC_DIR") or env.get("prometheus_multiproc_dir") or None


# Bytes reserved past a multiprocess file's used part before a series may be added: one series' entries (a histogram
# child: a key per bucket, sum, count and created; a key holds the metric name, the labels and the help text) stay
# well under this.
_MP_HEADROOM = 32 << 10
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class _MpSpace:
    """Reserves disk space in this process's prometheus_client multiprocess files (see the module docstring).

    prometheus_client keeps one file per value kind and process, ``{prefix}_{pid}.db``; a file starts at
    ``mmap_dict._INITIAL_MMAP_SIZE`` bytes and doubles when a new entry does not fit; its first 4 bytes are the
    used length. ``reserve()`` allocates ``[0, capacity)`` of each file, ``capacity`` being the size that file
    will have once it holds its used part plus ``_MP_HEADROOM`` (a file created here is created at the initial
    size, as prometheus_client would). Cost: a few system calls per file; called only before a series may be
    added, never per event. Not thread-safe by itself: called on the engine thread (the sink) or under the
    exporter's refresh lock."""

    def __init__(self, directory: str, prefixes: Iterable[str]):
        self.directory = directory
        self.prefixes = tuple(prefixes)
        self.supported = True  # False once the filesystem said it cannot reserve: then we write as before

    def reserve(self) -> None:
        if not self.supported:
            return
        pid = os.getpid()
        initial = int(getattr(mmap_dict, "_INITIAL_MMAP_SIZE", 1 << 16))
        for prefix in self.prefixes:
            path = os.path.join(self.directory, f"{prefix}_{pid}.db")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise OSError(exc.errno, f"multiprocess metrics: cannot open {path}: {exc.strerror}") from exc
            try:
                size = os.fstat(fd).st_size
                head = os.pread(fd, 4, 0)
                used = struct.unpack("i", head)[0] if len(head) == 4 else 0  # native order, as prometheus_client
                capacity = size or initial
                while capacity < max(used, 8) + _MP_HEADROOM:
                    capacity *= 2
                try:
                    os.posix_fallocate(fd, 0, capacity)
                except OSError as exc:
                    if exc.errno in _NO_SPACE:
                        raise OSError(
                            exc.errno,
                            f"multiprocess metrics: no space for new series in {self.directory} "
                            f"({capacity} bytes of {os.path.basename(path)}): {exc.strerror}",
                        ) from exc
                    self.supported = False  # EOPNOTSUPP, EINVAL: this filesystem cannot reserve; nothing to do
                    return
            finally:
                os.close(fd)


def _trailing_refresher(ref: weakref.ref, stop: threading.Event, period: float) -> None:
    """Multiprocess mode, a daemon thread per exporter: the refresh the rate limit held back. A step boundary
    within ``refresh_interval`` of the last refresh leaves the gauges behind, and so does any call after the last
    step (the releases that end a burst); an engine that then goes idle calls nothing that would refresh them, and
    they would show the busy state for as long as it stays idle. This wakes every ``period`` seconds (the interval,
    at least 50 ms, at most a minute) and refreshes once the interval has passed on the exporter's ``clock`` if an
    event came in since the last refresh. ``refresh()`` takes the wrapper's lock for the snapshot, as the engine's
    own refresh does, at most once per interval; failures are kept in ``last_error``. Holds the exporter weakly
    (``ref``): it ends when ``stop`` is set (``close()``) or the exporter is gone. Not in a forked child (threads do
    not survive a fork)."""
    while not stop.wait(period):
        x = ref()
        if x is None:
            return
        if x._dirty and x._refresh_due():
            try:
                x.refresh()
            except Exception as exc:  # the next event re-arms it; the engine never sees this thread's errors
                x.last_error = f"{type(exc).__name__}: {exc}"
        del x


def _exemplar(trace_id) -> dict[str, str] | None:
    if trace_id is None:
        return None
    s = str(trace_id)
    if not s or len("trace_id") + len(s) > _MAX_EXEMPLAR_RUNES:
        return None
    return {"trace_id": s}


class _Sink:
    """What the exporter subscribes to the allocator's bus: ``_Sink.build(exporter)`` returns the callable, a plain
    function carrying ``name`` (what ``bus.dropped`` counts under) and ``event_types`` (these, plus
    ``StepBoundary`` in multiprocess mode). A function rather than an object with ``__call__``: the bus calls it
    once per wrapped call that built an event, and calling an instance costs a sixth of the sink again.

    Single-process mode aggregates in that one frame per batch (on the engine thread, inside the wrapper's lock,
    which makes it the running totals' only writer): per event a type test and the running totals' updates,
    nothing else (no lock, and no call once the labels are known). Multiprocess mode (or a prometheus_client
    without the histogram internals) hands the batch to ``_on_batch``, whose handlers update the children at once.
    Never raises: a failure is counted in ``sink_errors``/``last_error`` and the batch refused (the bus counts it
    as dropped)."""

    name = SINK_NAME
    # What the counters and histograms read (step boundaries: the self-cost, and the multiprocess gauges'
    # refresh): the wrapper then skips building what we ignore (page and ledger deltas).
    event_types = frozenset(
        {ev.Alloc, ev.AllocFailed, ev.Free, ev.SwaEvict, ev.ViolationEvent, ev.RequestReleased, ev.StepBoundary}
    )

    @classmethod
    def build(cls, x: PrometheusExporter) -> Callable:
        if x._aggregate:
            sink = cls._aggregating(x)
        else:
            on_batch = x._on_batch

            def sink(batch):
                return on_batch(batch)

        sink.name = cls.name
        sink.event_types = cls.event_types
        return sink

    @staticmethod
    def _aggregating(x: PrometheusExporter) -> Callable:
        # The running totals and the child maps are persistent objects (see PrometheusExporter._flush_pending):
        # the sink holds them in its closure.
        inc, obs = x._tot_inc, x._tot_obs
        alloc_child, free_child = x._alloc_child, x._free_child
        part_children = x._overhead_children

        def sink(batch) -> bool | None:
            try:
                for e in batch:
                    t = type(e)
                    if t is _ALLOC or t is _FREE:
                        pool = e.pool
                        n = e.n_pages
                        if n:
                            c = (alloc_child if t is _ALLOC else free_child).get(pool)
                            if c is None:
                                c = x._pages_child(t, pool)
                            inc[c] = inc.get(c, 0) + n
                        if pool == "full" or e.op in _SWA_ONLY_OPS:  # one per call
                            p = obs.get(e.op)
                            if p is None:
                                p = x._running_duration(e.op)
                            d = e.duration
                            p[0] += d
                            p[1 + _bisect_left(OP_DURATION_BUCKETS, d)] += 1
                    elif t is _RELEASED:
                        p = obs[_PEAK]
                        d = e.pages_peak
                        p[0] += d
                        p[1 + _bisect_left(REQUEST_PAGES_BUCKETS, d)] += 1
                    elif t is _EVICT:
                        n = e.new - e.old
                        if n > 0:
                            c = x._evicted_child
                            inc[c] = inc.get(c, 0) + n
                    elif t is _STEP:
                        overhead = e.overhead
                        if overhead:
                            # Cumulative seconds per part: the running totals themselves.
                            for c, total in zip(part_children, overhead):
                                inc[c] = total
                            p = obs[_ITERATION]
                            d = e.iteration_seconds
                            p[0] += d
                            p[1 + _bisect_left(OVERHEAD_BUCKETS, d)] += 1
                    elif t is _VIOLATION:
                        x._on_violation(e)
                    elif t is _FAILED:
                        x._on_alloc_failed(e)
                return None
            except Exception as exc:  # never reach the allocator's caller; the bus counts the batch as dropped
                x.sink_errors += 1
                x.last_error = f"{type(exc).__name__}: {exc}"
                return False

        return sink


class _GaugeCollector:
    """Single-process mode: the gauges and the dropped counter, computed from ``alloc.snapshot()`` per scrape."""

    def __init__(self, exporter: PrometheusExporter):
        self._x = exporter

    def describe(self):
        x = self._x
        fams = [GaugeMetricFamily(PREFIX + n, h, labels=x._const_names + lab) for n, h, lab, _ in _GAUGES]
        fams.append(x._dropped_family())
        return fams

    def collect(self):
        x = self._x
        try:
            fams = x._gauge_families(stats.figures(x._alloc.snapshot(wait=False)))
        except Exception as exc:  # a scrape must never take the engine (or the HTTP server) down
            x._collect_failed(exc)
            fams = []
        try:
            fams.append(x._dropped_family(x._alloc.bus.drop_counts()))
        except Exception as exc:
            x._collect_failed(exc)
        return fams


class PrometheusExporter:
    """Exports DESIGN.md's metric catalog for one ``InstrumentedAllocator``. See the module docstring."""

    def __init__(
        self,
        alloc,
        *,
        registry: CollectorRegistry | None = None,
        const_labels: Mapping[str, object] | None = None,
        multiprocess: bool | None = None,
        refresh_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if isinstance(refresh_interval, bool) or not isinstance(refresh_interval, (int, float)) or not (
            0 <= refresh_interval < float("inf")
        ):
            raise ValueError(f"refresh_interval: expected a finite number of seconds >= 0, got {refresh_interval!r}")
        self._alloc = alloc
        self._const = _check_const_labels(const_labels)
        self._const_names = tuple(self._const)
        self._const_values = tuple(self._const.values())
        self.refresh_interval = float(refresh_interval)
        self._clock = clock
        if multiprocess is None:
            multiprocess = _multiproc_dir() is not None
        self.multiprocess = bool(multiprocess)
        self._mp_dir = None
        if self.multiprocess:
            self._mp_dir = _multiproc_dir()
            if not self._mp_dir or not os.path.isdir(self._mp_dir):
                raise ValueError(
                    "multiprocess mode needs PROMETHEUS_MULTIPROC_DIR set to an existing directory "
                    f"(got {self._mp_dir!r})"
                )
            if not getattr(values.ValueClass, "_multiprocess", False):
                raise RuntimeError(
                    "multiprocess mode: prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set, so "
                    "its metrics live in process memory only; set the variable before prometheus_client is imported"
                )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.port: int | None = None
        self.last_error: str | None = None
        self.sink_errors = 0
        self._collect_errors_logged: set[str] = set()
        self._httpd = None
        self._http_thread: threading.Thread | None = None
        self._closed = False
        self._registered: list = []
        self._lock = threading.Lock()  # serve/close bookkeeping; never taken by the sink
        self._refresh_lock = threading.Lock()  # only ever try-acquired (multiprocess refresh)

        self._dropped_seen: dict[str, int] = {}
        self._last_refresh = self._clock()
        # Single process: counters and histograms are aggregated by the sink into running totals and published at
        # collection time (see _flush_pending).
        self._pub_lock = threading.Lock()  # collectors only; the sink never takes it
        self._tot_inc: dict = {}  # counter child -> running total (written by the sink only)
        self._tot_obs: dict = {}  # op or _PEAK -> [sum, count per bucket..., histogram child] (the sink only)
        self._pub_inc: dict = {}  # counter child -> the total last published
        self._pub_obs: dict = {}  # op or _PEAK -> the counts per bucket last published
        self._aggregate = not self.multiprocess
        self._mp_space: _MpSpace | None = None
        self._claim: mpclaims.Claim | None = None
        self._serve_claim: mpclaims.Claim | None = None
        # Multiprocess mode: refreshes owed to an idle engine (see _trailing_refresher).
        self._dirty = False
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        self._pid = os.getpid()  # close() in a forked child leaves the parent's side alone
        try:
            if self.multiprocess:
                # Before any series is written: a label set another live exporter writes would be merged with it.
                self._claim = mpclaims.claim(self._mp_dir, "labels", self._const, self)
                modes = sorted({mode for *_, mode in _GAUGES})
                self._mp_space = _MpSpace(self._mp_dir, ("counter", "histogram", *(f"gauge_{m}" for m in modes)))
                self._mp_space.reserve()  # metrics without labels write their series as they are built
            self._build_event_metrics()
            if self._aggregate:
                for m in (
                    self._allocated,
                    self._freed,
                    self._evicted,
                    self._op_duration,
                    self._request_pages,
                    self._overhead,
                    self._overhead_iteration,
                ):
                    m.collect = self._flushing_collect(m.collect)
            if self.multiprocess:
                self._build_mp_gauges()
                self.refresh()
            else:
                self._collector = _GaugeCollector(self)
                self.registry.register(self._collector)
                self._registered.append(self._collector)
        except BaseException:
            self._unregister()  # e.g. a name clash in a shared registry: leave it as it was
            if self._claim is not None:
                self._claim.release()
            raise

        self._handlers = {
            ev.Alloc: self._on_alloc,
            ev.AllocFailed: self._on_alloc_failed,
            ev.Free: self._on_free,
            ev.SwaEvict: self._on_swa_evict,
            ev.RequestReleased: self._on_released,
            ev.ViolationEvent: self._on_violation,
            ev.StepBoundary: self._on_step,
        }
        if self._aggregate:
            probe = self._child(self._request_pages, "full")
            if not (all(hasattr(probe, a) for a in ("_buckets", "_sum")) and hasattr(probe._sum, "set")):
                self._aggregate = False  # a prometheus_client without these internals: publish at once
        if self._aggregate:
            self._tot_obs[_PEAK] = self._new_running(REQUEST_PAGES_BUCKETS, self._peak_child)
            self._tot_obs[_ITERATION] = self._new_running(OVERHEAD_BUCKETS, self._overhead_iteration_child)
        self.sink = _Sink.build(self)
        alloc.subscribe(self.sink)
        if self.multiprocess:
            # The thread holds the exporter weakly: one dropped without close() can still be collected.
            self._refresher = threading.Thread(
                target=_trailing_refresher,
                args=(weakref.ref(self), self._stop, min(max(self.refresh_interval, 0.05), 60.0)),
                name="kvalloc-prometheus-refresh",
                daemon=True,
            )
            self._refresher.start()

    # -- metric construction --------------------------------------------------------------------------------------
    def _metric(self, cls, name: str, doc: str, labels: tuple, **kw):
        m = cls(PREFIX + name, doc, labelnames=self._const_names + labels, registry=self.registry, **kw)
        self._registered.append(m)
        return m

    def _build_event_metrics(self) -> None:
        self._violations = self._metric(
            Counter, "invariant_violations", "Invariant violations seen, by invariant id.", ("invariant",)
        )
        self._failures = self._metric(
            Counter, "alloc_failures", "Allocations refused for lack of pages.", ("pool", "op")
        )
        self._allocated = self._metric(Counter, "pages_allocated", "Pages handed out.", ("pool",))
        self._freed = self._metric(Counter, "pages_freed", "Pages released.", ("pool",))
        self._evicted = self._metric(Counter, "swa_evicted_tokens", "SWA tokens evicted (sliding window).", ())
        self._op_duration = self._metric(
            Histogram,
            "op_duration_seconds",
            "Wall time of the inner allocator call.",
            ("op",),
            buckets=OP_DURATION_BUCKETS,
        )
        self._request_pages = self._metric(
            Histogram,
            "request_pages",
            "Peak pages held per request, observed when the request is released.",
            ("pool",),
            buckets=REQUEST_PAGES_BUCKETS,
        )
        self._overhead = self._metric(
            Counter,
            "overhead_seconds",
            "Host seconds the instrumentation spent on the engine's thread, by part (hooks, ledger, checks, "
            "exporters).",
            ("part",),
        )
        self._overhead_iteration = self._metric(
            Histogram,
            "overhead_iteration_seconds",
            "Host seconds the instrumentation added to one scheduler iteration (observed at each step boundary; "
            "its count is the iterations).",
            (),
            buckets=OVERHEAD_BUCKETS,
        )
        self._children: dict = {}
        # Series that alert rules and rate() must see before the first increment.
        for inv in INVARIANTS:
            self._child(self._violations, inv)
        pools = tuple(getattr(self._alloc, "pools", ("full",)))
        for pool in pools:
            self._child(self._allocated, pool)
            self._child(self._freed, pool)
        for op in _ALLOC_OPS:
            if hasattr(self._alloc, op):
                self._child(self._failures, "full", op)
        self._child(self._evicted)
        self._child(self._request_pages, "full")
        # The single-process sink's children, found without a call (``_child`` stays the one place a child is
        # made; the maps by label fill as labels appear): page counters by pool, duration histograms by op.
        self._alloc_child = {pool: self._child(self._allocated, pool) for pool in pools}
        self._free_child = {pool: self._child(self._freed, pool) for pool in pools}
        self._dur_child: dict = {}
        self._evicted_child = self._child(self._evicted)
        self._peak_child = self._child(self._request_pages, "full")
        self._overhead_children = tuple(self._child(self._overhead, part) for part in PARTS)
        self._overhead_iteration_child = self._child(self._overhead_iteration)
        self._overhead_seen = [0.0] * len(PARTS)  # multiprocess: the totals already added to the counters

    def _pages_child(self, t: type, pool: str):
        """The pages allocated (``t`` is ``Alloc``) or freed counter child of ``pool``, now in the sink's map."""
        if t is _ALLOC:
            c = self._alloc_child[pool] = self._child(self._allocated, pool)
        else:
            c = self._free_child[pool] = self._child(self._freed, pool)
        return c

    def _build_mp_gauges(self) -> None:
        self._gauges = {
            name: self._metric(Gauge, name, doc, labels, multiprocess_mode=mode) for name, doc, labels, mode in _GAUGES
        }
        self._dropped_counter = self._metric(
            Counter, "events_dropped", "Events a sink could not take (refused or failed batches).", ("sink",)
        )

    def _child(self, metric, *labels):
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            if self._mp_space is not None:
                self._mp_space.reserve()  # the child's series are written as it is made
            c = metric.labels(*self._const_values, *labels) if (self._const_values or labels) else metric
            self._children[key] = c
        return c

    # -- the sink (engine thread) ------------------------------------------------------------------------------
    def _on_batch(self, batch) -> bool | None:
        """Multiprocess sink (and single-process without the histogram internals): each event's handler updates
        the metric children at once."""
        try:
            self._dirty = True  # the gauges may be behind now (see _trailing_refresher)
            handlers = self._handlers
            for e in batch:
                h = handlers.get(type(e))
                if h is not None:
                    h(e)
            return None
        except Exception as exc:  # never reach the allocator's caller; the bus counts the batch as dropped
            self.sink_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            return False

    # Running observations (single process), in ``_tot_obs`` keyed by op (durations) or ``_PEAK``: [sum, count per
    # bucket..., the child they are published to]. A bucket is observe()'s: the first whose upper bound is >= the
    # amount, found by ``bisect_left`` over the finite bounds (an amount above them all lands on +Inf's). A
    # duration's entry is made when its op first appears, which is also when its child is found (so a failing
    # child fails in the sink, which reports the batch refused).
    @staticmethod
    def _new_running(bounds: tuple, child) -> list:
        return [0.0] + [0] * (len(bounds) + 1) + [child]

    def _running_duration(self, op: str) -> list:
        c = self._dur_child.get(op)
        if c is None:
            c = self._dur_child[op] = self._child(self._op_duration, op)
        p = self._tot_obs[op] = self._new_running(OP_DURATION_BUCKETS, c)
        return p

    def _flushing_collect(self, collect):
        def flush_then_collect():
            try:
                self._flush_pending()
            except Exception as exc:  # a scrape must never fail because of us
                self._collect_failed(exc)
            return collect()

        return flush_then_collect

    def _flush_pending(self) -> None:
        """Publish what the sink aggregated since the last publication (collection time, ``close()``). Any thread.

        The sink is the only writer of the running totals (the wrapper serialises its calls) and takes no lock:
        this reads them, each dictionary and each entry copied whole (``d.copy()``, ``p[:]``: C calls that run no
        Python code once their result is allocated, so no other thread interleaves), and publishes the differences
        to what it published last (``_pub_*``, under ``_pub_lock``, which only collectors take). A histogram's sum
        is set to the running sum: the same float as observing each amount in turn. A scrape that lands between
        the sink's update of an entry's sum and of its bucket may see that one observation in the sum and not yet
        in the count; the next collection has both (as with prometheus_client's own observe, which updates them
        one after the other)."""
        with self._pub_lock:
            pub_inc, pub_obs = self._pub_inc, self._pub_obs
            for c, total in self._tot_inc.copy().items():
                n = total - pub_inc.get(c, 0)
                if n:
                    c.inc(n)
                    pub_inc[c] = total
            for key, p in self._tot_obs.copy().items():
                p = p[:]
                c = p[-1]
                counts = p[1:-1]
                seen = pub_obs.get(key) or [0] * len(counts)
                if seen == counts:
                    continue  # nothing observed since (the sum moves only with a count)
                c._sum.set(p[0])
                for b, n, m in zip(c._buckets, counts, seen):
                    if n != m:
                        b.inc(n - m)
                pub_obs[key] = counts

    def _on_alloc(self, e: ev.Alloc) -> None:
        if e.n_pages:
            self._child(self._allocated, e.pool).inc(e.n_pages)
        if e.pool == "full" or e.op in _SWA_ONLY_OPS:  # one per call: the full pool's, else the SWA-only call's
            self._child(self._op_duration, e.op).observe(e.duration)

    def _on_alloc_failed(self, e: ev.AllocFailed) -> None:
        self._child(self._failures, e.pool, e.op).inc()

    def _on_free(self, e: ev.Free) -> None:
        if e.n_pages:
            self._child(self._freed, e.pool).inc(e.n_pages)
        if e.pool == "full" or e.op in _SWA_ONLY_OPS:  # one observation per call
            self._child(self._op_duration, e.op).observe(e.duration)

    def _on_swa_evict(self, e: ev.SwaEvict) -> None:
        n = e.new - e.old
        if n > 0:
            self._child(self._evicted).inc(n)

    def _on_released(self, e: ev.RequestReleased) -> None:
        # The event carries one peak (the request's largest page count in any pool, which is the full pool's
        # for every allocator here): observed under pool="full".
        self._child(self._request_pages, "full").observe(e.pages_peak)

    def _on_violation(self, e: ev.ViolationEvent) -> None:
        v = e.violation
        self._child(self._violations, v.invariant).inc(1, exemplar=_exemplar(v.trace_id))

    def _on_step(self, e: ev.StepBoundary) -> None:
        overhead = e.overhead
        if overhead:
            seen = self._overhead_seen
            for i, (c, total) in enumerate(zip(self._overhead_children, overhead)):
                if total > seen[i]:
                    c.inc(total - seen[i])
                    seen[i] = total
            self._overhead_iteration_child.observe(e.iteration_seconds)
        if self.multiprocess and self._refresh_due():
            self.refresh()

    def _refresh_due(self) -> bool:
        """``refresh_interval`` has passed on ``clock`` since the last refresh (or the clock went back)."""
        elapsed = self._clock() - self._last_refresh
        return elapsed >= self.refresh_interval or elapsed < 0

    # -- gauges ---------------------------------------------------------------------------------------------
    def _gauge_values(self, fig: dict) -> Iterable[tuple[str, tuple, float]]:
        """(gauge name, own label values, value) for every gauge series of one ``stats.figures`` result."""
        yield "page_size_tokens", (), fig["page_size_tokens"]
        yield "requests_live", (), fig["requests_live"]
        yield "swa_outside_window_tokens", (), fig["swa_outside_window_tokens"]
        for pool, pf in fig["pools"].items():
            for state in stats.STATES:
                yield "pages", (pool, state), pf["pages_by_state"][state]
            yield "internal_fragmentation_ratio", (pool,), pf["internal_fragmentation"]
            yield "external_fragmentation_ratio", (pool,), pf["external_fragmentation"]
            yield "free_runs", (pool,), pf["free_run_count"]
            yield "largest_free_run_pages", (pool,), pf["largest_free_run"]

    def _gauge_families(self, fig: dict) -> list:
        fams = {n: GaugeMetricFamily(PREFIX + n, h, labels=self._const_names + lab) for n, h, lab, _ in _GAUGES}
        for name, labels, value in self._gauge_values(fig):
            fams[name].add_metric(self._const_values + labels, float(value))
        return list(fams.values())

    def _dropped_family(self, dropped: Mapping[str, int] | None = None) -> CounterMetricFamily:
        fam = CounterMetricFamily(
            PREFIX + "events_dropped",
            "Events a sink could not take (refused or failed batches).",
            labels=(*self._const_names, "sink"),
        )
        for sink, n in sorted((dropped or {}).items()):
            fam.add_metric((*self._const_values, str(sink)), float(n))
        return fam

    def _collect_failed(self, exc: Exception) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        self.last_error = msg
        if msg not in self._collect_errors_logged and len(self._collect_errors_logged) < 100:
            self._collect_errors_logged.add(msg)
            log.warning("kvalloc prometheus collector failed; gauges left out of this scrape: %s", msg, exc_info=exc)

    def refresh(self) -> None:
        """Multiprocess mode: set every gauge from a snapshot now and bring the dropped counter up to date
        (the sink calls this at step boundaries, rate-limited). Single-process mode: nothing to do (the
        gauges are computed at scrape time)."""
        if not self.multiprocess or self._closed:
            return
        # Never wait: a refresh already running elsewhere (a user's thread, close()) writes current values too.
        if not self._refresh_lock.acquire(blocking=False):
            return
        try:
            self._last_refresh = self._clock()
            self._dirty = False  # before the snapshot: a change made while it is taken is owed again
            fig = stats.figures(self._alloc.snapshot(wait=False))
            # A refresh may write series for the first time (the gauges' at construction, a new sink's dropped
            # count): reserve first. Once per refresh (rate-limited): a few system calls per file, a no-op while
            # the space is there.
            space = self._mp_space
            if space is not None:
                space.reserve()
            for name, labels, value in self._gauge_values(fig):
                g = self._gauges[name]
                # A gauge with no label at all (no const labels, none of its own) is its own series.
                (g.labels(*self._const_values, *labels) if (self._const_values or labels) else g).set(float(value))
            dropped_seen = self._dropped_seen
            for sink, n in self._alloc.bus.drop_counts().items():
                if space is not None and sink not in dropped_seen:
                    # Again before each new series: one refresh may bring more new sinks than the headroom holds
                    # (sinks that appeared while refreshes were held back), and a write past it is a SIGBUS.
                    space.reserve()
                seen = dropped_seen.get(sink, 0)
                child = self._dropped_counter.labels(*self._const_values, str(sink))
                if n > seen:
                    child.inc(n - seen)
                dropped_seen[sink] = max(seen, n)
        finally:
            self._refresh_lock.release()

    # -- HTTP ----------------------------------------------------------------------------------------------
    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve /metrics (text format, or OpenMetrics when the scraper asks for it) on ``addr:port``; returns the
        bound port (``port=0``: an ephemeral one). Multiprocess mode serves every process's metrics of the
        directory through a ``MultiProcessCollector``."""
        with self._lock:
            if self._closed:
                raise RuntimeError("serve(): the exporter is closed")
            if self._httpd is not None:
                raise RuntimeError(f"serve(): already serving on {addr}:{self.port}")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise ValueError(f"serve(): port: expected an int 0..65535, got {port!r}")
            if self.multiprocess:
                reg = CollectorRegistry()
                MultiProcessCollector(reg, path=self._mp_dir)
                # Every process's metrics are served from here: a second server would expose each rank twice.
                self._serve_claim = mpclaims.claim(self._mp_dir, "serve", None, self)
            else:
                reg = self.registry
            try:
                httpd, thread = start_http_server(port, addr=addr, registry=reg)
            except BaseException as exc:
                if self._serve_claim is not None:
                    self._serve_claim.release()  # nothing is served: another exporter may serve the directory
                    self._serve_claim = None
                if not isinstance(exc, OSError):
                    raise
                if exc.errno == errno.EADDRINUSE:
                    raise OSError(errno.EADDRINUSE, f"metrics port {port} on {addr} is already in use") from exc
                raise OSError(exc.errno, f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from exc
            self._httpd, self._http_thread = httpd, thread
            self.port = int(httpd.server_port)
            return self.port

    def close(self) -> None:
        """Stop the HTTP server, unsubscribe from the allocator, unregister the metrics. Idempotent.

        Multiprocess mode: stops the refresh thread (after a refresh it is making), makes the last refresh, gives
        up the server's claim and keeps the label set's (see ``exporters.mpclaims``). In a child forked after the
        exporter was built, only the child's side is closed: no refresh (it would write the parent's label set into
        the child's files), the claims and the server stay the parent's."""
        with self._lock:
            if self._closed:
                return
            forked = os.getpid() != self._pid
            self._stop.set()
            r = self._refresher
            if r is not None and r.is_alive() and r is not threading.current_thread() and not self._holds_alloc():
                # A refresh it is making (from an older snapshot) must land before ours. Not when our caller holds
                # the wrapper's lock (close() from a sink): the thread may be waiting for it, and a refresh it makes
                # later takes its snapshot then, which is current.
                r.join(timeout=5)
            if self.multiprocess and not forked:
                try:
                    self.refresh()  # the last word on the dropped counter and the gauges
                except Exception as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
            self._closed = True
            if not forked:
                if self._serve_claim is not None:
                    self._serve_claim.release()
                if self._claim is not None:
                    self._claim.release(keep_file=True)  # see mpclaims: our gauges stay until this process exits
            httpd, self._httpd = self._httpd, None
            if httpd is not None:
                if not forked:  # a child has no serving thread: shutdown() would wait for it forever
                    httpd.shutdown()
                httpd.server_close()
                if self._http_thread is not None and not forked:
                    self._http_thread.join(timeout=5)
            with contextlib.suppress(ValueError):
                self._alloc.unsubscribe(self.sink)
            self._flush_pending()  # the metric objects stay readable after close
            self._unregister()

    def _holds_alloc(self) -> bool:
        """Whether this thread holds the wrapper's lock (``close()`` called from a sink)."""
        owned = getattr(getattr(self._alloc, "_w_lock", None), "_is_owned", None)
        return bool(owned()) if owned is not None else False

    def _unregister(self) -> None:
        for m in self._registered:
            with contextlib.suppress(KeyError):
                self.registry.unregister(m)
        self._registered.clear()

    def __enter__(self) -> PrometheusExporter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
