"""The demo engine with injected faults, scraped by a real Prometheus that loads the alert rules: every query of
every dashboard panel, with its template variables substituted as Grafana would, returns a non-empty result with
real values; the invariant-violation alert fires for each injected fault; and the violations panel's exemplars
carry the trace ids of the spans (received over OTLP/HTTP from the same demo) that recorded those violations.

The demo runs as a subprocess through the documented CLI (``instrumented-alloc demo ... --metrics-port PORT``,
which prints ``metrics: http://127.0.0.1:PORT/metrics`` once serving). Prometheus runs with the committed
``grafana/prometheus.yml`` (its target rewritten to that port, scrape and rule evaluation every second, the rule
path made absolute). Waits poll for a state and fail with the logs when it never comes; nothing asserts how long
anything took.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from grafana import generate
from tests.grafana.dashboard_model import (
    GRAFANA,
    REPO,
    RULES,
    grafana_regex_escape,
    interpolate,
    load_dashboard,
    targets,
)
from tests.otlp_receiver import Receiver
from tests.prometheus_server import api, free_port, query

# Two faults whose violations the demo reports once each, with no knock-on violation (a double free in record
# mode corrupts the free list: duplicate allocations follow, and the allocator eventually fails and the demo
# stops, taking its /metrics with it). Fault -> the invariant it breaks.
FAULTS = {"leak": "request_leak", "swa-misaligned": "swa_evicted_seqlen_page_aligned"}
PRESET = "swa-128"  # both pools, so the SWA panels have real series
PACE = 50  # steps per second: traffic spread over many scrapes
# The faults come 5 and 6 s of steps after the demo starts serving, scraped every second from its first second.
FAULT_STEPS = {"leak": 5 * PACE, "swa-misaligned": 6 * PACE}
SPAN_S = 120  # the dashboard time range the queries are sent with (ends now)
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 * scrape interval), with the data source's
# scrape interval (timeInterval) at this test's 1 s and a 1 s step.
RATE_INTERVAL = "4s"
_METRICS_LINE = re.compile(r"^metrics: http://127\.0\.0\.1:(\d+)/metrics$", re.M)


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no output)"


def wait_for(what: str, probe, timeout: float, logs: list[Path]):
    """Call ``probe()`` until it returns something truthy; fail naming ``what`` with the logs' tails otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = probe()
        except OSError:  # a server not listening yet
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"never saw {what} within {timeout:g} s\n" + "\n".join(f"--- {p}:\n{_tail(p)}" for p in logs))
        time.sleep(0.25)


@pytest.fixture
def demo(tmp_path):
    """``start(port, otlp_endpoint)`` starts the demo serving /metrics on ``port`` and exporting its spans to
    ``otlp_endpoint``, with the faults injected; waits for its metrics line and returns its [stdout, stderr] logs.
    Every demo started is stopped at teardown."""
    procs = []

    def start(port: int, otlp_endpoint: str) -> list[Path]:
        out, err = tmp_path / "demo.out", tmp_path / "demo.err"
        argv = [
            sys.executable, "-m", "instrumented_alloc.cli", "demo",
            "--preset", PRESET, "--duration", "600", "--pace", str(PACE), "--seed", "7", "--mode", "record",
            "--page-size", "16", "--metrics-port", str(port), "--otlp-endpoint", otlp_endpoint,
        ]  # fmt: skip
        for fault, step in FAULT_STEPS.items():
            argv += ["--inject", f"{fault}@{step}"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        with open(out, "wb") as o, open(err, "wb") as e:
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=o, stderr=e)
        procs.append(proc)

        def metrics_port():
            if proc.poll() is not None:
                logs = "\n".join(f"--- {p}:\n{_tail(p)}" for p in (out, err))
                pytest.fail(f"the demo exited with {proc.returncode}\n{logs}")
            m = _METRICS_LINE.search(out.read_text(errors="replace"))
            return int(m.group(1)) if m else None

        assert wait_for("the demo's metrics line", metrics_port, 60, [out, err]) == port
        return [out, err]

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def receiver():
    """An OTLP/HTTP receiver on 127.0.0.1 that decodes the demo's spans (what a Collector in front of Jaeger or
    Tempo would take)."""
    with Receiver() as rx:
        yield rx


