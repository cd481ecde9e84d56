"""``python -m benchmarks.bench_dashboard``: how long the dashboard's incident view takes on a large recording.

Writes (once; reused with ``--keep PATH``) a recording of about ``--events`` events from the dashboard tests'
seeded engine (SWA pools of ``--pages`` pages, faults injected at a few steps), then runs the real app script
headless (Streamlit's AppTest: the whole script, every query, replay, page map and PNG encoding, no browser
paint) at several steps: the first violation, the middle, the last step, and steps chosen at random, and
prints the time of each full render, then the live view's. Also prints the parts (state at the step, page
maps, lifeline) measured on their own. A measurement, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(path: Path, events: int, pages: int) -> None:
    from exporters.recorder import Recording
    from tests.dashboard.scenario import Scenario

    faults = [("swa-misaligned", 50), ("leak", 3000), ("double-free", 10**9)]
    sc = Scenario(path, pages=pages, window=12, snapshot_every=100, faults=faults, seed=11)
    t0 = time.perf_counter()
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
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_dashboard")
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--pages", type=int, default=65536, help="pages per pool (default 65536)")
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
        build(path, a.events, a.pages)
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
