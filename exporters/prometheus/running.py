"""Single-process mode, engine thread: the sink adds each step's statistics (``StepStats``), each violation and
each released request into plain running totals (``Totals``).

Contract: the sink runs inside the wrapper's lock, which serialises its calls, so it is the totals' only writer and
takes no lock of ours; it runs once per step boundary (and per violation or release), never per allocator call, and
does dictionary and list updates only: no I/O, no snapshot, no prometheus_client call. Readers
(``collectors.EventCollector``, any thread) copy what they read; a copy of a dict or a list is one C call that runs
no Python code, so no write interleaves with it.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable

from prometheus_client.samples import Exemplar

from exporters.prometheus.catalog import (
    ALLOCATED,
    EVICTED,
    FAILURES,
    FREED,
    OP_DURATION,
    OP_DURATION_BUCKETS,
    OVERHEAD,
    OVERHEAD_BUCKETS,
    OVERHEAD_ITERATION,
    REQUEST_PAGES,
    REQUEST_PAGES_BUCKETS,
    VIOLATIONS,
    Family,
    exemplar_labels,
)
from instrumented_alloc import INVARIANTS
from instrumented_alloc import events as ev
from instrumented_alloc.selfcost import PARTS

# The sink's per-event type tests, as module globals (one dictionary look-up each instead of two).
_STATS, _RELEASED, _VIOLATION = ev.StepStats, ev.RequestReleased, ev.ViolationEvent
_bisect_left = bisect.bisect_left


def new_running(bounds: tuple) -> list:
    """A histogram's running observations: ``[sum, count per bucket...]``, one bucket per finite bound plus +Inf.
    An amount counts in observe()'s bucket: the first whose bound is >= it (``bisect_left``)."""
    return [0.0] + [0] * (len(bounds) + 1)


class Totals:
    """Running totals of one exporter (single-process mode). Written by the sink only (see the module docstring).

    Every series has its creation time in ``created`` (keyed ``(family name, label values)``, the const labels
    left out) before its total appears, so a reader that finds a total finds its time. Series that alert rules
    and rate() must see before the first event exist from the start: every invariant, each pool's page counters,
    the full pool's failures of the ops the allocator has, the request-pages histogram and the self-cost."""

    def __init__(self, pools: Iterable[str], alloc_ops: Iterable[str], clock: Callable[[], float] = time.time):
        self._clock = clock
        self.created: dict[tuple, float] = {}
        self.violations: dict[str, int] = {}  # invariant -> count
        self.exemplars: dict[str, Exemplar] = {}  # invariant -> the latest violation's that had a trace id
        self.failures: dict[tuple[str, str], int] = {}  # (pool, op) -> count
        self.allocated: dict[str, int] = {}  # pool -> pages
        self.freed: dict[str, int] = {}
        self.durations: dict[str, list] = {}  # op -> new_running(OP_DURATION_BUCKETS)
        for inv in INVARIANTS:
            self._new(VIOLATIONS, (inv,), self.violations, inv, 0)
        for op in alloc_ops:
            self._new(FAILURES, ("full", op), self.failures, ("full", op), 0)
        for pool in pools:
            self._new(ALLOCATED, (pool,), self.allocated, pool, 0)
            self._new(FREED, (pool,), self.freed, pool, 0)
        now = clock()
        self.evicted = [0]
        self.created[EVICTED.name, ()] = now
        self.peak = new_running(REQUEST_PAGES_BUCKETS)  # under pool="full": the only pool a peak is observed in
        self.created[REQUEST_PAGES.name, ("full",)] = now
        self.overhead = [0.0] * len(PARTS)  # cumulative seconds per part, as of the last step boundary
        for part in PARTS:
            self.created[OVERHEAD.name, (part,)] = now
        self.iteration = new_running(OVERHEAD_BUCKETS)
        self.created[OVERHEAD_ITERATION.name, ()] = now

    def _new(self, family: Family, labels: tuple, d: dict, key, value):
        self.created[family.name, labels] = self._clock()
        d[key] = value
        return value

    # The sink's rare paths: a label seen for the first time, a violation, refusals.
    def new_pages(self, freed: bool, pool: str) -> int:
        if not freed:
            return self._new(ALLOCATED, (pool,), self.allocated, pool, 0)
        return self._new(FREED, (pool,), self.freed, pool, 0)

    def new_duration(self, op: str) -> list:
        return self._new(OP_DURATION, (op,), self.durations, op, new_running(OP_DURATION_BUCKETS))

    def add_violation(self, v) -> None:
        inv = v.invariant
        n = self.violations.get(inv)
        if n is None:
            n = self._new(VIOLATIONS, (inv,), self.violations, inv, 0)
        self.violations[inv] = n + 1
        labels = exemplar_labels(v.trace_id)
        if labels is not None:  # as Counter.inc(1, exemplar=...): the increment's amount, the wall time
            self.exemplars[inv] = Exemplar(labels, 1.0, time.time())

    def add_failures(self, failures: dict) -> None:
        for key, k in failures.items():
            n = self.failures.get(key)
            if n is None:
                n = self._new(FAILURES, key, self.failures, key, 0)
            self.failures[key] = n + k


def build_sink(totals: Totals, on_error: Callable[[Exception], None]) -> Callable:
    """The single-process sink over ``totals``: returns None, or False (a refused batch, which the bus counts as
    dropped) after handing the exception to ``on_error``. Never raises."""
    allocated, freed, durations = totals.allocated, totals.freed, totals.durations
    evicted, peak, overhead, iteration = totals.evicted, totals.peak, totals.overhead, totals.iteration
    n_parts = len(overhead)

    def add_pages(freed_: bool, d: dict, pages: dict) -> None:
        for pool, n in pages.items():
            total = d.get(pool)
            if total is None:
                total = totals.new_pages(freed_, pool)
            d[pool] = total + n

    def add_stats(e: ev.StepStats) -> None:
        if e.allocated:
            add_pages(False, allocated, e.allocated)
        if e.freed:
            add_pages(True, freed, e.freed)
        for op, xs in e.durations.items():  # one observation per call
            p = durations.get(op)
            if p is None:
                p = totals.new_duration(op)
            for x in xs:
                p[0] += x
                p[1 + _bisect_left(OP_DURATION_BUCKETS, x)] += 1
        if e.failures:
            totals.add_failures(e.failures)
        if e.evicted:
            evicted[0] += e.evicted
        o = e.overhead
        if o:  # a step() boundary (flush and sweeps close no iteration)
            overhead[:] = o[:n_parts]  # cumulative seconds per part: the running totals themselves
            x = e.iteration_seconds
            iteration[0] += x
            iteration[1 + _bisect_left(OVERHEAD_BUCKETS, x)] += 1

    def sink(batch) -> bool | None:
        try:
            for e in batch:
                t = type(e)
                if t is _STATS:
                    add_stats(e)
                elif t is _RELEASED:
                    # One peak per request (its largest page count in any pool, the full pool's for every
                    # allocator here): observed under pool="full".
                    x = e.pages_peak
                    peak[0] += x
                    peak[1 + _bisect_left(REQUEST_PAGES_BUCKETS, x)] += 1
                elif t is _VIOLATION:
                    totals.add_violation(e.violation)
            return None
        except Exception as exc:  # never reach the allocator's caller; the bus counts the batch as dropped
            on_error(exc)
            return False

    return sink
