"""How cheap could a flight recorder be on the engine loop? ``python -m benchmarks.recorder_floor``.

Lower bounds for issue #4's recorder target (<= 1.15x on ``bench_exporters``' engine loop), measured on that loop
(``engine_loop``: 32 requests extended, decoded 24 steps with a ``step()`` each, then freed and released one by
one), each against the same loop with no sink, interleaved; CPU time of the process (writer threads included),
median ratio of the repeats after a warm-up round:

- ``null sink, the recorder's kinds``: the wrapper building the per-call events the recorder reads, for a sink that
  does nothing (``event_floor``'s row);
- ``null sink, step boundaries only``: a sink that reads one event per ``step()`` and nothing per call;
- ``step journal, capture only``: no per-call event at all. At each step boundary it diffs every pool's page
  owners and the ledger's three columns against the previous boundary's copy and keeps the changed entries (page
  and owner, slot and values) in memory: the state that ``Recording.state_at`` needs, at step granularity, and
  nothing else (no ``Alloc``/``Free``/``RequestReleased``, no per-call ledger rows, no durations);
- ``step journal, capture + writer``: the same with a writer thread that packs 256 steps per SQLite row (WAL,
  zlib level 1), commits, and frees what it wrote;
- ``FlightRecorder``: the real one, defaults.

The journal reads the wrapper's internal arrays directly (no copy, no API, no event): a shortcut no sink behind the
event contract has, so that its figure is a floor under any step-granular design, not a design to ship. It is not
used anywhere else.
"""

from __future__ import annotations

import argparse
import collections
import sqlite3
import tempfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_exporters import _wrapped, engine_loop
from benchmarks.common import table
from instrumented_alloc import events as ev


class _Null:
    name = "null"

    def __init__(self, kinds):
        self.event_types = frozenset(kinds)

    def __call__(self, batch) -> None:
        return None


class _StepJournal:
    """The step-granular journal described in the module docstring (capture on the engine thread at each
    boundary; ``path``: also write it from a background thread)."""

    name = "step-journal"
    event_types = frozenset({ev.StepBoundary})

    def __init__(self, alloc, path: Path | None):
        st = alloc._w_st  # internals on purpose: see the module docstring
        self._shadows = [p.shadow for p in st.pools.values()]
        self._owners = [s.owner.copy() for s in self._shadows]
        led = self._ledger = st.ledger
        self._cols = (led.allocated.copy(), led.committed.copy(), led.evicted.copy())
        self._queue: collections.deque = collections.deque()
        self._stop = threading.Event()
        self._thread = None
        if path is not None:
            self._conn = sqlite3.connect(path, check_same_thread=False)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("CREATE TABLE steps (step INTEGER PRIMARY KEY, n INTEGER, payload BLOB)")
            self._thread = threading.Thread(target=self._write, daemon=True)
            self._thread.start()
        alloc.subscribe(self)

    def __call__(self, batch) -> bool:
        for e in batch:
            if type(e) is not ev.StepBoundary:
                continue
            rec = [e.step, e.seq, e.ts]
            for shadow, prev in zip(self._shadows, self._owners):
                now = shadow.owner
                if now.size != prev.size:  # a resize: take the pool whole
                    prev = now.copy()
                    changed = np.arange(now.size)
                else:
                    changed = np.flatnonzero(now != prev)
                    prev[changed] = now[changed]
                rec.append((changed, now[changed]))
            led = self._ledger
            a, c, v = led.allocated, led.committed, led.evicted
            cols = self._cols
            if cols[0].size != a.size:  # the ledger grew: take it whole
                cols = self._cols = (a.copy(), c.copy(), v.copy())
                slots = np.arange(a.size)
            else:
                slots = np.flatnonzero((a != cols[0]) | (c != cols[1]) | (v != cols[2]))
                for mine, now in zip(cols, (a, c, v)):
                    mine[slots] = now[slots]
            rec.append((slots, a[slots], c[slots], v[slots]))
            self._queue.append(rec)
            if self._thread is None and len(self._queue) > 4096:
                self._queue.popleft()
        return True

    def _write(self) -> None:
        while not self._stop.wait(0.05):
            self._flush()
        self._flush()

    def _flush(self, per_row: int = 256) -> None:
        q = self._queue
        while q:
            recs = [q.popleft() for _ in range(min(per_row, len(q)))]
            arrays = [x for r in recs for part in r[3:] for x in part]
            head = np.array([(r[0], r[1]) for r in recs], np.int64).tobytes()
            ts = np.array([r[2] for r in recs], np.float64).tobytes()
            lens = np.fromiter(map(len, arrays), np.int32, len(arrays)).tobytes()
            body = np.concatenate(arrays).astype("<i4").tobytes() if arrays else b""
            payload = zlib.compress(b"".join((head, ts, lens, body)), 1)
            self._conn.execute("INSERT INTO steps VALUES (?, ?, ?)", (recs[0][0], len(recs), payload))
            self._conn.commit()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._conn.close()


def _cases(tmp: Path) -> dict:
    from exporters.recorder import FlightRecorder

    def recorder(alloc):
        return FlightRecorder(alloc, tmp / f"rec-{time.monotonic_ns()}.sqlite").close

    def null(kinds):
        def attach(alloc):
            alloc.subscribe(_Null(kinds))
            return lambda: None

        return attach

    def journal(write: bool):
        def attach(alloc):
            return _StepJournal(alloc, tmp / f"journal-{time.monotonic_ns()}.sqlite" if write else None).close

        return attach

    return {
        "null sink, the recorder's kinds": null(FlightRecorder.event_types),
        "null sink, step boundaries only": null({ev.StepBoundary}),
        "step journal, capture only": journal(False),
        "step journal, capture + writer": journal(True),
        "FlightRecorder": recorder,
    }


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    engine_loop(_wrapped(), iterations=2)  # lazy initialisation
    with tempfile.TemporaryDirectory() as tmp:
        cases = _cases(Path(tmp))
        ratios: dict = {name: [] for name in cases}
        for r in range(args.repeats + 1):
            for name, attach in cases.items():
                base = _wrapped()
                t0 = time.process_time()
                engine_loop(base, iterations=args.iterations)
                off = time.process_time() - t0
                alloc = _wrapped()
                close = attach(alloc)
                t0 = time.process_time()
                engine_loop(alloc, iterations=args.iterations)
                close()
                on = time.process_time() - t0
                if r:  # the first round warms up
                    ratios[name].append(on / off)
    out = table([(f"engine loop, {name} / no sink", rs, "") for name, rs in ratios.items()])
    print(out)
    return out


if __name__ == "__main__":
    main()