def violation_trace_ids(rx: Receiver) -> dict[str, set[str]]:
    """invariant -> trace ids (32 hex digits) of the spans that carry a kv.violation for it: a kv.violation
    event on a request's span, or a kv.violation span of its own."""
    out: dict[str, set[str]] = {}
    with rx.lock:
        for _, span in rx.spans:
            events = [ev for ev in span.events if ev.name == "kv.violation"]
            found = [{kv.key: kv.value.string_value for kv in ev.attributes} for ev in events]
            if span.name == "kv.violation":
                found.append({kv.key: kv.value.string_value for kv in span.attributes})
            for attrs in found:
                out.setdefault(attrs["kv.violation.invariant"], set()).add(span.trace_id.hex())
    return out


def prometheus_config(target_port: int) -> str:
    """The committed prometheus.yml, pointed at the demo's port, evaluating every second."""
    cfg = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str((GRAFANA / f).resolve()) for f in cfg["rule_files"]]
    assert cfg["rule_files"] == [str(p) for p in RULES]
    [job] = cfg["scrape_configs"]
    [static] = job["static_configs"]
    assert static["targets"] == ["127.0.0.1:9464"]
    static["targets"] = [f"127.0.0.1:{target_port}"]
    return yaml.safe_dump(cfg)


def ready(base: str) -> bool:
    with urllib.request.urlopen(f"{base}/-/ready", timeout=5) as r:
        return r.status == 200


def firing(base: str, alertname: str) -> list[dict]:
    return [
        a
        for a in api(base, "/api/v1/alerts")["alerts"]
        if a["labels"]["alertname"] == alertname and a["state"] == "firing"
    ]


def finite_values(result: list, instant: bool) -> list[float]:
    vals = [s["value"][1] for s in result] if instant else [v[1] for s in result for v in s["values"]]
    return [float(v) for v in vals if math.isfinite(float(v))]


