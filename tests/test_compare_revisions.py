"""``benchmarks.compare_revisions``' parsing and table, on a fake pair of results (nothing is measured here)."""

from __future__ import annotations

import json

import pytest

from benchmarks import compare_revisions as cr


def _sglang_run(self_cost: dict, aside: float, iterations: int) -> dict:
    return {"256": {"self_cost": self_cost, "aside": aside, "iterations": iterations}}


def test_an_ops_child_result_is_parsed_from_its_last_result_line_into_median_ratios():
    rows = [["alloc_decode bs=256 ps=16 immediate wrapped/bare", [1.4, 1.2, 1.3]], ["free bs=1 ps=1 off", [1.0]]]
    stdout = "warming up\nRESULT [] \n" + cr.RESULT + json.dumps(rows) + "\n"
    assert cr.ops_medians(cr.parse_result(stdout)) == {
        "alloc_decode bs=256 ps=16 immediate wrapped/bare": pytest.approx(1.3),
        "free bs=1 ps=1 off": 1.0,
    }
    with pytest.raises(ValueError):
        cr.parse_result("no result here\n")


def test_the_sglang_self_cost_is_the_accounting_less_the_idle_sweeps_per_iteration():
    bare = _sglang_run({"hooks": 9.0}, 9.0, 1)  # the bare run's figures are not read
    inst = _sglang_run({"hooks": 0.010, "ledger": 0.004, "checks": 0.005, "exporters": 0.001}, 0.002, 100)
    measured = [["off", []], ["record", [[bare, inst], [bare, _sglang_run({"hooks": 0.003}, 0.0, 50)]]]]
    assert cr.self_cost_us(measured, "record", 256) == pytest.approx([180.0, 60.0])
    with pytest.raises(KeyError):
        cr.self_cost_us(measured, "prometheus", 256)


def test_the_table_gives_each_rows_medians_and_head_over_base():
    samples = {
        "base": {"op a": [1.5, 1.1, 1.3], "sglang record": [120.0, 100.0, 140.0], "gone": [2.0]},
        "head": {"op a": [1.2, 1.3], "sglang record": [60.0, 70.0, 50.0], "new": [1.0]},
    }
    rows = cr.compare(samples)
    assert [r[0] for r in rows] == ["op a", "sglang record", "new", "gone"]  # head's order, then base-only rows
    by = {r[0]: r[1:] for r in rows}
    assert by["op a"] == pytest.approx((1.3, 1.25, 1.25 / 1.3))
    assert by["sglang record"] == pytest.approx((120.0, 60.0, 0.5))
    assert by["new"] == (None, 1.0, None) and by["gone"] == (2.0, None, None)
    text = cr.table(rows, "title")
    lines = text.splitlines()
    assert lines[0] == "title" and lines[1].split() == ["row", "base", "head", "head/base"]
    assert lines[3].split()[-3:] == ["1.300", "1.250", "0.962"]
    assert lines[4].split()[-3:] == ["120.0", "60.0", "0.500"]
    assert lines[5].split()[-3:] == ["-", "1.000", "-"]


def test_the_trees_alternate_which_runs_first():
    assert cr.orders(3) == [("base", "head"), ("head", "base"), ("base", "head")]
    assert cr.orders(2, start=1) == [("head", "base"), ("base", "head")]


def test_a_child_sees_one_tree_and_no_plugin_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("KVALLOC_MODE", "raise")
    env = cr.child_env(tmp_path)
    assert env["PYTHONPATH"] == str(tmp_path) and "KVALLOC_MODE" not in env
