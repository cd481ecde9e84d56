"""The fast-path benchmark measures every fast path the wrapper has, on calls that run clean."""

import time

import pytest

from benchmarks import bench_fast_paths
from instrumented_alloc.wrapper import FAST_PATHS


def test_every_fast_path_has_cases():
    assert set(bench_fast_paths.CASES) == set(FAST_PATHS)
    assert all(bench_fast_paths.CASES[name] for name in FAST_PATHS)


def test_each_case_runs_clean_with_and_without_its_fast_path():
    # One round of each distinct case, small: _run asserts the wrapper saw no violation.
    for name, cases in bench_fast_paths.CASES.items():
        for op, ps, _bs in cases:
            for fast in (True, frozenset(FAST_PATHS) - {name}, False):
                assert bench_fast_paths._run(op, ps, 2, 2, time.perf_counter, fast) > 0


def test_only_measures_the_named_fast_paths_and_rejects_unknown_names(capsys):
    found = bench_fast_paths.rows(repeats=1, quick=True, only=["free"], clock=time.perf_counter)
    names = [n for n, _ in found]
    assert [n.split(":")[0] for n in names] == ["free", "free", "none", "none"]
    assert all(len(rs) == 1 and rs[0] > 0 for _, rs in found)
    with pytest.raises(SystemExit):
        bench_fast_paths.main(["--only", "free,page_counts"])
    assert "unknown fast-path names ['page_counts']" in capsys.readouterr().err
