"""The exporters reach SGLang's own outputs: ``python -m sglang.launch_server`` with ``--enable-metrics``,
``--enable-trace`` and the plugin on (record mode, ``KVALLOC_RECORD_DIR``), two tensor-parallel ranks
(``--tp-size 2`` runs on this CPU with one core per rank), the hybrid SWA model.

- SGLang's HTTP ``/metrics`` serves ``kvalloc_`` series of both ranks, with SGLang's labels (``model_name``,
  ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``); once the server is idle, each rank's page counts
  equal that scheduler's allocator (its free pages are SGLang's own ``kv_available_tokens``; every state is what
  the rank's recording replays at its last step).
- A real Prometheus scrapes it, and every query of every Grafana panel returns data.
- A receiver started by the test gets ``kv.request`` spans whose parent is SGLang's root span of the request.
- One recording per rank, with the rank in its name and the run metadata; ``instrumented-alloc check`` reads it.

One server start for all of it (a module fixture); traffic runs while Prometheus scrapes, then stops.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from instrumented_alloc.sglang_plugin import faults, tiny_model, traffic
from tests.grafana.dashboard_model import interpolate, load_dashboard, targets
from tests.otlp_receiver import Receiver, _value
from tests.prometheus_server import api, free_port
from tests.sglang import harness

pytestmark = pytest.mark.sglang

SPAN_S = 120
RATE_INTERVAL = "4s"
SAMPLE = re.compile(r"^([\w:]+)\{([^}]*)\} ([-+\deE.naif]+)$", re.M)


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    out = []
    for m in SAMPLE.finditer(text):
        if m[1] == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
            out.append((labels, float(m[3])))
    return out


def get(url: str, data: dict | None = None, timeout: float = 60):
    req = urllib.request.Request(
        url, json.dumps(data).encode() if data is not None else None, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


class Server:
    def __init__(self, tmp: Path, receiver: Receiver):
        harness.need_sglang()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = tiny_model.write(str(tmp / "model"), "swa")
        self.record_dir = tmp / "recordings"
        self.log_path = tmp / "server.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVALLOC_", "OTEL_", "PROMETHEUS_"))}
        env.update(
            SGLANG_USE_CPU_ENGINE="1",
            HF_HUB_OFFLINE="1",
            SGLANG_CPU_OMP_THREADS_BIND="0|1",  # one core per rank (the machine has one NUMA node)
            SGLANG_SWA_EVICTION_INTERVAL="16",
            SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="0",
            SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS="200",
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
            KVALLOC_MODE="record",
            KVALLOC_RECORD_DIR=str(self.record_dir),
            KVALLOC_SWEEP_INTERVAL="0",
            KVALLOC_INJECT="leak",
        )
        argv = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model,
            "--load-format",
            "dummy",
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--disable-cuda-graph",
            "--page-size",
            "16",
            "--max-total-tokens",
            "4096",
            "--swa-full-tokens-ratio",  # see tests/sglang/driver.py: the CPU's torch_native SWA reads
            "1",
            "--tp-size",
            "2",
            "--enable-metrics",
            "--enable-trace",
            "--otlp-traces-endpoint",
            receiver.endpoint,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]
        self.log = open(self.log_path, "wb")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                get(self.base + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the server never answered /health:\n{self.tail()}")
                time.sleep(1)

    def tail(self, n: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def generate(self, input_ids, rid, max_new_tokens):
        body = {
            "input_ids": input_ids,
            "rid": rid,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0.0},
        }
        return json.loads(get(self.base + "/generate", body))

    def metrics(self) -> str:
        return get(self.base + "/metrics")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def receiver():
    with Receiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def server(tmp_path_factory, receiver):
    s = Server(tmp_path_factory.mktemp("server"), receiver)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def served(server):
    """Traffic for about 12 s (the rate windows need scrapes of it), one request leaking its pages (so the violation
    panels have data); then the server goes idle and the rids sent are returned."""
    rids = []
    leaked = traffic.rid(__import__("random").Random(9), faults.tag("leak"))
    waves = traffic.prefix_waves(11, waves=6, per_wave=4, new_tokens=(8, 40))
    end = time.monotonic() + 12
    i = 0
    while time.monotonic() < end or i < 2:
        wave = waves[i % len(waves)]
        threads = []
        for ids, rid, n in zip(wave.input_ids, wave.rids, wave.max_new_tokens):
            rid = f"{rid}-{i}"
            rids.append(rid)
            t = threading.Thread(target=server.generate, args=(ids, rid, n))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        if i == 1:
            server.generate(wave.input_ids[0], leaked, 8)
        i += 1
    time.sleep(4)  # idle: the plugin's sweep runs, the multiprocess gauges' trailing refresh lands
    return {"rids": rids, "leaked": leaked}


def test_kvalloc_metrics_join_sglangs_metrics_for_both_ranks(server, served):
    text = server.metrics()
    pages = samples(text, "kvalloc_pages")
    ranks = sorted({s["tp_rank"] for s, _ in pages})
    assert ranks == ["0", "1"], text[:2000]
    for labels, _ in pages:
        assert {k: labels[k] for k in ("model_name", "engine_type", "pp_rank", "moe_ep_rank")} == {
            "model_name": server.model,
            "engine_type": "unified",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
    # SGLang exports its scheduler metrics from rank 0 only (without --enable-metrics-for-all-schedulers).
    available = {s["tp_rank"]: v for s, v in samples(text, "sglang:kv_available_tokens")}
    assert list(available) == ["0"]
    for rank in ranks:
        mine = {(s["pool"], s["state"]): v for s, v in pages if s["tp_rank"] == rank}
        # The full pool of 4096 tokens at page size 16: 256 pages and page 0.
        assert sum(v for (pool, _), v in mine.items() if pool == "full") == 257
        assert mine[("full", "reserved")] == 1
        if rank in available:  # SGLang's available tokens are its free pages
            assert mine[("full", "free")] * 16 == available[rank], (mine, available)


def test_each_ranks_self_cost_joins_sglangs_metrics_as_its_recording_has_it(server, served):
    from exporters.recorder import Recording
    from instrumented_alloc.events import StepBoundary
    from instrumented_alloc.selfcost import PARTS

    text = server.metrics()
    cost = samples(text, "kvalloc_overhead_seconds_total")
    iterations = {s["tp_rank"]: v for s, v in samples(text, "kvalloc_overhead_iteration_seconds_count")}
    spent = {s["tp_rank"]: v for s, v in samples(text, "kvalloc_overhead_iteration_seconds_sum")}
    for rank, path in enumerate(sorted(server.record_dir.glob("*.sqlite"))):
        mine = {s["part"]: v for s, v in cost if s["tp_rank"] == str(rank)}
        assert sorted(mine) == sorted(PARTS), text[:3000]
        # Every scheduler iteration of the traffic was charged: the hooks, the checks, the exporters.
        assert mine["hooks"] > 0 and mine["checks"] > 0 and mine["exporters"] > 0, mine
        assert iterations[str(rank)] > 10
        # The counters hold what the rank's last step boundary carried, which its recording has too.
        rec = Recording(path)
        last = None
        for last in rec.events(kinds=[StepBoundary]):  # noqa: B007 (the last one)
            pass
        rec.close()
        assert last is not None and len(last.overhead) == len(PARTS)
        assert [mine[p] for p in PARTS] == pytest.approx(list(last.overhead), rel=1e-9), (mine, last)
        # The iterations' observations add up to the total, less the idle sweeps (which are no iteration's).
        assert 0 < spent[str(rank)] <= sum(mine.values())


def test_each_rank_has_its_recording_and_the_metrics_equal_its_allocator(server, served):
    from dashboard.views import run_identity
    from exporters.recorder import Recording
    from instrumented_alloc.replay import to_snapshots
    from instrumented_alloc.stats import pages_by_state

    paths = sorted(server.record_dir.glob("*.sqlite"))
    assert [re.sub(r"kvalloc-\d+-", "kvalloc-RUN-", p.name) for p in paths] == [
        "kvalloc-RUN-tp0-pp0.sqlite",
        "kvalloc-RUN-tp1-pp0.sqlite",
    ]
    text = server.metrics()
    for rank, path in enumerate(paths):
        rec = Recording(path)
        meta = rec.meta
        assert {k: meta[k] for k in ("engine", "sglang_version", "model", "tp_rank", "pp_rank", "engine_type")} == {
            "engine": "sglang",
            "sglang_version": "0.5.23",
            "model": server.model,
            "tp_rank": rank,
            "pp_rank": 0,
            "engine_type": "unified",
        }
        # The dashboard heads each rank's column with its engine and ranks.
        assert run_identity(meta) == f"engine sglang · tp_rank {rank} · pp_rank 0"
        state = rec.state_at(rec.steps()[1])
        snaps = to_snapshots(state, page_size=16, sliding_window=meta["sliding_window"])
        metric = {(s["pool"], s["state"]): v for s, v in samples(text, "kvalloc_pages") if s["tp_rank"] == str(rank)}
        for pool, snap in snaps.items():
            for st, n in pages_by_state(snap).items():
                assert metric[(pool, st)] == n, (rank, pool, st, metric, n)
        rec.close()


def test_the_leak_is_named_in_both_ranks_recordings_and_check_reports_it(server, served):
    for path in sorted(server.record_dir.glob("*.sqlite")):
        out = subprocess.run(
            [sys.executable, "-m", "instrumented_alloc.cli", "check", str(path)],
            capture_output=True,
            text=True,
            check=False,
            cwd=harness.ROOT,
        )
        assert out.returncode == 1, out.stdout + out.stderr
        assert re.search(rf"^request_leak\s+1\s+\d+\s+{served['leaked']}\s+error$", out.stdout, re.M), out.stdout


def test_kv_request_spans_are_children_of_sglangs_request_spans(receiver, served):
    rid = served["rids"][0]

    def both(rx):
        names = {s.name for _, s in rx.spans}
        return f"Req {rid[:8]}" in {n.strip() for n in names} and rid in rx.request_spans()

    assert receiver.wait_for(both, timeout=30), sorted({s.name for _, s in receiver.spans})[:20]
    with receiver.lock:
        roots = [
            s
            for _, s in receiver.spans
            if s.name.strip() == f"Req {rid[:8]}"
            and {kv.key: _value(kv.value) for kv in s.attributes}.get("rid") == rid
        ]
    (root,) = roots
    span, attrs = receiver.request_spans()[rid]
    assert span.parent_span_id == root.span_id and span.trace_id == root.trace_id
    assert attrs["kv.page_size"] == 16 and attrs["kv.violations"] == 0
    leaked, leaked_attrs = receiver.request_spans()[served["leaked"]]
    assert leaked_attrs["kv.violations"] == 1 and leaked.status.code == 2  # ERROR


def test_prometheus_scrapes_it_and_every_dashboard_panel_query_returns_data(server, served, prometheus_server):
    base = prometheus_server(server.port)
    # Scrapes enough for the range queries (the traffic before is in SGLang's counters), some of them of a busy
    # server: the self-cost per iteration has no value while no iteration runs.
    stop = threading.Event()

    def busy() -> None:
        waves = traffic.prefix_waves(12, waves=2, per_wave=2, new_tokens=(8, 16))
        i = 0
        while not stop.is_set():
            wave = waves[i % len(waves)]
            for ids, rid, n in zip(wave.input_ids, wave.rids, wave.max_new_tokens):
                server.generate(ids, f"{rid}-busy-{i}", n)
            i += 1

    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    ready = (
        "count_over_time(kvalloc_page_size_tokens[5m]) >= 8",
        f"rate(kvalloc_overhead_iteration_seconds_count[{RATE_INTERVAL}]) > 0",
    )
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                if all(api(base, "/api/v1/query", query=q)["result"] for q in ready):
                    break
            except OSError:
                pass  # Prometheus is not listening yet
            assert time.monotonic() < deadline, "Prometheus did not scrape SGLang's /metrics of a busy server"
            time.sleep(1)
    finally:
        stop.set()
        worker.join(timeout=120)
    dashboard = load_dashboard()
    variables = {v["name"]: ".*" for v in dashboard["templating"]["list"] if v.get("type") == "query"}
    values = {**variables, "__rate_interval": RATE_INTERVAL, "__range": f"{SPAN_S}s"}
    end = time.time()
    problems = []
    for panel, target in targets(dashboard):
        expr = interpolate(target["expr"], values)
        if target.get("instant"):
            result = api(base, "/api/v1/query", query=expr, time=end)["result"]
        else:
            result = api(base, "/api/v1/query_range", query=expr, start=end - SPAN_S, end=end, step=1)["result"]
        if not result:
            problems.append(f"{panel['title']} / {target['refId']}: {expr}")
    assert problems == []
