"""The demo engine's step loop, everything on / bare, and the resident memory of a long demo run.

Step loop: two engines on the same preset, seed and workload -- one driving the bare reference allocator, one the
wrapper in record mode with the Prometheus exporter (its metrics scraped over HTTP by a thread), the OTel exporter
(OTLP/HTTP to a receiver in another process, as a collector would be) and the flight recorder -- each run for
``steps`` steps, one after the other; the ratio is the CPU time of the whole process over each run, and the full
engine's run ends with closing its exporters (the recorder's writer, the span processor's worker and the scrape
thread finish their backlog inside the timed region). The runs are not interleaved in chunks: the exporters'
threads would go on working while the bare engine's chunk is timed, and their work would be charged to it. A
warm-up pair first, not counted; then ``repeats`` pairs, each on its own seed.

RSS: the resident set of a wrapped demo engine (record mode, no exporters) at the end of its warm-up and at the end
of a 200,000-step run (50,000 with ``--quick``); ``make soak`` measures 1,000,000 steps with every exporter on.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import scrape_every
from benchmarks.soak import rss_bytes

PRESET = "swa-128"


class _ReceiverProcess:
    """The OTLP receiver in its own process, so its decoding is not counted as the exporter's cost."""

    def __enter__(self):
        code = ("import sys, time; from tests.otlp_receiver import Receiver; r = Receiver(keep=False); "
                "print(r.endpoint, flush=True); sys.stdin.read()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=Path(__file__).resolve().parents[1])
        self.endpoint = self.proc.stdout.readline().strip()
        return self

    def __exit__(self, *exc):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _everything_on(seed: int, workdir: Path, endpoint: str):
    from exporters.otel import OtelExporter
    from exporters.prometheus import PrometheusExporter
    from exporters.recorder import FlightRecorder
    from instrumented_alloc.sim import build_engine

    eng = build_engine(PRESET, seed=seed)
    prom = PrometheusExporter(eng.alloc, const_labels={"engine": "bench"})
    port = prom.serve(0)
    otel = OtelExporter(eng.alloc, endpoint=endpoint)
    rec = FlightRecorder(eng.alloc, workdir / f"bench-{seed}.sqlite", overwrite=True)
    stop_scraping = scrape_every(port)

    def close():
        stop_scraping()
        rec.close()
        otel.shutdown()
        prom.close()

    return eng, close


def loop_rows(*, repeats: int, quick: bool, clock) -> list:
    from instrumented_alloc.sim import build_engine

    steps = 1500 if quick else 4000
    ratios, self_cost, added = [], [], []
    with _ReceiverProcess() as rx, tempfile.TemporaryDirectory(prefix="kvalloc-bench-") as tmp:
        for r, warm_up in enumerate((True, *([False] * repeats))):
            bare = build_engine(PRESET, seed=r, wrapped=False)
            t0 = clock()
            for _ in range(steps):
                bare.step()
            t_bare = clock() - t0
            full, close = _everything_on(r, Path(tmp), rx.endpoint)
            t0 = clock()
            cost0 = full.alloc.cost.total() - full.alloc.cost.aside
            try:
                for _ in range(steps):
                    full.step()
            finally:
                close()
            t_full = clock() - t0
            if not warm_up:
                ratios.append(t_full / t_bare)
                # The wrapper's own accounting (the engine's thread, see selfcost) beside the difference measured
                # from outside (every thread of the process: the exporters' background work too).
                self_cost.append(1e6 * (full.alloc.cost.total() - full.alloc.cost.aside - cost0) / steps)
                added.append(1e6 * (t_full - t_bare) / steps)
    label = f"demo step loop ({PRESET}, {steps} steps)"
    return [
        (f"{label}: everything on / bare", ratios, "<= 1.3"),
        (f"{label}: self-cost us/step, everything on (not a ratio)", self_cost, ""),
        (f"{label}: added us/step, everything on - bare (not a ratio)", added, ""),
    ]


def rss_rows(*, quick: bool) -> list:
    from instrumented_alloc.sim import build_engine

    # 1M steps with every exporter on is the soak's run (``make soak``); here the wrapper alone, shorter.
    steps = 50_000 if quick else 200_000
    warm = max(2000, steps // 10)
    eng = build_engine(PRESET, seed=0)
    t0 = time.perf_counter()
    eng.run(warm)
    start = rss_bytes()
    eng.run(steps - warm)
    end = rss_bytes()
    eng.shutdown()
    label = f"demo RSS over {steps:,} steps ({PRESET}, wrapped, {time.perf_counter() - t0:.0f} s)"
    return [
        (f"{label}: bytes after warm-up", [float(start)], "bytes"),
        (f"{label}: bytes at the end", [float(end)], "bytes"),
        (f"{label}: end / after warm-up", [end / start], "< 1.05"),
    ]
