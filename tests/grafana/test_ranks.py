"""Ranks behind one endpoint, as SGLang runs them: the dashboard's rank variables and per-rank panels against a real
Prometheus.

Two scheduler ranks of engine ``e0`` run as separate processes in Prometheus multiprocess mode, with the rank
const labels the exporter documents: ``tp_rank 0, dp_rank 0`` FULL (8 requests of 7 tokens, 2 pages each: 16 of 16
pages used) and ``tp_rank 1, dp_rank 1`` empty. Their metrics are served through ONE /metrics endpoint (a
``MultiProcessCollector`` over their directory, as the parent process does), so they share one ``instance``. A
third process, engine ``e1``, is an ordinary single-process exporter without rank labels (3 requests, 6 pages)
on an endpoint of its own. Prometheus scrapes both endpoints.

Every query of every per-rank panel, with the template variables substituted as Grafana would (All is the
variable's allValue ``.*``; one value is regex-escaped; several are ``(a|b)``), returns exactly one series per
selected rank with that rank's own value (tp_rank 0: 16/17 = 0.941 used, tp_rank 1: 0; never their 0.47
average), series without rank labels match All, and each series' legend names its rank. The rank variables'
own queries (``label_values``, chained on the variables before them) return the rank values.

The helpers (ranks run in processes of their own with any const labels, one multiprocess endpoint over them, a
single-process exporter, the per-rank panel check) serve ``test_sglang_labels`` as well.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector

from exporters.prometheus import PrometheusExporter
from grafana import generate
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from tests.engine_model import Req, extend_args, split_extend
from tests.grafana.dashboard_model import (
    PER_RANK,
    REPO,
    grafana_regex_escape,
    interpolate,
    load_dashboard,
    targets,
)
from tests.prometheus_server import api, free_port, wait_until_up

RATE_INTERVAL = "4s"  # $__rate_interval at a 1 s scrape interval (see test_integration)
CAPACITY = 16 + 1  # 64 tokens at page size 4, plus the reserved page 0

# One rank, in a process of its own (the multiprocess directory, then its const labels as JSON, number of
# requests): it allocates, refreshes its gauges at the step, and exits; its values stay in the directory (not
# marked dead).
RANK_CHILD = r"""
import json, os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
import torch
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from tests.engine_model import Req, extend_args, split_extend
from exporters.prometheus import PrometheusExporter

labels, n = json.loads(sys.argv[2]), int(sys.argv[3])
w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
exp = PrometheusExporter(w, const_labels=labels, refresh_interval=0.0)
assert exp.multiprocess
reqs = [Req(f"r{i}") for i in range(n)]
if reqs:
    with w.batch([r.rid for r in reqs]):
        split_extend(reqs, [7] * n, w.alloc_extend(*extend_args(reqs, [7] * n)))
w.step()
exp.close()
print("RESULT ok")
"""


def state(n: int) -> dict:
    """The gauges of a process that allocated ``n`` requests of 7 tokens (2 pages each) and no more."""
    return gauges(used=2 * n, live=n, largest_free_run=CAPACITY - 1 - 2 * n)


def gauges(used: int, live: int, largest_free_run: int) -> dict:
    """One process's allocator state as the exporter reports it (one pool, "full"; requests of 7 tokens in 2 pages
    of 4 slots: internal fragmentation 1 - 7/8 while any is live; the free pages are one run at the end)."""
    free = CAPACITY - 1 - used
    return {
        "pages": {"free": free, "used": used, "staged": 0, "reserved": 1},
        "live": live,
        "internal": 0.125 if live else 0.0,
        "external": 0.0,
        "free_runs": 1 if free else 0,
        "largest": largest_free_run,
    }


# What each per-rank panel shows for one process: {(pool, state) or (pool,) or (): value}.
PANEL_VALUES = {
    "Pages by state, per pool": lambda g: {("full", s): v for s, v in g["pages"].items()},
    "Used pages, per pool": lambda g: {("full",): g["pages"]["used"] / CAPACITY},
    "Live requests": lambda g: {(): g["live"]},
    "Internal fragmentation": lambda g: {("full",): g["internal"]},
    "External fragmentation": lambda g: {("full",): g["external"]},
    "Free runs": lambda g: {("full",): g["free_runs"]},
    "Largest free run": lambda g: {("full",): g["largest"]},
    "SWA evicted tokens": lambda g: {(): 0.0},
    "Tokens outside the window": lambda g: {(): 0.0},
}
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
# Every template variable at All (its allValue).
ALL = dict.fromkeys(generate.VARIABLES, ".*")


def legend(fmt: str, metric: dict) -> str:
    """A series' legend as Grafana's Prometheus data source renders it: a label the series lacks is empty."""
    return _LEGEND.sub(lambda x: metric.get(x.group(1), ""), fmt)


def process_of(metric: dict) -> tuple:
    """The process a series belongs to: the labels of the dashboard's variables it carries (``proc(...)``)."""
    return tuple(sorted((k, v) for k, v in metric.items() if k in generate.VARIABLES))


