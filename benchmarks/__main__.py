"""``python -m benchmarks [--quick] [--repeats N] [--clock cpu|wall]``: the whole suite, ONE table of ratios
(median of the runs, min and max beside it), each measured side by side in one process run.

Sections (see each module's docstring for what exactly is timed): wrapped / bare per operation
(``bench_ops``), the exporters on vs off (``bench_exporters``), statistics and a scrape vs a sort of the free list,
recording seek, and the wrapper's memory (``bench_scale``), the demo engine's step loop with everything on vs the
bare allocator and its resident memory over a 200k-step run (``bench_engine``; the 1M-step run with every exporter
on is ``make soak``), and SGLang's real Engine on the CPU with the plugin vs bare (``bench_sglang``: its
per-iteration row is microseconds, not a ratio). ``--quick`` (about a third of the time): fewer calls per sample,
no 4M-page pool, a 1M-event recording instead of 10M, a 50k-step RSS run, SGLang's record configuration only.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import bench_engine, bench_exporters, bench_ops, bench_scale, bench_sglang
from benchmarks.common import CLOCKS, table


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a shorter run (fewer calls per sample, smaller sizes)")
    p.add_argument("--repeats", type=int, default=5, help="runs per case (the median of them is reported)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="cpu (default) or wall time")
    p.add_argument(
        "--only",
        choices=("ops", "exporters", "engine", "stats", "seek", "memory", "rss", "sglang"),
        action="append",
        help="run only these",
    )
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error("--repeats: at least 5 runs per case")
    torch.set_num_threads(1)
    thread_clock, process_clock = CLOCKS[args.clock]
    only = set(args.only or ("ops", "exporters", "engine", "stats", "seek", "memory", "rss", "sglang"))
    started = time.perf_counter()
    rows: list = []

    def section(name: str, make) -> None:
        if name in only:
            t0 = time.perf_counter()
            rows.extend(make())
            print(f"[{name}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)

    section("ops", lambda: bench_ops.rows(repeats=args.repeats, quick=args.quick, clock=thread_clock))
    section(
        "exporters",
        lambda: bench_exporters.rows(
            repeats=args.repeats,
            iterations=10 if args.quick else 20,
            clock=process_clock,
            demo_steps=1000 if args.quick else 3000,
        ),
    )
    section("stats", lambda: bench_scale.stats_rows(repeats=args.repeats, quick=args.quick, clock=thread_clock))
    section("seek", lambda: bench_scale.seek_rows(repeats=args.repeats, quick=args.quick, clock=thread_clock))
    section("engine", lambda: bench_engine.loop_rows(repeats=args.repeats, quick=args.quick, clock=process_clock))
    section("memory", bench_scale.memory_rows)
    section("rss", lambda: bench_engine.rss_rows(quick=args.quick))
    # SGLang's real Engine, bare vs the plugin on (benchmarks/bench_sglang.py; 3 pairs of Engine starts per
    # configuration; --quick: the record configuration at batch 64 only).
    section(
        "sglang",
        lambda: bench_sglang.rows(configs=("record",), batches=(64,))
        if args.quick
        else bench_sglang.rows(configs=bench_sglang.CONFIGS),
    )
    title = (
        f"python -m benchmarks{' --quick' if args.quick else ''} --repeats {args.repeats} --clock {args.clock}: "
        f"ratios (memory rows: bytes), median of {args.repeats} runs; torch {torch.__version__}, 1 thread; "
        f"{time.perf_counter() - started:.0f} s"
    )
    out = table(rows, title)
    print(out)
    return out


main()
