"""Recordings for the dashboard's tests, made once per session in one directory (what the app is pointed at).

``faults.sqlite``: 80 steps, an unaligned swa_evicted_seqlen write at step 30 and a double free at step 70;
``clean.sqlite``: 40 steps, no fault; ``fresh.sqlite``: a recorder closed before any event; ``crashed.sqlite``:
a writer killed (SIGKILL) mid-run; and files that are not (whole) recordings: ``notes.sqlite`` (text),
``empty.sqlite`` (0 bytes), ``truncated.sqlite`` (the first half of a finished recording's bytes).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from exporters.recorder import FlightRecorder
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import SWATokenToKVPoolAllocator
from tests.dashboard.scenario import record

REPO = Path(__file__).resolve().parents[2]
FAULTS = [("swa-misaligned", 30), ("double-free", 70)]


def scenario_process(path, *args) -> subprocess.Popen:
    """``python -m tests.dashboard.scenario PATH ARGS`` with this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.dashboard.scenario", str(path), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_line(proc: subprocess.Popen, prefix: str, timeout: float = 120.0) -> str:
    """The child's next stdout line that starts with ``prefix`` (fails, with its stderr, if it never comes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(prefix):
                return line.strip()
    proc.kill()
    pytest.fail(f"the scenario process never printed {prefix!r}: {proc.stderr.read()[-3000:]}")


@pytest.fixture(scope="session")
def recordings(tmp_path_factory):
    d = tmp_path_factory.mktemp("recordings")
    faults = record(d / "faults.sqlite", 80, faults=FAULTS, seed=1)
    record(d / "clean.sqlite", 40, seed=2)
    inner = SWATokenToKVPoolAllocator(64, 64, 4, torch.float16, "cpu")
    FlightRecorder(InstrumentedAllocator(inner, sliding_window=12), d / "fresh.sqlite").close()
    (d / "notes.sqlite").write_text("these are my notes, not a recording\n")
    (d / "empty.sqlite").write_bytes(b"")
    whole = (d / "faults.sqlite").read_bytes()
    (d / "truncated.sqlite").write_bytes(whole[: len(whole) // 2])
    proc = scenario_process(d / "crashed.sqlite", "--steps", "100000", "--pace", "300", "--inject", "leak@5")
    try:
        crashed_fault = read_line(proc, "fault").split()
        time.sleep(0.3)  # it keeps writing: the kill lands mid-run
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert os.path.exists(d / "crashed.sqlite-wal")  # cut off in WAL mode, never finished
    return SimpleNamespace(dir=d, faults=faults, crashed_fault=crashed_fault)
