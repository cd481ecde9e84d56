"""The exporters' cost, each measured as a ratio in one process, median of the repeats (a warm-up pair first).

Engine loop rows: the same engine-like loop of wrapped extend / decode / free calls (32 requests of 40 prompt
tokens, 24 decode steps each, a ``step()`` per decode; the requests are then freed and released one by one) with
one exporter attached vs none, interleaved. Short-lived requests: what an exporter pays per request (a span, its
events, a histogram observation) weighs heavily here. The OTel exporter gets its own provider as deployed (the
default sampler, its ``CountingBatchSpanProcessor``: the fast span path) exporting to an in-memory span exporter
(``span_exporter=``: no encoding, no network). One more OTel row runs the same under ``OTEL_TRACES_SAMPLER=
parentbased_traceidratio``, ``OTEL_TRACES_SAMPLER_ARG=0.1`` (about one request in ten traced): what a sampler saves.

Demo engine rows (one per exporter): the demo engine (``instrumented_alloc.sim``, preset swa-128: continuous
batching, chunked prefill, SWA eviction every 64 tokens; prompts of a median 256 tokens and outputs of a median 128
decode steps, lognormal, so the batch changes every few steps) run for ``demo_steps`` steps wrapped in record mode,
without and then with one exporter deployed as the demo deploys it: Prometheus
served on 127.0.0.1 and scraped over HTTP every second by a thread; OTel exporting OTLP/HTTP (protobuf, the
exporter's own ``BatchSpanProcessor``) to a receiver in another process; the flight recorder writing a SQLite file
in a temporary directory with its defaults (``make demo`` adds only ``max_bytes``, which this short run never
reaches). Same seed for both runs of a pair.

In every row the exporter's ``close()``/``shutdown()`` is inside the timed region and the clock is the process's
(CPU time by default): the recorder's writer, the span processor's worker (OTLP encoding included) and the scrape
thread finish their backlog there, so their work is counted, not left behind. (Scrapes and statistics at scale:
``bench_scale``.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import CLOCKS, scrape_every, table
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator

I64 = torch.int64
PS = 16


def engine_loop(alloc, *, iterations: int, bs: int = 32, prompt: int = 40, decode: int = 24) -> float:
    """Seconds for ``iterations`` rounds of: extend bs requests, decode them ``decode`` steps, free them."""
    t0 = time.perf_counter()
    n = 0
    for _ in range(iterations):
        rids = [f"r{n + i}" for i in range(bs)]
        n += bs
        zero = torch.zeros(bs, dtype=I64)
        seq = torch.full((bs,), prompt, dtype=I64)
        with alloc.batch(rids):
            out = alloc.alloc_extend(zero, zero, seq, seq.clone(), torch.full((bs,), -1, dtype=I64), bs * prompt)
            rows = [out.view(bs, prompt)]
            last = rows[0][:, -1]
            for d in range(decode):
                s = seq + d + 1
                last = alloc.alloc_decode(s, s, last)
                rows.append(last[:, None])
                alloc.step()
        kv = torch.cat(rows, dim=1)
        for i, rid in enumerate(rids):
            alloc.free(kv[i])
            alloc.release_request(rid)
        alloc.step()
    return time.perf_counter() - t0


def _wrapped(pages: int = 4096):
    return InstrumentedAllocator(PagedTokenToKVPoolAllocator(pages * PS, PS, torch.float16, "cpu"), mode="record")


@contextlib.contextmanager
def _environ(**values: str):
    """``values`` set in ``os.environ`` for the block (the OTel SDK reads its sampler there), then put back."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


SAMPLED = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}


def _attach(kind: str, alloc, tmp: Path):
    if kind == "prometheus":
        from prometheus_client import CollectorRegistry

        from exporters.prometheus import PrometheusExporter

        return PrometheusExporter(alloc, registry=CollectorRegistry())
    if kind == "otel":
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from exporters.otel import OtelExporter

        return OtelExporter(alloc, span_exporter=InMemorySpanExporter())
    if kind == "otel-sampled":
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from exporters.otel import OtelExporter

        with _environ(**SAMPLED):
            return OtelExporter(alloc, span_exporter=InMemorySpanExporter())
    if kind == "recorder":
        from exporters.recorder import FlightRecorder

        return FlightRecorder(alloc, tmp / f"rec-{time.monotonic_ns()}.sqlite")
    raise ValueError(kind)


def _close(exporter) -> None:
    for name in ("close", "shutdown"):
        fn = getattr(exporter, name, None)
        if fn is not None:
            fn()
            return