def proc(**labels: str) -> tuple:
    """A process, as ``process_of`` names the series of it."""
    return tuple(sorted(labels.items()))


def _run_rank(mp_dir, labels: dict, n: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return subprocess.Popen(
        [sys.executable, "-c", RANK_CHILD, str(mp_dir), json.dumps(labels), str(n)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_ranks(mp_dirs: dict) -> None:
    """Run every rank ``{mp_dir: [(const labels, number of requests), ...]}`` in a process of its own (all at
    once), each in multiprocess mode over its directory, and wait for them."""
    procs = []
    for mp_dir, ranks in mp_dirs.items():
        mp_dir.mkdir(exist_ok=True)
        procs += [_run_rank(mp_dir, labels, n) for labels, n in ranks]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "RESULT ok" in out, err[-3000:]


@contextlib.contextmanager
def serve_multiprocess(mp_dir):
    """One /metrics endpoint over every rank's metrics in ``mp_dir`` (a ``MultiProcessCollector``, as the parent
    process of multiprocess ranks serves them); yields its port."""
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(mp_dir))
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=reg)
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def serve_single_process(const_labels: dict, n: int):
    """An ordinary single-process exporter in this process, with ``const_labels``, after ``n`` requests; yields
    its port."""
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
    reqs = [Req(f"r{i}") for i in range(n)]
    with w.batch([r.rid for r in reqs]):
        split_extend(reqs, [7] * n, w.alloc_extend(*extend_args(reqs, [7] * n)))
    w.step()
    exp = PrometheusExporter(w, const_labels=const_labels, multiprocess=False)
    try:
        yield exp.serve()
    finally:
        exp.close()


@pytest.fixture
def endpoints(tmp_path):
    """(multiprocess endpoint port, single-process endpoint port): the two ranks' metrics behind one /metrics,
    and engine e1's own exporter."""
    mp_dir = tmp_path / "mp"
    run_ranks(
        {
            mp_dir: [
                ({"engine": "e0", "tp_rank": "0", "dp_rank": "0"}, 8),
                ({"engine": "e0", "tp_rank": "1", "dp_rank": "1"}, 0),
            ]
        }
    )
    with serve_multiprocess(mp_dir) as mp_port, serve_single_process({"engine": "e1"}, 3) as single_port:
        yield mp_port, single_port


def scrape_config(*ports: int) -> str:
    return (
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: kvalloc\n    static_configs:\n"
        f"      - targets: [{', '.join(repr(f'127.0.0.1:{p}') for p in ports)}]\n"
    )


def wait_for_scrapes(base: str, processes: int, tmp_path) -> None:
    """Wait until Prometheus has 6 scrapes of each of ``processes`` processes: enough for every rate window."""
    deadline = time.monotonic() + 60
    while True:
        got = wait_until_up(base, "count_over_time(kvalloc_page_size_tokens[1m]) >= 6", tmp_path)
        if len(got) == processes:
            return
        assert time.monotonic() < deadline, got
        time.sleep(0.5)


def label_values(base: str, query: str, values: dict[str, str]) -> list[str]:
    """A ``label_values(selector, label)`` variable query, as Grafana's Prometheus data source runs it."""
    m = re.fullmatch(r"label_values\((.*), (\w+)\)", query)
    assert m, query
    return api(base, f"/api/v1/label/{m.group(2)}/values", **{"match[]": interpolate(m.group(1), values)})


def check_per_rank_panels(base: str, dashboard: dict, processes: dict, selections: dict, end: float) -> int:
    """Every query of every per-rank panel, under each selection ``{label: (variable values, [selected
    processes])}``: exactly one series per selected process (and pool, state) holding that process's own value
    (``PANEL_VALUES`` of its gauges, ``processes[p]``) at every step, each with a legend of its own. Returns the
    number of queries checked."""
    by_title = {p["title"]: p for p, _ in targets(dashboard)}
    assert set(PANEL_VALUES) == set(PER_RANK)
    checked = 0
    for label, (values, selected) in selections.items():
        values = {**values, "__rate_interval": RATE_INTERVAL}
        for title in PER_RANK:
            for target in by_title[title]["targets"]:
                expr = interpolate(target["expr"], values)
                result = api(base, "/api/v1/query_range", query=expr, start=end - 5, end=end, step=1)["result"]
                got, legends = {}, []
                for s in result:
                    m = s["metric"]
                    sub = tuple(m[k] for k in ("pool", "state") if k in m)
                    assert (process_of(m), sub) not in got, (label, title, m)
                    got[(process_of(m), sub)] = {float(v) for _, v in s["values"]}
                    legends.append(legend(target["legendFormat"], m))
                want = {(p, sub): {v} for p in selected for sub, v in PANEL_VALUES[title](processes[p]).items()}
                assert got.keys() == want.keys(), (label, title, expr)
                for key, vals in got.items():  # the same value at every step: the processes are at rest
                    assert len(vals) == 1 and vals.pop() == pytest.approx(want[key].pop()), (label, title, key)
                # Each series' legend is its own: it names the rank (and the deployment and instance).
                assert len(set(legends)) == len(legends), (label, title, legends)
                checked += 1
    return checked


def test_rank_variables_and_per_rank_panels_against_prometheus(endpoints, prometheus_server, tmp_path):
    mp_port, single_port = endpoints
    base = prometheus_server(0, config=scrape_config(mp_port, single_port))
    mp, single = f"127.0.0.1:{mp_port}", f"127.0.0.1:{single_port}"
    wait_for_scrapes(base, 3, tmp_path)
    # One instance carries both ranks.
    scraped = wait_until_up(base, "kvalloc_page_size_tokens", tmp_path)
    assert sorted((s["metric"]["instance"], s["metric"].get("tp_rank")) for s in scraped) == sorted(
        [(mp, "0"), (mp, "1"), (single, None)]
    )

    # 1. The variables' own queries, chained as in the dashboard.
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    e0 = {**ALL, "engine": "e0", "instance": grafana_regex_escape(mp)}
    assert label_values(base, variables["engine"]["query"], ALL) == ["e0", "e1"]
    assert label_values(base, variables["instance"]["query"], e0) == [mp]
    assert label_values(base, variables["tp_rank"]["query"], ALL) == ["0", "1"]
    assert label_values(base, variables["tp_rank"]["query"], e0) == ["0", "1"]
    assert label_values(base, variables["dp_rank"]["query"], ALL) == ["0", "1"]
    assert label_values(base, variables["dp_rank"]["query"], {**e0, "tp_rank": "0"}) == ["0"]  # chained on tp_rank
    # engine e1 has no rank labels, and neither engine has SGLang's labels: nothing to list, Grafana stays at All.
    e1 = {**ALL, "engine": "e1"}
    assert label_values(base, variables["tp_rank"]["query"], e1) == []
    assert label_values(base, variables["dp_rank"]["query"], e1) == []
    for name in ("model_name", "engine_type", "pp_rank"):
        assert label_values(base, variables[name]["query"], ALL) == [], name

    # 2. Every per-rank panel query returns each selected process's own values, one series each.
    rank0 = proc(engine="e0", instance=mp, tp_rank="0", dp_rank="0")
    rank1 = proc(engine="e0", instance=mp, tp_rank="1", dp_rank="1")
    e1_key = proc(engine="e1", instance=single)
    processes = {
        rank0: gauges(used=16, live=8, largest_free_run=0),  # full
        rank1: gauges(used=0, live=0, largest_free_run=16),  # empty
        e1_key: gauges(used=6, live=3, largest_free_run=10),  # no rank labels
    }
    selections = {
        "All": (ALL, [rank0, rank1, e1_key]),
        "tp_rank 0": ({**e0, "tp_rank": grafana_regex_escape("0")}, [rank0]),
        "dp_rank 1": ({**ALL, "dp_rank": grafana_regex_escape("1")}, [rank1]),
        "tp_rank 0 and 1": ({**ALL, "tp_rank": "(0|1)"}, [rank0, rank1]),
        "engine e1": (e1, [e1_key]),
    }
    end = time.time()
    checked = check_per_rank_panels(base, dashboard, processes, selections, end)
    by_title = {p["title"]: p for p, _ in targets(dashboard)}
    assert checked == len(selections) * sum(len(by_title[t]["targets"]) for t in PER_RANK)

    # 3. The case the issue is about, in numbers: the used share of the full rank and of the empty one, not their
    # 8/17 = 0.47 average.
    [used] = by_title["Used pages, per pool"]["targets"]
    result = api(base, "/api/v1/query", query=interpolate(used["expr"], e0), time=end)["result"]
    shares = {s["metric"]["tp_rank"]: round(float(s["value"][1]), 3) for s in result}
    assert shares == {"0": 0.941, "1": 0.0}
    legends = {s["metric"]["tp_rank"]: legend(used["legendFormat"], s["metric"]) for s in result}
    assert legends == {"0": f"full, e0   tp=0 pp= dp=0 ({mp})", "1": f"full, e0   tp=1 pp= dp=1 ({mp})"}