def test_demo_with_faults_dashboard_queries_and_violation_alert(demo, prometheus_server, receiver, tmp_path):
    # Prometheus first, then the demo on the port it scrapes: the first scrapes see the violation counter at 0,
    # so the rate panels see the fault as an increase (a counter already above 0 at its first scrape has no
    # rate; the alert's second clause covers that case, unit-tested in kvalloc_test.yml).
    port = free_port()
    base = prometheus_server(port, config=prometheus_config(port))
    logs = [tmp_path / "prometheus.log"]
    wait_for("Prometheus ready", lambda: ready(base), 30, logs)
    rx = receiver
    logs = [*demo(port, rx.endpoint), *logs]
    instance = f"127.0.0.1:{port}"

    # 1. The violation alert fires for each injected fault, on that instance, with its rendered annotations, and
    # for nothing else.
    expected = set(FAULTS.values())

    def alerts():
        got = {a["labels"]["invariant"]: a for a in firing(base, "KvallocInvariantViolation")}
        return got if expected <= set(got) else None

    got = wait_for(f"KvallocInvariantViolation firing for {sorted(expected)}", alerts, 90, logs)
    assert set(got) == expected
    for invariant, alert in got.items():
        assert {k: alert["labels"][k] for k in ("severity", "job", "instance", "engine")} == {
            "severity": "critical",
            "job": "kvalloc",
            "instance": instance,
            "engine": "demo",  # the demo's --engine-label default
        }
        # The demo has an engine label and no rank labels: the summary names what the series carries.
        assert (
            alert["annotations"]["summary"] == f"KV allocator invariant {invariant} violated on {instance} engine demo"
        )

    # 2. Enough history for every rate window and range: 10 scrapes of traffic.
    wait_for(
        "10 scrapes of the demo",
        lambda: [s for s in query(base, "count_over_time(kvalloc_page_size_tokens[5m])") if float(s["value"][1]) >= 10],
        60,
        logs,
    )

    # 3. The template variables' own queries, as Grafana runs label_values(metric{...}, label).
    engines = api(base, "/api/v1/label/engine/values", **{"match[]": "kvalloc_page_size_tokens"})
    assert engines == ["demo"]
    instances = api(
        base,
        "/api/v1/label/instance/values",
        **{"match[]": f'kvalloc_page_size_tokens{{engine=~"{grafana_regex_escape(engines[0])}"}}'},
    )
    assert instances == [instance]
    # The demo is one process without rank labels and without SGLang's labels: those variables list nothing, so
    # Grafana leaves them at All (allValue .*, which matches series without the label).
    unset = ("model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank")
    assert set(unset) == set(generate.VARIABLES) - {"engine", "instance"}
    for name in unset:
        assert api(base, f"/api/v1/label/{name}/values", **{"match[]": "kvalloc_page_size_tokens"}) == []

    # 4. Every query of every panel, with the variables at All (allValue .*) and at the values listed above.
    end = time.time()
    unset_all = dict.fromkeys(unset, ".*")
    selections = {
        "All": {"engine": ".*", "instance": ".*", **unset_all},
        "selected": {
            "engine": grafana_regex_escape(engines[0]),
            "instance": grafana_regex_escape(instance),
            **unset_all,
        },
    }
    dashboard = load_dashboard()
    problems, sent = [], 0
    for label, variables in selections.items():
        values = {**variables, "__rate_interval": RATE_INTERVAL, "__range": f"{SPAN_S}s"}
        for panel, target in targets(dashboard):
            expr = interpolate(target["expr"], values)
            instant = bool(target.get("instant"))
            if instant:
                result = api(base, "/api/v1/query", query=expr, time=end)["result"]
            else:
                result = api(base, "/api/v1/query_range", query=expr, start=end - SPAN_S, end=end, step=1)["result"]
            sent += 1
            if not result or not finite_values(result, instant):
                problems.append(f"[{label}] {panel['title']} / {target['refId']}: {expr} -> {result}")
    assert problems == []
    assert sent == 2 * len(targets(dashboard))

    # 5. The Health panel shows the injected faults: a nonzero violation rate for their invariants, no other.
    [violations] = [t for p, t in targets(dashboard) if p["title"] == "Invariant violations by invariant"]
    expr = interpolate(violations["expr"], {**selections["All"], "__rate_interval": RATE_INTERVAL})
    result = api(base, "/api/v1/query_range", query=expr, start=end - SPAN_S, end=end, step=1)["result"]
    nonzero = {s["metric"]["invariant"] for s in result if any(float(v) > 0 for _, v in s["values"])}
    assert nonzero == expected

    # 6. The violations panel's exemplars (the query has exemplar: true) link to traces: Prometheus stored one
    # exemplar per faulted invariant, and its trace_id is the trace of a span that recorded that very violation,
    # as the OTLP receiver decoded it. (A request's span is exported when the request ends: wait for both.)
    exemplars = api(base, "/api/v1/query_exemplars", query=expr, start=end - SPAN_S, end=time.time() + 60)
    by_invariant = {
        series["seriesLabels"]["invariant"]: [e["labels"]["trace_id"] for e in series["exemplars"]]
        for series in exemplars
    }
    assert set(by_invariant) == expected

    def spans_of_faults():
        got = violation_trace_ids(rx)
        return got if expected <= set(got) else None

    traces = wait_for("the faulted requests' spans at the OTLP receiver", spans_of_faults, 90, logs)
    for invariant, trace_ids in by_invariant.items():
        assert len(trace_ids) == 1 and re.fullmatch(r"[0-9a-f]{32}", trace_ids[0]), (invariant, trace_ids)
        assert trace_ids[0] in traces[invariant], (invariant, trace_ids, traces[invariant])
