"""Multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set, as SGLang runs): prometheus_client's file-backed metrics.

Contract: the metrics are prometheus_client ``Counter``/``Histogram``/``Gauge`` objects, updated through their
public ``inc``/``observe``/``set`` only, because other processes read their values from the files. The sink
(``MultiprocessMetrics.on_batch``, engine thread, inside the wrapper's lock) folds each step's statistics
(``StepStats``), each violation and each released request into the counters and histograms at once; the gauges and
the dropped counter are set by ``refresh()`` from a snapshot, at a step boundary at most once per
``refresh_interval`` of the exporter's clock, and by the trailing refresh thread when the engine went idle.
``refresh()`` is only ever try-locked: a refresh running elsewhere writes current values too.

Disk space: prometheus_client grows its files with ``truncate`` (a sparse file) and writes a new series' key
through the mapping; on a full filesystem that write is a SIGBUS, which kills the process. So before anything of
ours may add a series, ``MpSpace`` reserves its space with ``posix_fallocate``; when that fails an ``OSError`` names
the directory instead (from the constructor, or in the sink: a refused batch). Series that exist are updated in
place, so a full disk only stops new series. Not covered: a process forked after the exporter was built writes
fresh files on its first update, unreserved; build the exporter in the process that uses it.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
import weakref
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values

from exporters.prometheus import catalog
from exporters.prometheus.catalog import PREFIX, Family, exemplar_labels
from exporters.prometheus.collectors import gauge_values
from instrumented_alloc import INVARIANTS, stats
from instrumented_alloc import events as ev
from instrumented_alloc.selfcost import PARTS

# The size prometheus_client gives a file it creates; it takes an existing file's size as it is, so a file created
# here at this size is one it would have made.
_MP_INITIAL_SIZE = 1 << 16
# Bytes reserved past a file's used part before a series may be added: one series' entries (a histogram child: a
# key per bucket, sum, count and created; a key holds the metric name, the labels and the help text) stay well
# under this.
_MP_HEADROOM = 32 << 10
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def multiproc_dir() -> str | None:
    # prometheus_client still honours the deprecated lower-case name (and copies it to the upper-case one).
    env = os.environ
    return env.get("PROMETHEUS_MULTIPROC_DIR") or env.get("prometheus_multiproc_dir") or None


def check_multiprocess_setup() -> str:
    """The directory, or a clear error: unset or missing, or prometheus_client imported before it was set (it
    chooses its value class when first imported, and then keeps its values in process memory)."""
    d = multiproc_dir()
    if not d or not os.path.isdir(d):
        raise ValueError(f"multiprocess mode needs PROMETHEUS_MULTIPROC_DIR set to an existing directory (got {d!r})")
    if values.ValueClass is values.MutexValue:
        raise RuntimeError(
            "multiprocess mode: prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set, so "
            "its metrics live in process memory only; set the variable before prometheus_client is imported"
        )
    return d


class MpSpace:
    """Reserves disk space in this process's prometheus_client files, ``{prefix}_{pid}.db`` (see the module
    docstring). A file doubles when a new entry does not fit; its first 4 bytes are the used length. ``reserve()``
    allocates ``[0, capacity)`` of each file, ``capacity`` being the size that file will have once it holds its
    used part plus ``_MP_HEADROOM``. Cost: a few system calls per file; called only before a series may be added,
    never per event. Not thread-safe by itself: called on the engine thread or under the refresh lock."""

    def __init__(self, directory: str, prefixes: Iterable[str]):
        self.directory = directory
        self.prefixes = tuple(prefixes)
        self.supported = True  # False once the filesystem said it cannot reserve: then we write as before

    def reserve(self) -> None:
        if not self.supported:
            return
        pid = os.getpid()
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
                capacity = size or _MP_INITIAL_SIZE
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


class MultiprocessMetrics:
    """One exporter's file-backed metrics in ``registry`` (this process's values; ``serve()`` exposes every
    process's through a ``MultiProcessCollector``). ``dirty`` (set by the sink, cleared by a refresh) tells the
    trailing refresh thread that the gauges may be behind. ``closed`` (set by the exporter) stops refreshes."""

    def __init__(
        self,
        alloc,
        registry: CollectorRegistry,
        const: dict,
        directory: str,
        registered: list,
        *,
        refresh_interval: float,
        clock: Callable[[], float],
    ):
        self._alloc = alloc
        self._registry = registry
        self._registered = registered  # the exporter's: what close() unregisters
        self._const_names = tuple(const)
        self._const_values = tuple(const.values())
        self.refresh_interval = refresh_interval
        self._clock = clock
        self.dirty = False
        self.closed = False
        self.last_refresh = clock()
        self._refresh_lock = threading.Lock()  # only ever try-acquired
        self._dropped_seen: dict[str, int] = {}
        self._overhead_seen = [0.0] * len(PARTS)  # the self-cost totals already added to the counters
        self._children: dict = {}
        modes = sorted({f.mode for f in catalog.GAUGES})
        self.space = MpSpace(directory, ("counter", "histogram", *(f"gauge_{m}" for m in modes)))
        self.space.reserve()  # metrics without labels write their series as they are built
        m = self._metric
        self.violations = m(Counter, catalog.VIOLATIONS)
        self.failures = m(Counter, catalog.FAILURES)
        self.allocated = m(Counter, catalog.ALLOCATED)
        self.freed = m(Counter, catalog.FREED)
        self.evicted = m(Counter, catalog.EVICTED)
        self.op_duration = m(Histogram, catalog.OP_DURATION, buckets=catalog.OP_DURATION_BUCKETS)
        self.request_pages = m(Histogram, catalog.REQUEST_PAGES, buckets=catalog.REQUEST_PAGES_BUCKETS)
        self.overhead = m(Counter, catalog.OVERHEAD)
        self.overhead_iteration = m(Histogram, catalog.OVERHEAD_ITERATION, buckets=catalog.OVERHEAD_BUCKETS)
        # Series that alert rules and rate() must see before the first increment.
        for inv in INVARIANTS:
            self.child(self.violations, inv)
        for pool in tuple(getattr(alloc, "pools", ("full",))):
            self.child(self.allocated, pool)
            self.child(self.freed, pool)
        for op in catalog.ALLOC_OPS:
            if hasattr(alloc, op):
                self.child(self.failures, "full", op)
        self.child(self.evicted)
        self.child(self.request_pages, "full")
        self._overhead_children = tuple(self.child(self.overhead, part) for part in PARTS)
        self._overhead_iteration_child = self.child(self.overhead_iteration)
        self.gauges = {f.name: m(Gauge, f, multiprocess_mode=f.mode) for f in catalog.GAUGES}
        self.dropped = m(Counter, catalog.DROPPED)
        self._handlers = {
            ev.StepStats: self._on_step,
            ev.RequestReleased: self._on_released,
            ev.ViolationEvent: self._on_violation,
        }

    def _metric(self, cls, family: Family, **kw):
        labels = self._const_names + family.labels
        metric = cls(PREFIX + family.name, family.doc, labelnames=labels, registry=self._registry, **kw)
        self._registered.append(metric)
        return metric

    def child(self, metric, *labels):
        """The series of ``metric`` with the const labels and ``labels``; the first time, after reserving space
        (its series are written as it is made)."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            self.space.reserve()
            c = metric.labels(*self._const_values, *labels) if (self._const_values or labels) else metric
            self._children[key] = c
        return c

    # -- the sink (engine thread) -------------------------------------------------------------------------------
    def on_batch(self, batch) -> None:
        """Each event's handler updates its series at once. Raises what a handler raised (the exporter's sink
        counts it and refuses the batch)."""
        self.dirty = True  # the gauges may be behind now (see trailing_refresher)
        handlers = self._handlers
        for e in batch:
            h = handlers.get(type(e))
            if h is not None:
                h(e)

    def _on_released(self, e: ev.RequestReleased) -> None:
        self.child(self.request_pages, "full").observe(e.pages_peak)  # one peak per request (see running.py)

    def _on_violation(self, e: ev.ViolationEvent) -> None:
        v = e.violation
        # prometheus_client keeps no exemplar in multiprocess mode; passed for a value class that does.
        self.child(self.violations, v.invariant).inc(1, exemplar=exemplar_labels(v.trace_id))

    def _on_step(self, e: ev.StepStats) -> None:
        child = self.child
        for d, metric in ((e.allocated, self.allocated), (e.freed, self.freed)):
            for pool, n in d.items():
                child(metric, pool).inc(n)
        for op, xs in e.durations.items():  # one observation per call
            c = child(self.op_duration, op)
            for x in xs:
                c.observe(x)
        for (pool, op), n in e.failures.items():
            child(self.failures, pool, op).inc(n)
        if e.evicted:
            child(self.evicted).inc(e.evicted)
        overhead = e.overhead
        if overhead:
            seen = self._overhead_seen
            for i, (c, total) in enumerate(zip(self._overhead_children, overhead)):
                if total > seen[i]:
                    c.inc(total - seen[i])
                    seen[i] = total
            self._overhead_iteration_child.observe(e.iteration_seconds)
        if self.refresh_due():
            self.refresh()

    # -- gauges ----------------------------------------------------------------------------------------------
    def refresh_due(self) -> bool:
        """``refresh_interval`` has passed on the clock since the last refresh (or the clock went back)."""
        elapsed = self._clock() - self.last_refresh
        return elapsed >= self.refresh_interval or elapsed < 0

    def refresh(self) -> None:
        """Set every gauge from a snapshot now and bring the dropped counter up to date. Returns at once when a
        refresh is running elsewhere (it writes current values too) or after ``closed``."""
        if self.closed or not self._refresh_lock.acquire(blocking=False):
            return
        try:
            self.last_refresh = self._clock()
            self.dirty = False  # before the snapshot: a change made while it is taken is owed again
            fig = stats.figures(self._alloc.snapshot(wait=False))
            # A refresh may write series for the first time (the gauges' at construction, a new sink's dropped
            # count): reserve first; a no-op while the space is there.
            space = self.space
            space.reserve()
            cv = self._const_values
            for name, labels, value in gauge_values(fig):
                g = self.gauges[name]
                # A gauge with no label at all (no const labels, none of its own) is its own series.
                (g.labels(*cv, *labels) if (cv or labels) else g).set(float(value))
            dropped_seen = self._dropped_seen
            for sink, n in self._alloc.bus.drop_counts().items():
                if sink not in dropped_seen:
                    # Again before each new series: one refresh may bring more new sinks than the headroom holds
                    # (sinks that appeared while refreshes were held back), and a write past it is a SIGBUS.
                    space.reserve()
                seen = dropped_seen.get(sink, 0)
                child = self.dropped.labels(*cv, str(sink))
                if n > seen:
                    child.inc(n - seen)
                dropped_seen[sink] = max(seen, n)
        finally:
            self._refresh_lock.release()


def trailing_refresher(ref: weakref.ref, stop: threading.Event, period: float) -> None:
    """A daemon thread per exporter: the refresh the rate limit held back. A step boundary within
    ``refresh_interval`` of the last refresh leaves the gauges behind; an engine that then goes idle calls nothing
    that would refresh them, and they would show the busy state for as long as it stays idle. (Calls after the last
    boundary reach no sink of ours: they show from the next ``step()`` or ``flush()``; SGLang's plugin steps when
    the scheduler goes idle.) This wakes every ``period`` seconds and refreshes once the interval has passed if an
    event came in since the last refresh (at most once per interval; the snapshot takes the wrapper's lock, as the
    engine's own refresh does). Holds the exporter weakly (``ref``): it ends when ``stop`` is set (``close()``) or
    the exporter is gone. Failures are kept in the exporter's ``last_error``."""
    while not stop.wait(period):
        x = ref()
        if x is None:
            return
        mp = x._mp
        if mp.dirty and mp.refresh_due():
            try:
                x.refresh()
            except Exception as exc:  # the next event re-arms it; the engine never sees this thread's errors
                x.last_error = f"{type(exc).__name__}: {exc}"
        del x, mp
