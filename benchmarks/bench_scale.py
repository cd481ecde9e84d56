"""Scale: statistics and a Prometheus scrape against a sort of the free list, recording seek, memory.

- ``stats at N pages / one torch.sort of the free list``: ``stats.figures(alloc.snapshot())`` (the snapshot's
  copies included: that is what every consumer pays) on a fragmented pool of N pages, against one ``torch.sort``
  of the same allocator's free list, alternated in one process. Likewise one ``generate_latest`` of a
  ``PrometheusExporter``'s registry (a whole scrape: gauges from a snapshot, counters, histograms).
  The pool is a page-size-1 allocator (a page is a slot), so that filling half of a 4M-page pool stays a 2M-entry
  tensor; the figures depend on the number of pages, not on the page size.
- ``state_at on a 10M-event recording / on a 100k-event recording``: the small recording is written by the real
  ``FlightRecorder`` behind the exporter benchmark's engine loop; the large one is that file with its events and
  snapshots repeated (seq and step shifted past the previous copy, in SQL: writing 10M events through the
  recorder takes longer than this whole suite may). Each copy starts from a copy of the initial snapshot, so every
  step of the large file replays exactly as the corresponding step of the small one. ``state_at`` is timed at the
  same relative positions in both files; the ratio is the mean over those positions.
- Memory: bytes of the wrapper's own state (``tracemalloc``: numpy arrays and Python objects; the inner
  allocator's tensors are not counted) per page of the pool, and per live request (the ledger's columns, its
  dictionaries and lists, the request's page counts), marginal figures between two sizes.
"""

from __future__ import annotations

import gc
import shutil
import sqlite3
import statistics
import tempfile
import tracemalloc
from pathlib import Path

import torch

from instrumented_alloc import InstrumentedAllocator, stats
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

I64 = torch.int64


