"""The self-cost panels against a real Prometheus, with ranks behind one endpoint: each rank's cost over that
rank's own iterations.

Three scheduler processes step continuously (paced), each a real wrapped allocator with a real PrometheusExporter:

- two pipeline stages of one SGLang server (SGLang's const labels, as in ``test_sglang_labels``: they differ only by
  ``pp_rank``) in multiprocess mode behind ONE /metrics endpoint. pp_rank 0 is BUSY (16 requests allocated, freed
  and released per iteration, 40 iterations/s); pp_rank 1 steps EMPTY (no allocator call between its step
  boundaries, 80 iterations/s): its iterations cost the instrumentation far less.
- the demo's labels (``engine="e1"``, no rank label), a single-process exporter on its own endpoint (4 requests per
  iteration, 20 iterations/s).

Every query of every self-cost panel, with the template variables substituted as Grafana would, under several
selections, returns exactly one series per selected process (and part, quantile), each holding the very values of
the same figure computed for that process alone (its own selector, no vector matching): a mismatched ratio (one
rank's cost over another's iterations, or over all of them) would differ. The busy rank's iterations cost more
than the empty one's, part by part where the wrapper works (checks, exporters). Values are rates of live processes:
the test compares them with each other, never with a clock.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from grafana import generate
from tests.grafana.dashboard_model import (
    PER_RANK_SELF_COST,
    REPO,
    grafana_regex_escape,
    interpolate,
    load_dashboard,
    targets,
)
from tests.grafana.test_ranks import ALL, legend, proc, process_of, scrape_config, serve_multiprocess
from tests.grafana.test_sglang_labels import A_PP0, A_PP1, MODEL_A
from tests.prometheus_server import api, wait_until_up

RATE_INTERVAL = "4s"  # $__rate_interval at a 1 s scrape interval (see test_integration)
PARTS = ("hooks", "ledger", "checks", "exporters")

# One scheduler, stepping until killed: argv: "single" or the multiprocess directory, const labels (JSON), requests
# per iteration, iterations per second. A single-process one prints its port.
STEPPING_CHILD = r"""
import json, os, sys, time
where, labels, work, pace = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
if where != "single":
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = where
import torch
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from exporters.prometheus import PrometheusExporter

w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(1024, 4, torch.float16, "cpu"), mode="record")
if where == "single":
    exp = PrometheusExporter(w, const_labels=labels, multiprocess=False)
    port = exp.serve()
else:
    exp = PrometheusExporter(w, const_labels=labels, refresh_interval=0.0)
    assert exp.multiprocess
    port = 0
print("READY", port, flush=True)
i = 0
while True:
    for k in range(work):
        rid = f"r{i}-{k}"
        with w.batch([rid]):
            out = w.alloc(8)
        w.free(out)
        w.release_request(rid)
    w.step()
    i += 1
    time.sleep(1.0 / pace)
"""


@pytest.fixture
def stepping(tmp_path):
    """``start(where, labels, work, pace) -> port`` (0 in multiprocess mode) once the process is serving; every
    process is killed at teardown."""
    procs = []

    def start(where, labels: dict, work: int, pace: float) -> int:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        log = tmp_path / f"stepping-{len(procs)}.log"
        with open(log, "w") as out:
            p = subprocess.Popen(
                [sys.executable, "-c", STEPPING_CHILD, str(where), json.dumps(labels), str(work), str(pace)],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
        procs.append(p)
        deadline = time.monotonic() + 120
        while True:
            text = log.read_text()
            for line in text.splitlines():
                if line.startswith("READY "):
                    return int(line.split()[1])
            assert p.poll() is None, text[-3000:]
            assert time.monotonic() < deadline, text[-3000:]
            time.sleep(0.2)

    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def own_selector(process: tuple) -> str:
    """The label matchers of one process alone: each variable's label equal to its value, or absent."""
    labels = dict(process)
    return ", ".join(f'{v}="{labels.get(v, "")}"' for v in generate.VARIABLES)


def own_figures(process: tuple) -> dict:
    """Each self-cost figure of one process, computed from its own series alone: (panel, part or quantile) ->
    PromQL."""
    s = own_selector(process)
    iterations = f"sum(rate(kvalloc_overhead_iteration_seconds_count{{{s}}}[{RATE_INTERVAL}]))"
    out = {
        (PER_RANK_SELF_COST[0], part): (
            f'sum(rate(kvalloc_overhead_seconds_total{{{s}, part="{part}"}}[{RATE_INTERVAL}])) / {iterations}'
        )
        for part in PARTS
    }
    out[(PER_RANK_SELF_COST[1], "")] = iterations
    for q in ("0.5", "0.99"):
        out[(PER_RANK_SELF_COST[2], q)] = (
            f"histogram_quantile({q}, sum by (le) "
            f"(rate(kvalloc_overhead_iteration_seconds_bucket{{{s}}}[{RATE_INTERVAL}])))"
        )
    return out


def subs_of(title: str, target: dict) -> tuple:
    """What tells apart a target's series of one process: the part (by part), the quantile (its refId: A the p50,
    B the p99), or nothing (iterations)."""
    if title == PER_RANK_SELF_COST[0]:
        return PARTS
    if title == PER_RANK_SELF_COST[2]:
        return ({"A": "0.5", "B": "0.99"}[target["refId"]],)
    return ("",)


