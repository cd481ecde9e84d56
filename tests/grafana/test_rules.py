"""The alert rules, the Prometheus config and the provisioning files, checked by promtool (run for real) and
read back: every alert has a severity, a summary and a description, and a unit test that shows it firing on a bad
series and silent on healthy ones."""

from __future__ import annotations

import re
import subprocess

import yaml

from grafana import generate
from tests.grafana.dashboard_model import GRAFANA, RULE_TESTS, RULES, load_rules
from tests.prometheus_server import need_binary

# The labels that tell one process (one rank's allocator) from another, and SGLang's moe_ep_rank (derived from
# tp_rank: it tells no process apart, but an alert keeps it like every label of its series).
PROCESS_LABELS = {"job", "instance", *generate.VARIABLES, "moe_ep_rank"}
# SGLang's scheduler labels (the const labels inside SGLang; dp_rank only when DP is on).
SGLANG_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
ALERTS = [
    "KvallocInvariantViolation",
    "KvallocPageLeak",
    "KvallocExternalFragmentationHigh",
    "KvallocSwaOutsideWindowGrowing",
    "KvallocAllocFailures",
    "KvallocEventsDropped",
]


def promtool(*args: str) -> str:
    res = subprocess.run([need_binary("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=GRAFANA)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout + res.stderr


def test_promtool_check_rules_is_clean():
    out = promtool("check", "rules", *map(str, RULES))
    assert f"SUCCESS: {len(ALERTS)} rules found" in out


def test_promtool_unit_tests_pass():
    assert [p.name for p in RULE_TESTS] == ["kvalloc_test.yml"]
    out = promtool("test", "rules", *map(str, RULE_TESTS))
    assert "SUCCESS" in out and "FAILED" not in out


def test_prometheus_yml_is_valid_and_scrapes_the_demo_port():
    out = promtool("check", "config", "prometheus.yml")
    assert "SUCCESS: 1 rule files found" in out and f"SUCCESS: {len(ALERTS)} rules found" in out
    cfg = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts/kvalloc.yml"]
    [job] = cfg["scrape_configs"]
    assert [sc["targets"] for sc in job["static_configs"]] == [["127.0.0.1:9464"]]


def test_every_alert_has_severity_summary_description():
    rules = load_rules()
    assert [r["alert"] for r in rules] == ALERTS
    for r in rules:
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        assert set(r["annotations"]) == {"summary", "description"}, r["alert"]
        # One process: the instance and, when the series carry them, the labels the dashboard's per-rank legends
        # name: the demo's engine, SGLang's model_name and engine_type, the ranks (in multiprocess mode every rank
        # sits behind one instance; two ranks' alerts must read differently).
        named = ("engine", "model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank")
        assert named == (*generate.DEPLOYMENT_LABELS, *generate.RANK_LABELS)
        process = "{{ $labels.instance }}" + "".join(
            f"{{{{ with $labels.{label} }}}} {label} {{{{ . }}}}{{{{ end }}}}" for label in named
        )
        assert process in r["annotations"]["summary"], r["alert"]
        assert process in r["annotations"]["description"], r["alert"]
        # No rule aggregates the process's labels away: no by (...), and no without (...) that names one of them.
        assert not re.search(r"\bby\s*\(", r["expr"]), r["alert"]
        for dropped in re.findall(r"\bwithout\s*\(([^)]*)\)", r["expr"]):
            assert not {x.strip() for x in dropped.split(",")} & PROCESS_LABELS, (r["alert"], dropped)
    severities = {r["alert"]: r["labels"]["severity"] for r in rules}
    assert severities["KvallocInvariantViolation"] == severities["KvallocPageLeak"] == "critical"


def test_every_alert_is_unit_tested_firing_and_silent():
    """promtool compares the complete list of firing alerts at each eval time, so an eval with alerts proves the
    bad series fire (labels and annotations exact) and the healthy series of that test, which fire nothing; an
    eval with ``exp_alerts: []`` proves silence (before ``for`` has elapsed, or after the bad input is over)."""
    fired, silent = set(), set()
    for path in RULE_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test["alert_rule_test"]:
                (fired if case["exp_alerts"] else silent).add(case["alertname"])
                for a in case["exp_alerts"]:
                    assert a["exp_labels"]["severity"] and set(a["exp_annotations"]) == {"summary", "description"}
    assert fired == silent == set(ALERTS)


def test_grafana_provisioning():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "kvalloc.yml").read_text())
    [src] = ds["datasources"]
    assert (src["type"], src["url"], src["isDefault"]) == ("prometheus", "http://localhost:9090", True)
    # The exemplar label the exporter writes (exporters/prometheus/catalog.py: {"trace_id": ...}) becomes a trace link.
    [dest] = src["jsonData"]["exemplarTraceIdDestinations"]
    assert dest["name"] == "trace_id" and dest["url"].endswith("$${__value.raw}")
    assert src["jsonData"]["timeInterval"] == "5s"  # == prometheus.yml's scrape_interval
    assert yaml.safe_load((GRAFANA / "prometheus.yml").read_text())["global"]["scrape_interval"] == "5s"
    dash = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kvalloc.yml").read_text())
    [prov] = dash["providers"]
    assert prov["type"] == "file" and prov["options"]["path"] == "/var/lib/grafana/dashboards/kvalloc"


def test_every_alert_is_unit_tested_on_sglang_labels():
    """Inside SGLang the series carry SGLang's scheduler labels and no engine label: every alert has a unit test
    where it fires on such a series, next to a healthy rank of the same model behind the same instance, keeps all
    its labels (moe_ep_rank included) and names the model, the engine type and the ranks."""
    fired = set()
    for path in RULE_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            series = [s["series"] for s in test["input_series"]]
            for case in test["alert_rule_test"]:
                for a in case["exp_alerts"]:
                    labels = a["exp_labels"]
                    if not set(SGLANG_LABELS) <= set(labels):
                        continue
                    assert "engine" not in labels, labels
                    process = (
                        f"{labels['instance']} model_name {labels['model_name']} engine_type {labels['engine_type']} "
                        f"tp_rank {labels['tp_rank']} pp_rank {labels['pp_rank']}"
                        + (f" dp_rank {labels['dp_rank']}" if "dp_rank" in labels else "")
                    )
                    assert process in a["exp_annotations"]["summary"], a
                    assert process in a["exp_annotations"]["description"], a
                    # Another rank of the same model behind the same instance, which does not fire.
                    same_server = [
                        s for s in series
                        if f'instance="{labels["instance"]}"' in s and f'model_name="{labels["model_name"]}"' in s
                    ]  # fmt: skip
                    ranks = {re.search(r'tp_rank="(\d+)",pp_rank="(\d+)"', s).groups() for s in same_server}
                    assert len(ranks) == 2 and (labels["tp_rank"], labels["pp_rank"]) in ranks, (case, ranks)
                    fired.add(case["alertname"])
    assert fired == set(ALERTS)
