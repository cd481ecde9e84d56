"""SGLang's labels: the dashboard's variables and per-rank panels against a real Prometheus, with the const labels
the plugin exports inside SGLang, next to the demo's.

Inside SGLang the exporter's const labels are SGLang's scheduler labels, as its ``SchedulerMetricsCollector`` sets
them (``exporters.sglang.rank_labels``): ``model_name``, ``engine_type``, ``tp_rank``,
``pp_rank``, ``moe_ep_rank``, ``dp_rank`` only when DP is on, and no ``engine``. All ranks of one server are
scraped through one /metrics endpoint (multiprocess mode), so they share one ``instance``.

The processes (each allocates some requests of 7 tokens, 2 pages each, in a pool of 16 pages, and rests):

- server A, ``Qwen/Qwen3-30B-A3B``, ``unified``, two pipeline stages (TP 1, PP 2, no DP), behind ONE endpoint: its
  ranks differ only by ``pp_rank``. pp_rank 0 is FULL (8 requests: 16 pages), pp_rank 1 holds 2 requests (4).
- server B, ``mistralai/Mixtral-8x7B-v0.1`` (a dot in the name: regex-escaped when selected), ``decode`` (PD
  disaggregation), one rank of TP 2 with expert parallelism (EP 2) under a DP controller: tp_rank 1,
  moe_ep_rank 1, dp_rank 0 (5 requests), behind an endpoint of its own (its other ranks are left out: one tells
  the servers apart).
- the demo's labels: ``engine="demo"`` and nothing else, a single-process exporter (3 requests).

Every query of every per-rank panel, with the variables substituted as Grafana would, under All and under one
selected value of each of ``model_name``, ``engine_type`` and ``pp_rank`` (and a few more), returns exactly one
series per selected rank holding that rank's own value; the demo's series match All and only All of the SGLang
variables; the legends name model, engine type and ranks. The variables' own queries list SGLang's values,
chained. A unit test checks that these label sets are the ones the plugin's ``rank_labels()`` builds, and that
``moe_ep_rank`` is a function of ``tp_rank`` (why the dashboard has no variable for it).
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest

from tests.grafana.dashboard_model import PER_RANK, grafana_regex_escape, interpolate, load_dashboard, targets
from tests.grafana.test_ranks import (
    ALL,
    check_per_rank_panels,
    label_values,
    legend,
    proc,
    run_ranks,
    scrape_config,
    serve_multiprocess,
    serve_single_process,
    state,
    wait_for_scrapes,
)
from tests.prometheus_server import api, wait_until_up

MODEL_A = "Qwen/Qwen3-30B-A3B"
MODEL_B = "mistralai/Mixtral-8x7B-v0.1"
# The const labels of each SGLang rank, in SGLang's order, and its number of requests.
A_PP0 = {"model_name": MODEL_A, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
A_PP1 = {**A_PP0, "pp_rank": "1"}
B_TP1 = {
    "model_name": MODEL_B,
    "engine_type": "decode",
    "tp_rank": "1",
    "pp_rank": "0",
    "moe_ep_rank": "1",
    "dp_rank": "0",
}
REQUESTS = {"A_PP0": 8, "A_PP1": 2, "B_TP1": 5, "demo": 3}


@pytest.fixture
def sglang_endpoints(tmp_path):
    """(server A's port, server B's port, the demo-labelled exporter's port)."""
    a_dir, b_dir = tmp_path / "sglang-a", tmp_path / "sglang-b"
    run_ranks({
        a_dir: [(A_PP0, REQUESTS["A_PP0"]), (A_PP1, REQUESTS["A_PP1"])],
        b_dir: [(B_TP1, REQUESTS["B_TP1"])],
    })  # fmt: skip
    with (
        serve_multiprocess(a_dir) as a_port,
        serve_multiprocess(b_dir) as b_port,
        serve_single_process({"engine": "demo"}, REQUESTS["demo"]) as demo_port,
    ):
        yield a_port, b_port, demo_port


def test_sglang_labels_variables_and_per_rank_panels_against_prometheus(sglang_endpoints, prometheus_server, tmp_path):
    a_port, b_port, demo_port = sglang_endpoints
    base = prometheus_server(0, config=scrape_config(a_port, b_port, demo_port))
    a, b, demo = (f"127.0.0.1:{p}" for p in (a_port, b_port, demo_port))
    wait_for_scrapes(base, 4, tmp_path)
    # What Prometheus holds: SGLang's labels exactly (no engine label), server A's two ranks behind one instance.
    scraped = wait_until_up(base, "kvalloc_page_size_tokens", tmp_path)
    assert sorted(sorted(s["metric"].items()) for s in scraped) == sorted(
        sorted({"__name__": "kvalloc_page_size_tokens", "job": "kvalloc", "instance": inst, **labels}.items())
        for inst, labels in ((a, A_PP0), (a, A_PP1), (b, B_TP1), (demo, {"engine": "demo"}))
    )

    # 1. The variables' own queries, chained as in the dashboard (Prometheus sorts values byte-wise).
    dashboard = load_dashboard()
    variables = {v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["name"] != "datasource"}
    esc = grafana_regex_escape
    qwen = {**ALL, "model_name": esc(MODEL_A)}
    assert label_values(base, variables["engine"], ALL) == ["demo"]
    assert label_values(base, variables["model_name"], ALL) == [MODEL_A, MODEL_B]
    assert label_values(base, variables["engine_type"], ALL) == ["decode", "unified"]
    assert label_values(base, variables["engine_type"], qwen) == ["unified"]  # chained on model_name
    assert label_values(base, variables["instance"], qwen) == [a]
    assert label_values(base, variables["instance"], {**ALL, "engine_type": "decode"}) == [b]  # on engine_type
    assert label_values(base, variables["tp_rank"], {**qwen, "instance": esc(a)}) == ["0"]
    assert label_values(base, variables["tp_rank"], ALL) == ["0", "1"]
    assert label_values(base, variables["pp_rank"], ALL) == ["0", "1"]
    assert label_values(base, variables["pp_rank"], {**qwen, "instance": esc(a), "tp_rank": "0"}) == ["0", "1"]
    assert label_values(base, variables["pp_rank"], {**ALL, "tp_rank": "1"}) == ["0"]  # chained on tp_rank
    assert label_values(base, variables["dp_rank"], ALL) == ["0"]
    assert label_values(base, variables["dp_rank"], {**ALL, "pp_rank": "1"}) == []  # chained on pp_rank
    # Server A has no DP, the demo no SGLang label: nothing to list, so Grafana stays at All (.*), which matches
    # their series.
    assert label_values(base, variables["dp_rank"], qwen) == []
    for name in ("model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank"):
        assert label_values(base, variables[name], {**ALL, "engine": "demo"}) == [], name

    # 2. Every per-rank panel query: one series per selected rank, with its own value.
    a_pp0 = proc(model_name=MODEL_A, engine_type="unified", instance=a, tp_rank="0", pp_rank="0")
    a_pp1 = proc(model_name=MODEL_A, engine_type="unified", instance=a, tp_rank="0", pp_rank="1")
    b_tp1 = proc(model_name=MODEL_B, engine_type="decode", instance=b, tp_rank="1", pp_rank="0", dp_rank="0")
    demo_key = proc(engine="demo", instance=demo)
    processes = {
        a_pp0: state(REQUESTS["A_PP0"]),
        a_pp1: state(REQUESTS["A_PP1"]),
        b_tp1: state(REQUESTS["B_TP1"]),
        demo_key: state(REQUESTS["demo"]),
    }
    assert processes[a_pp0]["pages"]["used"] == 16 and processes[a_pp1]["pages"]["used"] == 4  # full, and not
    selections = {
        "All": (ALL, [a_pp0, a_pp1, b_tp1, demo_key]),
        f"model_name {MODEL_A}": (qwen, [a_pp0, a_pp1]),
        f"model_name {MODEL_B}": ({**ALL, "model_name": esc(MODEL_B)}, [b_tp1]),
        "engine_type unified": ({**ALL, "engine_type": esc("unified")}, [a_pp0, a_pp1]),
        "engine_type decode": ({**ALL, "engine_type": esc("decode")}, [b_tp1]),
        "engine_type unified and decode": ({**ALL, "engine_type": "(unified|decode)"}, [a_pp0, a_pp1, b_tp1]),
        "pp_rank 0": ({**ALL, "pp_rank": esc("0")}, [a_pp0, b_tp1]),
        "pp_rank 1": ({**ALL, "pp_rank": esc("1")}, [a_pp1]),
        "tp_rank 1": ({**ALL, "tp_rank": esc("1")}, [b_tp1]),
        "dp_rank 0": ({**ALL, "dp_rank": esc("0")}, [b_tp1]),
        "one rank, every SGLang variable set": (
            {**qwen, "engine_type": esc("unified"), "instance": esc(a), "tp_rank": esc("0"), "pp_rank": esc("1")},
            [a_pp1],
        ),
        "engine demo": ({**ALL, "engine": esc("demo")}, [demo_key]),
    }
    end = time.time()
    checked = check_per_rank_panels(base, dashboard, processes, selections, end)
    by_title = {p["title"]: p for p, _ in targets(dashboard)}
    assert checked == len(selections) * sum(len(by_title[t]["targets"]) for t in PER_RANK)

    # 3. In numbers: the two pipeline stages of server A, which differ only by pp_rank, each at its own used share
    # (16/17 and 4/17), not one series at their 20/34 = 0.59; the legends name model, engine type and ranks, and
    # the demo's its engine.
    [used] = by_title["Used pages, per pool"]["targets"]
    result = api(base, "/api/v1/query", query=interpolate(used["expr"], ALL), time=end)["result"]
    shares = {proc_of(s["metric"]): round(float(s["value"][1]), 3) for s in result}
    assert shares == {("A", "0"): 0.941, ("A", "1"): 0.235, ("B", "0"): 0.588, ("demo", ""): 0.353}
    legends = {proc_of(s["metric"]): legend(used["legendFormat"], s["metric"]) for s in result}
    assert legends == {
        ("A", "0"): f"full,  {MODEL_A} unified tp=0 pp=0 dp= ({a})",
        ("A", "1"): f"full,  {MODEL_A} unified tp=0 pp=1 dp= ({a})",
        ("B", "0"): f"full,  {MODEL_B} decode tp=1 pp=0 dp=0 ({b})",
        ("demo", ""): f"full, demo   tp= pp= dp= ({demo})",
    }


def proc_of(metric: dict) -> tuple[str, str]:
    """(server, pp_rank) of a series of this test."""
    server = {MODEL_A: "A", MODEL_B: "B"}.get(metric.get("model_name"), metric.get("engine"))
    return server, metric.get("pp_rank", "")


def _sglang_context(monkeypatch, *, model: str, disaggregation_mode: str, parallel: dict, dp_rank):
    """SGLang's runtime context as a scheduler process sees it, for ``rank_labels()``."""
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(rc, "get_serving", lambda: SimpleNamespace(served_model_name=model))
    monkeypatch.setattr(
        rc,
        "get_disagg",
        lambda: SimpleNamespace(enable_pd_role_switch=False, disaggregation_mode=disaggregation_mode),
    )
    monkeypatch.setattr(rc, "get_parallel", lambda: SimpleNamespace(**parallel, dp_rank=dp_rank))
    monkeypatch.setattr(rc, "get_observability", lambda: SimpleNamespace(extra_metric_labels=None))


def test_the_label_sets_are_the_plugins():
    """The label sets above are what the plugin's ``rank_labels()`` builds for those ranks, with the ranks SGLang
    derives (``derive_spawn_ranks``) for the servers' topologies: server A (TP 1, PP 2) world ranks 0 and 1,
    server B (TP 2, EP 2) world rank 1 under its DP controller's rank 0."""
    from tests import sglang_compat

    sglang_compat.require_sglang(require_swa=False)
    import sglang.srt.runtime_context as rc

    from exporters.sglang import rank_labels

    cases = [
        (A_PP0, MODEL_A, "null", dict(world_rank=0, tp_size=1, attn_tp_size=1, moe_ep_size=1), None),
        (A_PP1, MODEL_A, "null", dict(world_rank=1, tp_size=1, attn_tp_size=1, moe_ep_size=1), None),
        (B_TP1, MODEL_B, "decode", dict(world_rank=1, tp_size=2, attn_tp_size=2, moe_ep_size=2), 0),
    ]
    with pytest.MonkeyPatch.context() as mp:
        for want, model, mode, topology, dp_rank in cases:
            parallel = rc.derive_spawn_ranks(ep_join_rank_offset=0, attn_cp_size=1, moe_dp_size=1, **topology)
            _sglang_context(mp, model=model, disaggregation_mode=mode, parallel=parallel, dp_rank=dp_rank)
            assert rank_labels() == want


def test_moe_ep_rank_is_a_function_of_tp_rank():
    """Why the dashboard has no moe_ep_rank variable and does not group by it: in every topology SGLang derives
    (TP, PP, MoE DP, EP widths), the ranks of one server are told apart by (tp_rank, pp_rank) alone, and each
    tp_rank has one moe_ep_rank. (dp_rank comes from the DP controller, which runs one such server per DP rank.)"""
    from tests import sglang_compat

    sglang_compat.require_sglang(require_swa=False)
    import sglang.srt.runtime_context as rc

    checked = 0
    for tp_size, pp_size in itertools.product((1, 2, 4, 8, 16), (1, 2, 4)):
        for moe_dp_size, moe_ep_size in itertools.product((1, 2, 4, 8, 16), repeat=2):
            if tp_size % (moe_dp_size * moe_ep_size):
                continue
            ranks = [
                rc.derive_spawn_ranks(
                    world_rank=w,
                    tp_size=tp_size,
                    ep_join_rank_offset=0,
                    attn_cp_size=1,
                    attn_tp_size=tp_size,
                    moe_dp_size=moe_dp_size,
                    moe_ep_size=moe_ep_size,
                )
                for w in range(tp_size * pp_size)
            ]
            assert len({(r["tp_rank"], r["pp_rank"]) for r in ranks}) == len(ranks)
            ep_of_tp = {}
            for r in ranks:
                assert ep_of_tp.setdefault(r["tp_rank"], r["moe_ep_rank"]) == r["moe_ep_rank"], (tp_size, r)
            assert set(ep_of_tp.values()) == set(range(moe_ep_size))
            checked += 1
    assert checked == 105  # every (TP, PP) with every MoE DP and EP width that divides TP
