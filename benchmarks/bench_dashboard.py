"""``python -m benchmarks.bench_dashboard``: how long the dashboard's incident view takes on a large recording.

Writes (once; reused with ``--keep PATH``) a recording of about ``--events`` events -- by the demo engine
(``--engine demo``, the default: ``instrumented-alloc demo --preset swa-128`` with the seed's bug and a leak
injected) or by the tests' scripted engine with SWA pools of ``--pages`` pages (``--engine scenario``) -- then
runs the real app script headless (Streamlit's AppTest: the whole script, every query, replay, page map and
PNG encoding, no browser paint) at several steps: the first violation, the middle, the last step, and steps
chosen at random, and prints the time of each full render, then the live view's. Also prints the parts (state
at the step, page maps, lifeline) measured on their own. A measurement, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_scenario(path: Path, events: int, pages: int) -> None:
    """The tests' scripted engine: SWA pools of ``pages`` pages each (a million: the page map's downsampling)."""
    from exporters.recorder import Recording
    from tests.dashboard.scenario import Scenario

    faults = [("swa-misaligned", 50), ("leak", 3000)]
    sc = Scenario(path, pages=pages, window=12, snapshot_every=100, faults=faults, seed=11)
    try:
        with Recording(path) as r:
            while True:
                sc.run(500)
                if sc.rec.flush() and r.event_count() >= events:
                    break
            sc.faults = [("double-free", sc.alloc.step_count + 1)]
            sc.run(5)
    finally:
        sc.close()


def build_demo(path: Path, events: int, preset: str) -> None:
    """The demo engine (``instrumented-alloc demo``) for as many steps as make about ``events`` events (events
    per step measured on a 2,000-step run of the same preset and seed first)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    from exporters.recorder import Recording

    def run(p: Path, steps: int) -> None:
        # The seed's bug early, a leak half-way: the incident view has violations to jump to.
        subprocess.run(
            [sys.executable, "-m", "instrumented_alloc.cli", "demo", "--preset", preset, "--steps", str(steps),
             "--seed", "11", "--inject", "swa-misaligned@50", "--inject", f"leak@{steps // 2}", "--record", str(p),
             "--overwrite"],
            check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
        )  # fmt: skip

    probe = path.with_suffix(".probe.sqlite")
    run(probe, 2000)
    with Recording(probe) as r:
        per_step = r.event_count() / r.steps()[1]
    probe.unlink()
    run(path, int(events / per_step * 1.02) + 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_dashboard")
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument(
        "--engine",
        choices=("demo", "scenario"),
        default="demo",
        help="demo: instrumented-alloc demo (default); scenario: the tests' engine, pools of --pages",
    )
    p.add_argument("--preset", default="swa-128", help="demo preset (default swa-128)")
    p.add_argument("--pages", type=int, default=1 << 20, help="scenario: pages per pool (default 1,048,576)")
    p.add_argument("--keep", type=Path, default=None, help="recording path to reuse (written when missing)")
    p.add_argument("--samples", type=int, default=5, help="random steps measured (default 5)")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from streamlit.testing.v1 import AppTest

    from dashboard import data, pagemap, views
    from dashboard.app_config import ENV_DIR, ENV_RECORDING, ENV_REFRESH
    from exporters.recorder import Recording

    tmp = None
    path = a.keep
    if path is None:
        tmp = tempfile.TemporaryDirectory()
        path = Path(tmp.name) / "large.sqlite"
    if not path.exists():
        t0 = time.perf_counter()
        if a.engine == "demo":
            build_demo(path, a.events, a.preset)
        else:
            build_scenario(path, a.events, a.pages)
        print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    with Recording(path) as r:
        first, last = r.steps()
        n_events = r.event_count()
        vs = r.violations()
        pools = r.meta["pools"]
    print(f"recording: {n_events:,} events, steps {first}..{last}, {len(vs)} violations, pools "
          + ", ".join(f"{q['name']} {q['num_pages']:,} pages" for q in pools)
          + f", {path.stat().st_size / 1e6:.0f} MB")  # fmt: skip

    os.environ[ENV_DIR] = str(path.parent)
    os.environ[ENV_RECORDING] = path.name
    os.environ[ENV_REFRESH] = "3600"
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=600)
    t0 = time.perf_counter()
    at.run()
    cold = time.perf_counter() - t0
    assert not at.exception, [e.value for e in at.exception]
    rng = random.Random(0)
    steps = [("first violation", vs[0].step if vs else first), ("middle", (first + last) // 2), ("last", last)]
    steps += [("random", rng.randint(first, last)) for _ in range(a.samples)]
    print(f"\nfull render of the incident view (AppTest, whole script) -- first load: {cold * 1000:.0f} ms")
    times = []
    for label, step in steps:
        at.slider(key="step").set_value(step)
        t0 = time.perf_counter()
        at.run()
        dt = time.perf_counter() - t0
        assert not at.exception, [e.value for e in at.exception]
        times.append(dt)
        print(f"  step {step:>7} ({label:<15}) {dt * 1000:8.0f} ms")
    print(f"  median {statistics.median(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms over {len(times)} steps")
    at.radio(key="view").set_value("Live")
    live = []
    for _ in range(3):
        t0 = time.perf_counter()
        at.run()
        live.append(time.perf_counter() - t0)
        assert not at.exception, [e.value for e in at.exception]
    print(f"live view (whole script, once per refresh): median {statistics.median(live) * 1000:.0f} ms of 3")

    print("\nparts, on their own (median of 3):")
    with Recording(path) as r:
        step = (first + last) // 2

        def med(fn):
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts) * 1000

        st = data.state_end_of(r, step)
        print(f"  state at the end of step {step}: {med(lambda: data.state_end_of(r, step)):.0f} ms")
        print(f"  page map of each pool: {med(lambda: [pagemap.page_map(st.owners[q['name']]) for q in pools]):.0f} ms")
        print(f"  SWA-evicted marking (100 steps of events): "
              f"{med(lambda: views.swa_evicted_pages(data.recent_events(r, step, 100))):.0f} ms")  # fmt: skip
        if vs and vs[0].rid is not None:
            rid = vs[0].rid

            def life():
                ev, led, _, _ = data.request_history(r, rid, first)
                views.lifeline(rid, ev, start_ledger=led)

            print(f"  lifeline of {rid}: {med(life):.0f} ms")
        print(f"  step figures: {med(lambda: views.step_figures(st, pools, r.meta.get('sliding_window'))):.0f} ms")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