def measure_exporter(kind: str, *, iterations: int, repeats: int, clock=time.process_time) -> list[float]:
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        engine_loop(_wrapped(), iterations=2)  # warm-up: first calls pay for lazy initialisation
        for warm_up in (True, *([False] * repeats)):
            base = _wrapped()
            t0 = clock()
            engine_loop(base, iterations=iterations)
            t_off = clock() - t0
            alloc = _wrapped()
            exporter = _attach(kind, alloc, Path(tmp))
            t0 = clock()
            engine_loop(alloc, iterations=iterations)
            _close(exporter)
            t_on = clock() - t0
            if not warm_up:
                ratios.append(t_on / t_off)
    return ratios


DEMO_PRESET = "swa-128"


def _deploy(kind: str, alloc, endpoint: str, tmp: Path | None = None):
    """Attach ``kind`` to a demo engine's allocator as the demo deploys it; returns the function that stops it.
    ``tmp``: the directory the recorder's file goes in."""
    if kind == "prometheus":
        from exporters.prometheus import PrometheusExporter

        exp = PrometheusExporter(alloc)
        stop_scraping = scrape_every(exp.serve(0))

        def close():
            stop_scraping()
            exp.close()

        return close
    if kind == "otel":
        from exporters.otel import OtelExporter

        return OtelExporter(alloc, endpoint=endpoint).shutdown
    if kind == "recorder":
        from exporters.recorder import FlightRecorder

        return FlightRecorder(alloc, tmp / f"demo-{time.monotonic_ns()}.sqlite").close
    raise ValueError(kind)


def measure_demo(kind: str, *, steps: int, repeats: int, endpoint: str, clock=time.process_time) -> list[float]:
    """Ratios (with ``kind`` / without) of the demo engine's CPU time for ``steps`` steps, wrapped in record mode."""
    from instrumented_alloc.sim import build_engine

    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for r, warm_up in enumerate((True, *([False] * repeats))):
            off = build_engine(DEMO_PRESET, seed=r)
            t0 = clock()
            off.run(steps)
            t_off = clock() - t0
            on = build_engine(DEMO_PRESET, seed=r)
            stop = _deploy(kind, on.alloc, endpoint, Path(tmp))
            t0 = clock()
            on.run(steps)
            stop()
            t_on = clock() - t0
            if not warm_up:
                ratios.append(t_on / t_off)
    return ratios


def rows(*, repeats: int, iterations: int, clock, demo_steps: int = 3000) -> list:
    from benchmarks.bench_engine import _ReceiverProcess

    out = [
        (
            f"engine loop with {kind} / without (record mode)",
            measure_exporter(kind, iterations=iterations, repeats=repeats, clock=clock),
            "<= 1.15",
        )
        for kind in ("prometheus", "otel", "recorder")
    ]
    out.insert(
        2,
        (
            "engine loop with otel, parentbased_traceidratio 0.1 / without (record mode)",
            measure_exporter("otel-sampled", iterations=iterations, repeats=repeats, clock=clock),
            "",
        ),
    )
    with _ReceiverProcess() as rx:
        for kind, how in (
            ("prometheus", "scraped every 1 s"),
            ("otel", "OTLP/HTTP to a receiver process"),
            ("recorder", "a SQLite file"),
        ):
            out.append(
                (
                    f"demo {DEMO_PRESET} {demo_steps} steps with {kind} / without (record mode, {how})",
                    measure_demo(kind, steps=demo_steps, repeats=repeats, endpoint=rx.endpoint, clock=clock),
                    "",
                )
            )
    return out


def measure_scrape(num_pages: int, repeats: int) -> list[float]:
    from prometheus_client import CollectorRegistry, generate_latest

    from exporters.prometheus import PrometheusExporter

    inner = PagedTokenToKVPoolAllocator(num_pages * PS, PS, torch.float16, "cpu")
    alloc = InstrumentedAllocator(inner, mode="record")
    # Fragment the pool: allocate, then free every other request.
    bs = 1024
    zero = torch.zeros(bs, dtype=I64)
    seq = torch.full((bs,), 5 * PS, dtype=I64)
    rids = [f"r{i}" for i in range(bs)]
    with alloc.batch(rids):
        out = alloc.alloc_extend(zero, zero, seq, seq.clone(), torch.full((bs,), -1, dtype=I64), bs * 5 * PS)
    rows = out.view(bs, 5 * PS)
    for i in range(0, bs, 2):
        alloc.free(rows[i])
        alloc.release_request(rids[i])
    alloc.step()
    registry = CollectorRegistry()
    PrometheusExporter(alloc, registry=registry)
    ratios = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate_latest(registry)
        t_scrape = time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.sort(inner.free_pages)
        t_sort = time.perf_counter() - t0
        ratios.append(t_scrape / t_sort)
    return ratios


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--demo-steps", type=int, default=3000)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rs = rows(repeats=args.repeats, iterations=args.iterations, clock=CLOCKS[args.clock][1], demo_steps=args.demo_steps)
    rs.append(("one scrape of 1M pages / one torch.sort of its free list", measure_scrape(1 << 20, args.repeats), ""))
    out = table(rs)
    print(out)
    return out


if __name__ == "__main__":
    main()
