"""What every benchmark module shares: the clocks and the one table they all print into."""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request

# "cpu": CPU time (the default: the machines this runs on are shared, and a preempted sample would otherwise count
# someone else's work; single-threaded cases use the thread's time, cases with background threads the whole
# process's, so a writer thread's work is counted, not hidden). "wall": perf_counter.
CLOCKS = {
    "cpu": (time.thread_time, time.process_time),
    "wall": (time.perf_counter, time.perf_counter),
}


def table(rows: list[tuple[str, list[float], str]], title: str | None = None) -> str:
    """One row per case: the median of the runs with the min and max beside it, and the target."""
    width = max([58, *(len(name) for name, _, _ in rows)])
    head = f"{'case':{width}} {'median':>9} {'min':>9} {'max':>9} {'runs':>4}  target"
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for name, rs, target in rows:
        med, lo, hi = statistics.median(rs), min(rs), max(rs)
        fmt = "9.0f" if target == "bytes" else "9.3f"
        lines.append(f"{name:{width}} {med:{fmt}} {lo:{fmt}} {hi:{fmt}} {len(rs):4d}  {target}")
    return "\n".join(lines)


def scrape_every(port: int, seconds: float = 1.0):
    """Scrape ``http://127.0.0.1:PORT/metrics`` every ``seconds`` on a daemon thread, as a Prometheus server would
    (the scrape's cost on the exporter is part of what the benchmark measures). Returns the function that stops it."""
    stop = threading.Event()

    def scrape():
        while not stop.wait(seconds):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                r.read()

    th = threading.Thread(target=scrape, name="bench-scraper", daemon=True)
    th.start()

    def close():
        stop.set()
        th.join(timeout=10)

    return close
