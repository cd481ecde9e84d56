"""Single-process mode, scrape time: custom collectors that build the catalog's families when collected.

Contract: ``collect()`` runs on whichever thread collects (the HTTP server's, a caller of ``generate_latest`` or
``get_sample_value``) and never writes what the sink writes. ``EventCollector`` reads the sink's running totals
(copies, no lock), so what it yields is exact as of some point of the engine's run: at most one observation may be
in a histogram's sum and not yet in its buckets. ``GaugeCollector`` takes ``alloc.snapshot(wait=False)`` (the
wrapper's lock, briefly: an O(num_pages) copy) and ``bus.drop_counts()``. A failure is handed to ``on_error`` and
the family left out of that collection (absent, not wrong): a scrape never fails because of us.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from exporters.prometheus import catalog
from exporters.prometheus.catalog import PREFIX, Family
from exporters.prometheus.running import Totals
from instrumented_alloc import stats
from instrumented_alloc.selfcost import PARTS


def created_series_enabled() -> bool:
    """Whether prometheus_client's own metrics export ``_created`` series now (``PROMETHEUS_DISABLE_CREATED_SERIES``,
    ``disable_created_metrics()``): asked of an unregistered counter, through its public ``collect()``."""
    probe = Counter("kvalloc_created_probe", "probe", registry=None)
    return any(s.name.endswith("_created") for s in probe.collect()[0].samples)


def empty_family(family: Family, const_names: tuple):
    """``family`` without samples: what ``describe()`` returns (the registry checks names on it)."""
    labels = (*const_names, *family.labels)
    if family.kind == "counter":
        return CounterMetricFamily(PREFIX + family.name, family.doc, labels=labels)
    if family.kind == "histogram":
        return HistogramMetricFamily(PREFIX + family.name, family.doc, labels=labels)
    return GaugeMetricFamily(PREFIX + family.name, family.doc, labels=labels)


class EventCollector:
    """The counters and histograms of ``catalog.EVENT_FAMILIES``, built from a ``running.Totals`` per collection,
    with the samples a prometheus_client ``Counter``/``Histogram`` would have (``_created`` included, when those
    are on; the latest violation's exemplar on its counter)."""

    def __init__(self, totals: Totals, const_names: tuple, const_values: tuple, on_error: Callable):
        self._t = totals
        self._names = const_names
        self._values = const_values
        self._on_error = on_error
        self._le = {
            f.name: (*(floatToGoString(b) for b in f.buckets), "+Inf") for f in catalog.EVENT_FAMILIES if f.buckets
        }

    def describe(self) -> list:
        return [empty_family(f, self._names) for f in catalog.EVENT_FAMILIES]

    def collect(self) -> Iterable:
        t = self._t
        # Looked up after each totals copy: the sink writes a series' creation time before its total.
        created = t.created if created_series_enabled() else None
        builds = (
            lambda: self._counter(catalog.VIOLATIONS, t.violations, created, t.exemplars.copy()),
            lambda: self._counter(catalog.FAILURES, t.failures, created),
            lambda: self._counter(catalog.ALLOCATED, t.allocated, created),
            lambda: self._counter(catalog.FREED, t.freed, created),
            lambda: self._counter(catalog.EVICTED, {(): t.evicted[0]}, created),
            lambda: self._histogram(catalog.OP_DURATION, t.durations, created),
            lambda: self._histogram(catalog.REQUEST_PAGES, {"full": t.peak}, created),
            lambda: self._counter(catalog.OVERHEAD, dict(zip(PARTS, t.overhead[:])), created),
            lambda: self._histogram(catalog.OVERHEAD_ITERATION, {(): t.iteration}, created),
        )
        out = []
        for build in builds:  # in catalog.EVENT_FAMILIES's order
            try:
                out.append(build())
            except Exception as exc:  # a scrape must never fail because of us
                self._on_error(exc)
        return out

    def _labels(self, key) -> tuple:
        return key if isinstance(key, tuple) else (key,)

    def _counter(self, family: Family, totals: Mapping, created: dict | None, exemplars: Mapping | None = None):
        fam = CounterMetricFamily(PREFIX + family.name, family.doc, labels=(*self._names, *family.labels))
        for key, total in totals.copy().items():
            own = self._labels(key)
            fam.add_metric(
                (*self._values, *own),
                float(total),
                created=None if created is None else created.get((family.name, own)),
                exemplar=exemplars.get(key) if exemplars else None,
            )
        return fam

    def _histogram(self, family: Family, running: Mapping, created: dict | None):
        names = (*self._names, *family.labels)
        fam = HistogramMetricFamily(PREFIX + family.name, family.doc, labels=names)
        le = self._le[family.name]
        for key, p in running.copy().items():
            p = p[:]
            own = self._labels(key)
            acc = 0
            buckets = []
            for bound, n in zip(le, p[1:]):
                acc += n
                buckets.append((bound, float(acc)))
            values = (*self._values, *own)
            fam.add_metric(values, buckets, p[0])
            when = None if created is None else created.get((family.name, own))
            if when is not None:
                fam.add_sample(fam.name + "_created", dict(zip(names, values)), when)
        return fam


class GaugeCollector:
    """The gauges and the dropped counter, computed from ``alloc.snapshot(wait=False)`` (never waits for deferred
    device checks) and ``alloc.bus.drop_counts()`` per collection; never per allocator call."""

    def __init__(self, alloc, const_names: tuple, const_values: tuple, on_error: Callable):
        self._alloc = alloc
        self._names = const_names
        self._values = const_values
        self._on_error = on_error

    def describe(self) -> list:
        return [*(empty_family(f, self._names) for f in catalog.GAUGES), self.dropped_family()]

    def collect(self) -> list:
        try:
            fams = self.gauge_families(stats.figures(self._alloc.snapshot(wait=False)))
        except Exception as exc:  # a scrape must never take the engine (or the HTTP server) down
            self._on_error(exc)
            fams = []
        try:
            fams.append(self.dropped_family(self._alloc.bus.drop_counts()))
        except Exception as exc:
            self._on_error(exc)
        return fams

    def gauge_families(self, fig: dict) -> list:
        fams = {f.name: empty_family(f, self._names) for f in catalog.GAUGES}
        for name, labels, value in gauge_values(fig):
            fams[name].add_metric(self._values + labels, float(value))
        return list(fams.values())

    def dropped_family(self, dropped: Mapping[str, int] | None = None) -> CounterMetricFamily:
        fam = empty_family(catalog.DROPPED, self._names)
        for sink, n in sorted((dropped or {}).items()):
            fam.add_metric((*self._values, str(sink)), float(n))
        return fam


def gauge_values(fig: dict) -> Iterable[tuple[str, tuple, float]]:
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
