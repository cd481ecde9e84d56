"""A small seeded engine that writes flight recordings with pools of any size: the recorder-query tests use
it for exact, hand-checkable runs, and ``benchmarks/bench_dashboard.py --engine scenario`` for pools of a
million pages (the demo engine's presets hold a few thousand). The dashboard's AppTest, browser and live tests
use the demo engine itself (``tests/dashboard/conftest.py``).

It drives an instrumented SWA allocator (continuous batching: prefill, decode, SWA eviction, finish) with a
``FlightRecorder`` attached and injects the engine bugs the dashboard must show, at given steps:
``swa-misaligned`` (a ``swa_evicted_seqlen`` write that is not page aligned -> ``swa_evicted_seqlen_page_aligned``),
``double-free`` (a finished request's full pages freed twice -> ``double_free``), ``leak`` (a request released
without freeing its pages -> ``request_leak``). Every fault's request id is printed (``fault NAME STEP RID``),
so tests know exactly what to look for.

Run as a process: ``python -m tests.dashboard.scenario PATH [--steps N] [--pace STEPS_PER_S] [--inject F@STEP]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from exporters.recorder import FlightRecorder
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import SWATokenToKVPoolAllocator
from tests.engine_model import Req, decode_args, extend_args, split_extend, t

FAULTS = ("swa-misaligned", "double-free", "leak")


class Scenario:
    def __init__(self, path, *, page_size=4, pages=64, window=12, seed=0, snapshot_every=10, faults=(), **rec):
        self.ps = ps = page_size
        self.window = window
        inner = SWATokenToKVPoolAllocator(pages * ps, pages * ps, ps, torch.float16, "cpu")
        self.alloc = InstrumentedAllocator(inner, mode="record", sliding_window=window)
        self.rec = FlightRecorder(self.alloc, path, snapshot_every=snapshot_every, meta={"preset": "test-swa"}, **rec)
        self.rng = random.Random(seed)
        self.reqs: dict[str, Req] = {}
        self.target: dict[str, int] = {}
        self.n = 0
        self.faults = sorted(faults, key=lambda f: f[1])  # (name, step)
        self.injected: list[tuple[str, int, str]] = []  # (fault, step, rid)

    # -- engine operations ---------------------------------------------------------------------------------------
    def admit(self) -> None:
        if len(self.reqs) >= 4 or self.alloc.full_available_size() < 8 * self.ps:
            return
        self.n += 1
        r = Req(f"req-{self.n}")
        n = self.rng.randint(2, 3 * self.ps)
        with self.alloc.batch([r.rid]):
            split_extend([r], [n], self.alloc.alloc_extend(*extend_args([r], [n])))
        self.reqs[r.rid] = r
        self.target[r.rid] = n + self.rng.randint(4, 6 * self.ps)

    def decode(self) -> None:
        reqs = list(self.reqs.values())
        if not reqs:
            return
        with self.alloc.batch([r.rid for r in reqs]):
            out = self.alloc.alloc_decode(*decode_args(reqs))
        for r, s in zip(reqs, out.tolist()):
            r.row.append(s)

    def evict(self, r: Req, *, misaligned: bool = False) -> bool:
        kv = self.alloc.ledger[r.rid]
        new = max(0, r.seq - self.window) // self.ps * self.ps
        if misaligned:
            new = kv.swa_evicted_seqlen + 1  # the seed's bug: an evicted length that is not page aligned
            if new > max(0, r.seq - self.window):
                return False
            kv.swa_evicted_seqlen = new  # rejected (record mode): the ledger keeps the old value
            return True
        if new > kv.swa_evicted_seqlen:
            self.alloc.free_swa_segment(t(r.row[kv.swa_evicted_seqlen : new]), start_pos=kv.swa_evicted_seqlen)
            kv.swa_evicted_seqlen = new
        return True

    def finish(self, r: Req, *, twice: bool = False, leak: bool = False) -> None:
        kv = self.alloc.ledger[r.rid]
        del self.reqs[r.rid]
        if not leak:
            self.alloc.free_swa_segment(t(r.row[kv.swa_evicted_seqlen :]), start_pos=kv.swa_evicted_seqlen)
            self.alloc.free_full(t(r.row))
            if twice:
                self.alloc.free_full(t(r.row))  # the engine's bug: the same pages freed again
        self.alloc.release_request(r.rid)

    def step(self) -> None:
        """One engine step; the faults due at this step are injected on the oldest live request that allows it."""
        s = self.alloc.step_count  # the step a violation of this step is stamped with
        self.admit()
        self.decode()
        due = [f for f in self.faults if f[1] == s]
        for name, _ in due:
            for r in list(self.reqs.values()):
                if name == "swa-misaligned" and self.evict(r, misaligned=True):
                    self.injected.append((name, s, r.rid))
                    break
                if name in ("double-free", "leak"):
                    self.finish(r, twice=name == "double-free", leak=name == "leak")
                    self.injected.append((name, s, r.rid))
                    break
            else:
                due_later = (name, s + 1)  # no request allowed it this step: try the next one
                self.faults.append(due_later)
        self.faults = [f for f in self.faults if f[1] != s]
        for r in list(self.reqs.values()):
            self.evict(r)
            if r.seq >= self.target[r.rid]:
                self.finish(r)
        self.alloc.step()

    def run(self, steps: int, pace: float | None = None, on_fault=None) -> None:
        for _ in range(steps):
            before = len(self.injected)
            self.step()
            if on_fault is not None:
                for f in self.injected[before:]:
                    on_fault(f)
            if pace:
                time.sleep(1.0 / pace)

    def close(self) -> None:
        self.rec.close()


def record(path, steps: int, faults=(), **kw) -> list[tuple[str, int, str]]:
    """Write a finished recording of ``steps`` steps at ``path``; returns the injected faults (fault, step, rid)."""
    sc = Scenario(path, faults=faults, **kw)
    try:
        sc.run(steps)
    finally:
        sc.close()
    return sc.injected


def _fault(text: str) -> tuple[str, int]:
    name, _, step = text.partition("@")
    if name not in FAULTS:
        raise argparse.ArgumentTypeError(f"unknown fault {name!r} (one of {', '.join(FAULTS)})")
    return name, int(step or 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.dashboard.scenario")
    p.add_argument("path")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--pace", type=float, default=None, help="steps per second (default: as fast as it goes)")
    p.add_argument("--inject", type=_fault, action="append", default=[])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    sc = Scenario(a.path, faults=a.inject, seed=a.seed, flush_interval=0.05)
    print("recording", a.path, flush=True)
    try:
        sc.run(a.steps, a.pace, on_fault=lambda f: print("fault", *f, flush=True))
    finally:
        sc.close()
    print("done", sc.alloc.step_count, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
