"""The command line, through the installed console script (a real subprocess)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from instrumented_alloc.sim.scripted import run


def _script() -> list[str]:
    exe = Path(sys.executable).with_name("instrumented-alloc")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("instrumented-alloc")
    if found is None:
        pytest.fail("the instrumented-alloc console script is not installed (pip install -e .)")
    return [found]


def test_help_lists_the_commands():
    res = subprocess.run([*_script(), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    assert "demo" in res.stdout


def test_unknown_command_is_a_usage_error():
    res = subprocess.run([*_script(), "no-such-command"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "invalid choice" in res.stderr
    assert "Traceback" not in res.stderr


def test_demo_runs_clean_then_shows_the_injected_faults():
    res = subprocess.run([*_script(), "demo"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "violations so far: 0; check_consistency: 0 findings" in out
    assert "swa_evicted_seqlen_page_aligned" in out and "rid d" in out
    assert "double_free" in out


def test_scripted_scenario_figures():
    lines = run(page_size=16, window=64)
    # a: 53 tokens -> 4 pages, b: 32 tokens -> 2 pages, in both pools.
    assert "full: 6 used / 58 free, swa: 6 used / 42 free; live requests 2" in lines[2]
    # a: 53 + 32 + 19 = 104 tokens, window 64: 40 tokens out of the window, floored to a page -> 32.
    assert "SWA eviction: a evicted 32, b evicted 0" in "\n".join(lines)
    faults = [line for line in lines if line.startswith("  ") and "step" in line]
    assert [f.split()[1] for f in faults] == ["swa_evicted_seqlen_page_aligned", "double_free"]


def test_demo_raise_mode_stops_at_each_fault():
    lines = run(mode="raise")
    raised = [line for line in lines if line.startswith("  raised:")]
    assert len(raised) == 2
    assert "[swa_evicted_seqlen_page_aligned]" in raised[0] and "[double_free]" in raised[1]
