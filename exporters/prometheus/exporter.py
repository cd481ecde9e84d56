"""``PrometheusExporter``: subscribes one sink to an ``InstrumentedAllocator``, registers the catalog, serves it.

Which thread does what:
- The sink runs on the engine thread (the allocator caller's, inside the wrapper's lock) and never raises: a
  failure is kept in ``last_error``/``sink_errors`` and the batch reported to the bus as refused, so the bus
  counts it in ``alloc.bus.dropped["prometheus"]``.
- Single-process mode (the default): the sink only adds into running totals (``running``); custom collectors
  (``collectors``) build every family when the registry is collected, on the collecting thread.
- Multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set, read in the constructor; ``multiprocess=`` overrides):
  prometheus_client's file-backed metrics (``multiprocess``), with a refresh thread for the gauges. Each process
  (rank) must carry distinguishing ``const_labels``; ``exporters.mpclaims`` refuses a label set or a server
  another live exporter holds (``ClaimError``, a ``ValueError``).
- ``serve()`` runs prometheus_client's HTTP server on a daemon thread; ``close()`` is idempotent.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector

from exporters import mpclaims
from exporters.prometheus import catalog
from exporters.prometheus.collectors import EventCollector, GaugeCollector
from exporters.prometheus.multiprocess import (
    MultiprocessMetrics,
    check_multiprocess_setup,
    multiproc_dir,
    trailing_refresher,
)
from exporters.prometheus.running import Totals, build_sink
from instrumented_alloc import events as ev

log = logging.getLogger("exporters.prometheus")


class _Sink:
    """What the exporter subscribes to the allocator's bus: ``_Sink.build(exporter)`` returns a plain function
    carrying ``name`` (what ``bus.dropped`` counts under) and ``event_types``. A function rather than an object
    with ``__call__``: the bus calls it once per batch with an event of ours (a step boundary, a call that broke an
    invariant or released a request), and calling an instance costs a sixth of the sink again."""

    name = catalog.SINK_NAME
    # What the counters and histograms read: each step's statistics (pages, call durations, refusals, evictions,
    # the self-cost; also when the multiprocess gauges refresh), violations and released requests. The wrapper then
    # builds no per-call event for us: the sink runs once per step boundary, not once per call.
    event_types = frozenset({ev.StepStats, ev.ViolationEvent, ev.RequestReleased})

    @classmethod
    def build(cls, x: PrometheusExporter) -> Callable:
        if x.multiprocess:
            on_batch, on_error = x._mp.on_batch, x._sink_failed

            def sink(batch) -> bool | None:
                try:
                    on_batch(batch)
                    return None
                except Exception as exc:  # never reach the allocator's caller; the bus counts the batch as dropped
                    on_error(exc)
                    return False

        else:
            sink = build_sink(x._totals, x._sink_failed)
        sink.name = cls.name
        sink.event_types = cls.event_types
        return sink


class PrometheusExporter:
    """Exports the metric catalog (``exporters.prometheus.catalog``) for one ``InstrumentedAllocator``.

    ``registry``: where the metrics go (default: a private ``CollectorRegistry``, ``exporter.registry``; pass
    ``prometheus_client.REGISTRY`` to add them to an application's /metrics). ``const_labels``: added to every
    series (ranks: ``engine``, ``tp_rank``, ``dp_rank``, ...). ``refresh_interval`` and ``clock``: multiprocess
    mode's gauge refresh rate limit."""

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
        if (
            isinstance(refresh_interval, bool)
            or not isinstance(refresh_interval, (int, float))
            or not (0 <= refresh_interval < float("inf"))
        ):
            raise ValueError(f"refresh_interval: expected a finite number of seconds >= 0, got {refresh_interval!r}")
        self._alloc = alloc
        self._const = catalog.check_const_labels(const_labels)
        self._const_names = tuple(self._const)
        self._const_values = tuple(self._const.values())
        self.refresh_interval = float(refresh_interval)
        if multiprocess is None:
            multiprocess = multiproc_dir() is not None
        self.multiprocess = bool(multiprocess)
        self._mp_dir = check_multiprocess_setup() if self.multiprocess else None
        self.registry = registry if registry is not None else CollectorRegistry()
        self.port: int | None = None
        self.last_error: str | None = None
        self.sink_errors = 0
        self._collect_errors_logged: set[str] = set()
        self._httpd = None
        self._http_thread: threading.Thread | None = None
        self._closed = False
        self._registered: list = []  # what close() unregisters
        self._lock = threading.Lock()  # serve/close bookkeeping; never taken by the sink
        self._totals: Totals | None = None
        self._mp: MultiprocessMetrics | None = None
        self._claim: mpclaims.Claim | None = None
        self._serve_claim: mpclaims.Claim | None = None
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        self._pid = os.getpid()  # close() in a forked child leaves the parent's side alone
        try:
            if self.multiprocess:
                # Before any series is written: a label set another live exporter writes would be merged with it.
                self._claim = mpclaims.claim(self._mp_dir, "labels", self._const, self)
                self._mp = MultiprocessMetrics(
                    alloc,
                    self.registry,
                    self._const,
                    self._mp_dir,
                    self._registered,
                    refresh_interval=self.refresh_interval,
                    clock=clock,
                )
                self._mp.refresh()
            else:
                ops = [op for op in catalog.ALLOC_OPS if hasattr(alloc, op)]
                self._totals = Totals(tuple(getattr(alloc, "pools", ("full",))), ops)
                for collector in (
                    EventCollector(self._totals, self._const_names, self._const_values, self._collect_failed),
                    GaugeCollector(alloc, self._const_names, self._const_values, self._collect_failed),
                ):
                    self.registry.register(collector)
                    self._registered.append(collector)
        except BaseException:
            self._unregister()  # e.g. a name clash in a shared registry: leave it as it was
            if self._claim is not None:
                self._claim.release()
            raise
        self.sink = _Sink.build(self)
        alloc.subscribe(self.sink)
        if self.multiprocess:
            # The thread holds the exporter weakly: one dropped without close() can still be collected.
            self._refresher = threading.Thread(
                target=trailing_refresher,
                args=(weakref.ref(self), self._stop, min(max(self.refresh_interval, 0.05), 60.0)),
                name="kvalloc-prometheus-refresh",
                daemon=True,
            )
            self._refresher.start()

    def _sink_failed(self, exc: Exception) -> None:
        self.sink_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"

    def _collect_failed(self, exc: Exception) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        self.last_error = msg
        if msg not in self._collect_errors_logged and len(self._collect_errors_logged) < 100:
            self._collect_errors_logged.add(msg)
            log.warning("kvalloc prometheus collector failed; left out of this scrape: %s", msg, exc_info=exc)

    def refresh(self) -> None:
        """Multiprocess mode: set every gauge from a snapshot now and bring the dropped counter up to date (the
        sink calls this at step boundaries, rate-limited). Single-process mode: nothing to do (every family is
        computed at collection time)."""
        if self._mp is not None and not self._closed:
            self._mp.refresh()

    # -- HTTP ----------------------------------------------------------------------------------------------------
    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve /metrics (text format, or OpenMetrics when the scraper asks for it) on ``addr:port``; returns the
        bound port (``port=0``: an ephemeral one). Multiprocess mode serves every process's metrics of the
        directory through a ``MultiProcessCollector``; one server per directory (a claim)."""
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
        up the server's claim and keeps the label set's while the process lives (its gauges stay in its files
        until it exits; see ``exporters.mpclaims``). In a child forked after the exporter was built, only the
        child's side is closed: no refresh (it would write the parent's label set into the child's files), the
        claims and the server stay the parent's."""
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
            if self._mp is not None and not forked:
                try:
                    self._mp.refresh()  # the last word on the dropped counter and the gauges
                except Exception as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
            self._closed = True
            if self._mp is not None:
                self._mp.closed = True
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
