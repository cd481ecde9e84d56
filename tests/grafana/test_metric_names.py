"""Every metric name the dashboard and the alert rules read exists in the exporter's real output: a
PrometheusExporter that has seen traffic (the exporter tests' scripted scenario: allocations, an SWA eviction, a
double free, a leak, a refused allocation, releases) is served and scraped over HTTP, and the exposition's sample
names (with the ``_total``, ``_bucket``/``_sum``/``_count`` suffixes) are compared with the names in the queries."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from exporters.prometheus import PrometheusExporter
from grafana import generate
from tests.exporters.test_prometheus import make_alloc, scenario
from tests.grafana.dashboard_model import load_dashboard, load_rules, metric_names, targets


def scraped_sample_names() -> set[str]:
    w = make_alloc()
    with PrometheusExporter(w, const_labels={"engine": "e0"}, multiprocess=False) as exp:
        scenario(w)
        port = exp.serve()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_dashboard_and_rules_read_only_exported_metrics():
    exported = scraped_sample_names()
    d = load_dashboard()
    dash_names = set().union(*(metric_names(t["expr"]) for _, t in targets(d)))
    var_names = set().union(*(metric_names(v.get("query") or "") for v in d["templating"]["list"]))
    rule_names = set().union(*(metric_names(r["expr"]) for r in load_rules()))
    assert dash_names - exported == set()
    assert var_names - exported == set()
    assert rule_names - exported == set()
    # The names really are what the queries use (not an empty comparison).
    assert var_names == {"kvalloc_page_size_tokens"}
    assert rule_names == {
        "kvalloc_invariant_violations_total",
        "kvalloc_pages",
        "kvalloc_requests_live",
        "kvalloc_external_fragmentation_ratio",
        "kvalloc_swa_outside_window_tokens",
        "kvalloc_swa_evicted_tokens_total",
        "kvalloc_alloc_failures_total",
        "kvalloc_events_dropped_total",
    }


def test_dashboard_shows_every_exported_family():
    """The other direction: no metric of the catalog is missing from the dashboard (histograms through their
    buckets, counters through _total)."""
    exported = scraped_sample_names()
    d = load_dashboard()
    used = set().union(*(metric_names(t["expr"]) for _, t in targets(d)))
    families = {n for n in exported if not n.endswith(("_created", "_sum", "_count"))}
    histograms = {n.removesuffix("_bucket") for n in families if n.endswith("_bucket")}
    families = {n for n in families if not n.endswith("_bucket")} | {h + "_bucket" for h in histograms}
    assert families - used == set()
    assert len(families) == 18  # the catalog in docs/metrics.md: 18 metrics


_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
# Labels Prometheus adds to every scraped series (job, instance) and the engine const label the dashboard filters
# on (from the exporter's const_labels, or from grafana/prometheus.yml's target label).
_TARGET_LABELS = {"job", "instance", "engine"}
# The const label sets scraped_labels() serves: the demo's engine with the rank const labels (the dashboard's rank
# variables), as a rank of a multiprocess deployment carries them; and SGLang's scheduler labels, as the plugin sets
# them inside SGLang (no engine label).
_CONST_LABEL_SETS = [
    {"engine": "e0", **dict.fromkeys(generate.RANK_LABELS, "0")},
    {"model_name": "m", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0", "dp_rank": "0"},
]


def scraped_labels() -> dict[str, set[str]]:
    """Sample name -> every label some exporter's sample of that name carries, over the const label sets."""
    out: dict[str, set[str]] = {}
    for const_labels in _CONST_LABEL_SETS:
        w = make_alloc()
        with PrometheusExporter(w, const_labels=const_labels, multiprocess=False) as exp:
            scenario(w)
            port = exp.serve()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out.setdefault(s.name, set()).update(s.labels)
    return out


def test_labels_grouped_filtered_and_shown_exist_on_the_metrics():
    """A misspelt label in ``by (...)`` or a matcher still returns data (one group, or nothing filtered), so the
    integration test could not see it: every label a query groups by or matches on exists on a metric that
    query reads, and every ``{{label}}`` of a legend is one the query groups by."""
    labels = scraped_labels()
    exprs = [(p["title"], t["expr"], t.get("legendFormat", "")) for p, t in targets(load_dashboard())]
    exprs += [(r["alert"], r["expr"], "") for r in load_rules()]
    problems = []
    for title, expr, legend in exprs:
        available = set(_TARGET_LABELS).union(*(labels[m] for m in metric_names(expr)))
        grouped = {x.strip() for g in _GROUPING.findall(expr) for x in g.split(",") if x.strip()}
        matched = set(_MATCHER.findall(expr))
        problems += [
            f"{title}: label {x!r} is on none of {sorted(metric_names(expr))}"
            for x in grouped | matched
            if x not in available
        ]
        problems += [
            f"{title}: legend {{{{{x}}}}} is not grouped by" for x in _LEGEND.findall(legend) if x not in grouped
        ]
    assert problems == []