def query_range(base: str, expr: str, start: float, end: float) -> list:
    return api(base, "/api/v1/query_range", query=expr, start=start, end=end, step=1)["result"]


def test_self_cost_panels_divide_each_rank_by_its_own_iterations(stepping, prometheus_server, tmp_path):
    mp_dir = tmp_path / "mp"
    mp_dir.mkdir()
    stepping(mp_dir, A_PP0, 16, 40)  # busy
    stepping(mp_dir, A_PP1, 0, 80)  # empty iterations
    single_port = stepping("single", {"engine": "e1"}, 4, 20)
    with serve_multiprocess(mp_dir) as mp_port:
        base = prometheus_server(0, config=scrape_config(mp_port, single_port))
        mp, single = f"127.0.0.1:{mp_port}", f"127.0.0.1:{single_port}"
        busy = proc(model_name=MODEL_A, engine_type="unified", instance=mp, tp_rank="0", pp_rank="0")
        empty = proc(model_name=MODEL_A, engine_type="unified", instance=mp, tp_rank="0", pp_rank="1")
        e1 = proc(engine="e1", instance=single)

        # 8 scrapes of every process's iterations: every 4 s rate window of the last 5 s holds several.
        deadline = time.monotonic() + 90
        while True:
            got = wait_until_up(base, "count_over_time(kvalloc_overhead_iteration_seconds_count[1m]) >= 8", tmp_path)
            if len(got) == 3:
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.5)
        assert sorted(process_of(s["metric"]) for s in got) == sorted([busy, empty, e1])

        dashboard = load_dashboard()
        by_title = {p["title"]: p for p, _ in targets(dashboard)}
        esc = grafana_regex_escape
        selections = {
            "All": (ALL, [busy, empty, e1]),
            f"model_name {MODEL_A}": ({**ALL, "model_name": esc(MODEL_A)}, [busy, empty]),
            "pp_rank 0": ({**ALL, "pp_rank": esc("0")}, [busy]),
            "pp_rank 1": ({**ALL, "pp_rank": esc("1")}, [empty]),
            "pp_rank 0 and 1": ({**ALL, "pp_rank": "(0|1)"}, [busy, empty]),
            "engine e1": ({**ALL, "engine": esc("e1")}, [e1]),
        }
        end = time.time()
        start = end - 5
        # Each process's own figures, once: the panels' series under every selection must hold these values.
        own = {
            (p, key): [(t, float(v)) for t, v in result[0]["values"]]
            for p in (busy, empty, e1)
            for key, expr in own_figures(p).items()
            for result in [query_range(base, expr, start, end)]
        }
        checked = 0
        for label, (values, selected) in selections.items():
            values = {**values, "__rate_interval": RATE_INTERVAL}
            for title in PER_RANK_SELF_COST:
                for target in by_title[title]["targets"]:
                    expr = interpolate(target["expr"], values)
                    result = query_range(base, expr, start, end)
                    subs = subs_of(title, target)
                    got, legends = {}, []
                    for s in result:
                        m = s["metric"]
                        key = ((title, m["part"] if subs == PARTS else subs[0]), process_of(m))
                        assert key not in got, (label, title, m)
                        got[key] = [(t, float(v)) for t, v in s["values"]]
                        legends.append(legend(target["legendFormat"], m))
                    assert set(got) == {((title, sub), p) for p in selected for sub in subs}, (label, title, expr)
                    for ((_, sub), p), series in got.items():
                        mine = own[(p, (title, sub))]
                        assert [t for t, _ in series] == [t for t, _ in mine], (label, title, sub, p)
                        assert [v for _, v in series] == pytest.approx([v for _, v in mine], rel=1e-9), (
                            label, title, sub, p,
                        )  # fmt: skip
                        assert all(math.isfinite(v) and v >= 0 for _, v in series), (label, title, sub, p, series)
                    assert len(set(legends)) == len(legends), (label, title, legends)
                    checked += 1
        assert checked == len(selections) * sum(len(by_title[t]["targets"]) for t in PER_RANK_SELF_COST)

    # The figures tell the ranks apart: the busy rank's iterations cost more, where the wrapper works (its checks
    # and its sinks), and in total; the empty rank iterates more often (80/s against 40/s; an average over both
    # ranks would sit between them); no SGLang plugin runs, so no hook time.
    def at_end(p, title, sub):
        return own[(p, (title, sub))][-1][1]

    per_part, its = PER_RANK_SELF_COST[0], PER_RANK_SELF_COST[1]
    for part in ("checks", "exporters"):
        assert at_end(busy, per_part, part) > at_end(empty, per_part, part) > 0, part
    assert sum(at_end(busy, per_part, x) for x in PARTS) > sum(at_end(empty, per_part, x) for x in PARTS)
    assert {at_end(p, per_part, "hooks") for p in (busy, empty, e1)} == {0.0}
    assert at_end(empty, its, "") > at_end(busy, its, "") > 0
    for p in (busy, empty, e1):
        assert at_end(p, PER_RANK_SELF_COST[2], "0.5") <= at_end(p, PER_RANK_SELF_COST[2], "0.99") <= 0.01