# -- stats and scrape ----------------------------------------------------------------------------------------------
def fragmented_pool(num_pages: int, requests: int = 2048):
    """A wrapped page-size-1 pool of ``num_pages`` pages, half handed out to ``requests`` requests, every other
    request freed again (``requests // 2`` free runs)."""
    inner = TokenToKVPoolAllocator(num_pages, torch.float16, "cpu")
    alloc = InstrumentedAllocator(inner, mode="record")
    each = max(1, num_pages // (2 * requests))
    rids = [f"r{i}" for i in range(requests)]
    with alloc.batch(rids, lens=[each] * requests):
        out = alloc.alloc(each * requests)
    rows = out.view(requests, each)
    for i in range(0, requests, 2):
        alloc.free(rows[i])
        alloc.release_request(rids[i])
    alloc.step()
    return inner, alloc


def measure_stats(num_pages: int, repeats: int, clock) -> tuple[list[float], list[float]]:
    """(stats / sort ratios, scrape / sort ratios)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from exporters.prometheus import PrometheusExporter

    inner, alloc = fragmented_pool(num_pages)
    registry = CollectorRegistry()
    exporter = PrometheusExporter(alloc, registry=registry)
    s_ratios, p_ratios = [], []
    try:
        for warm_up in (True, *([False] * repeats)):
            t0 = clock()
            torch.sort(inner.free_pages)
            t_sort = clock() - t0
            t0 = clock()
            stats.figures(alloc.snapshot())
            t_stats = clock() - t0
            t0 = clock()
            generate_latest(registry)
            t_scrape = clock() - t0
            t0 = clock()
            torch.sort(inner.free_pages)
            t_sort = (t_sort + clock() - t0) / 2
            if not warm_up:
                s_ratios.append(t_stats / t_sort)
                p_ratios.append(t_scrape / t_sort)
    finally:
        exporter.close()
    return s_ratios, p_ratios


# -- recording seek -------------------------------------------------------------------------------------------------
def write_recording(path: Path, events: int) -> int:
    """A recording of at least ``events`` events from the exporter benchmark's engine loop; returns the count."""
    from benchmarks.bench_exporters import _wrapped, engine_loop
    from exporters.recorder import FlightRecorder, Recording

    alloc = _wrapped(pages=8192)
    rec = FlightRecorder(alloc, path, snapshot_every=100)
    try:
        while alloc._w_st.seq < events:
            engine_loop(alloc, iterations=20)
    finally:
        rec.close()
    with Recording(path):  # a complete, readable recording
        pass
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT sum(n) FROM blocks").fetchone()[0]
    finally:
        conn.close()


def replicate(src: Path, dst: Path, copies: int) -> int:
    """``dst``: ``src`` with its events and snapshots repeated ``copies`` times in all (see the module docstring).
    Returns the number of events."""
    shutil.copyfile(src, dst)
    conn = sqlite3.connect(dst, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = OFF")
        conn.execute("PRAGMA synchronous = OFF")
        seq_span = conn.execute("SELECT max(last) FROM blocks").fetchone()[0] + 1
        step_span = conn.execute("SELECT max(last_step) FROM blocks").fetchone()[0] + 1
        conn.execute("BEGIN")
        for k in range(1, copies):
            ds, dt = k * seq_span, k * step_span
            # A block's events carry their seq and step relative to the block's: shifting the columns shifts its
            # events.
            conn.execute(
                "INSERT INTO blocks SELECT seq + ?1, last + ?1, step + ?2, last_step + ?2, n, kinds, payload "
                "FROM blocks WHERE seq < ?3",
                (ds, dt, seq_span),
            )
            conn.execute(
                "INSERT INTO segments SELECT seq + ?1, last + ?1, step + ?2, n, kinds, counts, boundary + ?1, "
                "available, block + ?1 FROM segments WHERE seq < ?3",
                (ds, dt, seq_span),
            )
            conn.execute(
                "INSERT INTO rids SELECT block + ?1, rid, step + ?2 FROM rids WHERE block < ?3", (ds, dt, seq_span)
            )
            conn.execute(
                "INSERT INTO snapshots SELECT seq + ?, step + ?, pool, num_pages, page_size, owner, ledger "
                "FROM snapshots WHERE seq < ?",
                (ds, dt, seq_span),
            )
        conn.execute("COMMIT")
        return conn.execute("SELECT sum(n) FROM blocks").fetchone()[0]
    finally:
        conn.close()


def _probe_steps(path: Path, n: int) -> list[int]:
    from exporters.recorder import Recording

    with Recording(path) as r:
        first, last = r.steps()
    return [first + (last - first) * (i + 1) // (n + 1) for i in range(n)]


def measure_seek(small: Path, large: Path, repeats: int, clock, probes: int = 12) -> list[float]:
    from exporters.recorder import Recording

    ratios = []
    steps_small = _probe_steps(small, probes)
    steps_large = _probe_steps(large, probes)
    with Recording(small) as rs, Recording(large) as rl:
        for warm_up in (True, *([False] * repeats)):
            ts, tl = [], []
            for a, b in zip(steps_small, steps_large):
                t0 = clock()
                rs.state_at(a)
                ts.append(clock() - t0)
                t0 = clock()
                rl.state_at(b)
                tl.append(clock() - t0)
            if not warm_up:
                ratios.append(statistics.fmean(tl) / statistics.fmean(ts))
    return ratios


def seek_rows(*, repeats: int, quick: bool, clock) -> list:
    small_events = 100_000
    copies = 10 if quick else 100
    with tempfile.TemporaryDirectory(prefix="kvalloc-bench-") as tmp:
        small = Path(tmp) / "small.sqlite"
        large = Path(tmp) / "large.sqlite"
        n_small = write_recording(small, small_events)
        n_large = replicate(small, large, copies)
        ratios = measure_seek(small, large, repeats, clock)
    label = f"state_at on a {_count(n_large)}-event recording / on a {_count(n_small)}-event recording"
    return [(label, ratios, "<= 2")]


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n / 1e3:.0f}k"


# -- memory ---------------------------------------------------------------------------------------------------------
def _traced(fn) -> tuple[object, int]:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = fn()
        gc.collect()
        return out, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def bytes_per_page(small: int = 1 << 16, large: int = 1 << 20, ps: int = 16) -> float:
    def wrap(n):
        inner = PagedTokenToKVPoolAllocator(n * ps, ps, torch.float16, "cpu")
        return lambda: InstrumentedAllocator(inner, mode="record")

    a, b_small = _traced(wrap(small))
    del a
    a, b_large = _traced(wrap(large))
    del a
    return (b_large - b_small) / (large - small)


def bytes_per_request(small: int = 4096, large: int = 65536, ps: int = 16) -> float:
    def grow(n):
        inner = PagedTokenToKVPoolAllocator((large + 8) * ps, ps, torch.float16, "cpu")
        alloc = InstrumentedAllocator(inner, mode="record")
        rids = [f"req-{i}" for i in range(n)]

        def run():
            zero = torch.zeros(n, dtype=I64)
            seq = torch.full((n,), ps, dtype=I64)
            with alloc.batch(rids):
                alloc.alloc_extend(zero, zero, seq, seq.clone(), torch.full((n,), -1, dtype=I64), n * ps)
            alloc.step()
            return alloc

        return run

    a, b_small = _traced(grow(small))
    del a
    a, b_large = _traced(grow(large))
    del a
    return (b_large - b_small) / (large - small)


def memory_rows() -> list:
    return [
        ("memory: wrapper state, bytes per page (paged pool)", [bytes_per_page()], "bytes"),
        ("memory: wrapper state, bytes per live request", [bytes_per_request()], "bytes"),
    ]


def stats_rows(*, repeats: int, quick: bool, clock) -> list:
    out = []
    sizes = (1 << 16, 1 << 20) if quick else (1 << 16, 1 << 20, 1 << 22)
    for n in sizes:
        s, p = measure_stats(n, repeats, clock)
        label = f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}k"
        out.append((f"stats of {label} pages / one torch.sort of its free list", s, "<= 3" if n == 1 << 20 else ""))
        out.append((f"one scrape of {label} pages / one torch.sort of its free list", p, ""))
    return out

