"""Recordings for the dashboard's tests, made once per session in one directory (what the app is pointed at),
by the demo engine (``instrumented-alloc demo ... --record``, a subprocess of this checkout):

``faults.sqlite``: swa-128 for 200 steps, the seed's unaligned swa_evicted_seqlen write (swa-misaligned@50)
and a double free (double-free@120); ``clean.sqlite``: dense for 60 steps, no fault; ``crashed.sqlite``: a demo
killed (SIGKILL) while it was writing, after an injected leak was committed; ``fresh.sqlite``: a recorder
closed before any event; and files that are not (whole) recordings: ``notes.sqlite`` (text), ``empty.sqlite``
(0 bytes), ``truncated.sqlite`` (the first half of a finished recording's bytes).
``recordings.faults``: the injected faults as (fault, step, request id, invariant), read from the demo's report
and the recording.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from exporters.recorder import FlightRecorder, Recording
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import SWATokenToKVPoolAllocator

REPO = Path(__file__).resolve().parents[2]
FAULTS_ARGS = ["--preset", "swa-128", "--steps", "200", "--seed", "1",
               "--inject", "swa-misaligned@50", "--inject", "double-free@120"]  # fmt: skip
INJECTED = re.compile(r"^injected (\S+) at step (\d+): .*\(expects (\S+)\)$", re.M)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def demo_process(path, *args, **popen) -> subprocess.Popen:
    """``instrumented-alloc demo ARGS --record PATH`` as a subprocess of this checkout."""
    return subprocess.Popen(
        [sys.executable, "-m", "instrumented_alloc.cli", "demo", *args, "--record", str(path)],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
    )  # fmt: skip


def demo(path, *args) -> list[tuple[str, int, object, str]]:
    """Run the demo to completion; the faults it reports injecting, as (fault, step, rid, invariant), the rid
    being that of the recording's violation of the expected invariant at that step."""
    proc = demo_process(path, *args)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    found = []
    with Recording(path) as r:
        for fault, step, invariant in INJECTED.findall(out):
            hits = [v for v in r.violations(int(step), int(step) + 1) if v.invariant == invariant]
            assert hits, (fault, step, invariant, out)
            found.append((fault, int(step), hits[0].rid, invariant))
    return found


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def violations_in(path) -> list:
    """The violations a reader sees in ``path`` now (empty while the file is not a readable recording yet)."""
    try:
        with Recording(path) as r:
            return r.violations()
    except (ValueError, OSError):
        return []


@pytest.fixture(scope="session")
def recordings(tmp_path_factory):
    d = tmp_path_factory.mktemp("recordings")
    faults = demo(d / "faults.sqlite", *FAULTS_ARGS)
    assert [f[0] for f in faults] == ["swa-misaligned", "double-free"]
    assert demo(d / "clean.sqlite", "--preset", "dense", "--steps", "60", "--seed", "2") == []
    inner = SWATokenToKVPoolAllocator(64, 64, 4, torch.float16, "cpu")
    FlightRecorder(InstrumentedAllocator(inner, sliding_window=12), d / "fresh.sqlite").close()
    (d / "notes.sqlite").write_text("these are my notes, not a recording\n")
    (d / "empty.sqlite").write_bytes(b"")
    whole = (d / "faults.sqlite").read_bytes()
    (d / "truncated.sqlite").write_bytes(whole[: len(whole) // 2])
    crashed = d / "crashed.sqlite"
    proc = demo_process(crashed, "--preset", "swa-128", "--pace", "200", "--seed", "3", "--inject", "leak@20")
    try:
        wait_for(lambda: any(v.invariant == "request_leak" for v in violations_in(crashed)), 120, "the leak")
        time.sleep(0.3)  # it keeps writing: the kill lands mid-run
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=10)
    assert os.path.exists(str(crashed) + "-wal")  # cut off in WAL mode, never finished
    leak = next(v for v in violations_in(crashed) if v.invariant == "request_leak")
    return SimpleNamespace(dir=d, faults=faults, crashed_leak=leak)


def rank_recording(path, rank: int, steps: int, fault_step: int) -> None:
    """One scheduler rank's recording, as an engine records each rank (``FlightRecorder(meta={"engine", "rank",
    "tp_rank"})``): a paged allocator (64 tokens, pages of 4: 16 pages) serving one 8-token request a step for
    ``steps`` steps (none finishes), with one fault at ``fault_step``: rank 0 frees its newest request's pages
    twice (``double_free``), any other rank releases its first request without freeing (``request_leak``)."""
    from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator

    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"))
    rec = FlightRecorder(w, path, meta={"engine": "e0", "rank": rank, "tp_rank": rank})
    out = None
    for i in range(steps):
        if i == fault_step:
            if rank == 0:
                w.free(out)
                w.free(out)
            else:
                w.release_request(f"r{rank}-0")
        elif i < 3:
            with w.batch([f"r{rank}-{i}"]):
                out = w.alloc(8)
        w.step()
    rec.close()


@pytest.fixture(scope="session")
def ranks(tmp_path_factory):
    """Two ranks of one run, one recording each in one directory: ``run-tp0.sqlite`` (rank 0, steps 0..6, a
    double free at step 4) and ``run-tp1.sqlite`` (rank 1, steps 0..9: its step counter ran ahead; a leak at
    step 7)."""
    d = tmp_path_factory.mktemp("ranks")
    rank_recording(d / "run-tp0.sqlite", 0, 6, 4)
    rank_recording(d / "run-tp1.sqlite", 1, 9, 7)
    return d
