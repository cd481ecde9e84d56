"""The committed dashboard JSON: exactly what grafana/generate.py produces, a fixpoint of the SDK's dashboard
model, and the structure the issue asks for (variables, rows, descriptions, variable filters, exemplars)."""

from __future__ import annotations

import json
import re

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import bargauge, heatmap, stat, timeseries
from grafana_foundation_sdk.models import prometheus as prom_model
from grafana_foundation_sdk.models.dashboard import Dashboard, RowPanel

from grafana import generate
from tests.grafana.dashboard_model import (
    DASHBOARD,
    PER_RANK,
    PER_RANK_SELF_COST,
    load_dashboard,
    panels,
    targets,
)

ROWS = ["Occupancy", "Fragmentation", "Sliding window (SWA)", "Health", "Latency", "Self-cost", "Request footprint"]
FILTER = (
    'engine=~"$engine", model_name=~"$model_name", engine_type=~"$engine_type", instance=~"$instance", '
    'tp_rank=~"$tp_rank", pp_rank=~"$pp_rank", dp_rank=~"$dp_rank"'
)
# The labels that identify one scheduler process: the demo's engine, SGLang's model_name and engine_type, the
# endpoint, the ranks (not moe_ep_rank: SGLang derives it from tp_rank).
PROCESS = ["engine", "model_name", "engine_type", "instance", "tp_rank", "pp_rank", "dp_rank"]


def test_committed_json_is_what_the_generator_writes(tmp_path, capsys):
    assert DASHBOARD.read_text() == generate.render()
    assert generate.main(["--check"]) == 0
    # --check catches a hand edit (and says how to fix it) without touching the file.
    stale = tmp_path / "kvalloc.json"
    stale.write_text(DASHBOARD.read_text().replace('"Fragmentation"', '"Fragmentation (edited)"'))
    assert generate.main(["--check", "--out", str(stale)]) == 1
    out, err = capsys.readouterr()
    assert '-      "title": "Fragmentation (edited)",' in out and '+      "title": "Fragmentation",' in out
    assert "make grafana" in err
    assert "(edited)" in stale.read_text()
    # Writing mode rewrites it.
    assert generate.main(["--out", str(stale)]) == 0
    assert stale.read_text() == DASHBOARD.read_text()


def test_json_round_trips_through_the_sdk_model():
    register_default_plugins()  # panel options and Prometheus queries decode into their typed models
    raw = load_dashboard()
    model = Dashboard.from_json(raw)
    assert json.loads(json.dumps(model, cls=JSONEncoder)) == raw
    # Decoded into the typed models, not passed through as dicts.
    by_type = {
        "timeseries": timeseries.Options,
        "stat": stat.Options,
        "heatmap": heatmap.Options,
        "bargauge": bargauge.Options,
    }
    for p in model.panels:
        if isinstance(p, RowPanel):
            continue
        assert isinstance(p.options, by_type[p.type_val]), p.title
        assert all(isinstance(t, prom_model.Dataquery) for t in p.targets), p.title


def test_variables_rows_and_panels():
    d = load_dashboard()
    assert d["uid"] == generate.UID
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert list(variables) == ["datasource", *PROCESS]
    assert tuple(PROCESS) == generate.VARIABLES
    assert generate.RANK_LABELS == ("tp_rank", "pp_rank", "dp_rank")  # SGLang's scheduler rank labels
    # moe_ep_rank (derived from tp_rank in SGLang) is neither a variable, nor filtered on, nor grouped by.
    assert "moe_ep_rank" not in json.dumps(d)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in PROCESS:
        v = variables[name]
        # All is the regex .*, which also matches series without the label (a process without rank labels).
        assert v["type"] == "query" and v["includeAll"] and v["multi"] and v["allValue"] == ".*"
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert variables["engine"]["query"] == "label_values(kvalloc_page_size_tokens, engine)"
    # Every variable is chained on the ones before it; the ranks sort as numbers (2 before 10), the names
    # alphabetically.
    assert variables["model_name"]["query"] == 'label_values(kvalloc_page_size_tokens{engine=~"$engine"}, model_name)'
    assert variables["engine_type"]["query"] == (
        'label_values(kvalloc_page_size_tokens{engine=~"$engine", model_name=~"$model_name"}, engine_type)'
    )
    assert variables["instance"]["query"] == (
        'label_values(kvalloc_page_size_tokens{engine=~"$engine", model_name=~"$model_name", '
        'engine_type=~"$engine_type"}, instance)'
    )
    assert variables["tp_rank"]["query"] == (
        'label_values(kvalloc_page_size_tokens{engine=~"$engine", model_name=~"$model_name", '
        'engine_type=~"$engine_type", instance=~"$instance"}, tp_rank)'
    )
    assert variables["pp_rank"]["query"] == (
        'label_values(kvalloc_page_size_tokens{engine=~"$engine", model_name=~"$model_name", '
        'engine_type=~"$engine_type", instance=~"$instance", tp_rank=~"$tp_rank"}, pp_rank)'
    )
    assert variables["dp_rank"]["query"] == (
        'label_values(kvalloc_page_size_tokens{engine=~"$engine", model_name=~"$model_name", '
        'engine_type=~"$engine_type", instance=~"$instance", tp_rank=~"$tp_rank", pp_rank=~"$pp_rank"}, dp_rank)'
    )
    assert {name: variables[name]["sort"] for name in PROCESS} == {
        "engine": 1,  # alphabetical, ascending
        "model_name": 1,
        "engine_type": 1,
        "instance": 1,
        "tp_rank": 3,  # numerical, ascending
        "pp_rank": 3,
        "dp_rank": 3,
    }

    assert [p["title"] for p in d["panels"] if p["type"] == "row"] == ROWS
    ids = [p["id"] for p in d["panels"]]
    assert ids == list(range(1, len(ids) + 1))
    for p in panels(d):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        # Every panel says what a bad value means.
        assert "Bad:" in p["description"] or "Anything above zero" in p["description"], p["title"]
        assert p["targets"], p["title"]
    for p, t in targets(d):
        assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        # Every selector of every query, not just one of them (a ratio's denominator included).
        selectors = t["expr"].count("{")
        assert selectors and t["expr"].count(FILTER) == selectors, (p["title"], t["expr"])
        assert len({x["refId"] for x in p["targets"]}) == len(p["targets"])


def test_health_row_has_exemplars_and_the_latency_heatmap_reads_buckets():
    d = load_dashboard()
    by_title = {p["title"]: p for p in panels(d)}
    violations = by_title["Invariant violations by invariant"]["targets"]
    assert [(t["exemplar"], t["legendFormat"]) for t in violations] == [(True, "{{invariant}}")]
    assert "kvalloc_invariant_violations_total" in violations[0]["expr"]
    heat = by_title["Allocator op duration"]
    assert heat["type"] == "heatmap" and heat["options"]["calculate"] is False
    assert [(t["format"], "kvalloc_op_duration_seconds_bucket" in t["expr"]) for t in heat["targets"]] == [
        ("heatmap", True)
    ]
    footprint = by_title["Pages per request"]
    assert [t["format"] for t in footprint["targets"]] == ["heatmap"]
    assert "kvalloc_request_pages_bucket" in footprint["targets"][0]["expr"]


def test_per_rank_panels_split_by_rank_and_name_it():
    """In multiprocess mode every rank sits behind one instance: a panel that summed over ranks would show a full
    rank next to an empty one as half full. The per-rank panels group every aggregation by the process's labels
    (engine, model_name, engine_type, instance, tp_rank, pp_rank, dp_rank) and their legends name the rank in
    SGLang's terms; the others do not split by rank."""
    d = load_dashboard()
    by_title = {p["title"]: p for p in panels(d)}
    per_rank = PER_RANK + PER_RANK_SELF_COST
    assert set(per_rank) <= set(by_title)
    # The deployment (the demo's engine; SGLang's model and engine type), the ranks in SGLang's terms, the endpoint.
    assert generate.RANK_LEGEND == (
        "{{engine}} {{model_name}} {{engine_type}} tp={{tp_rank}} pp={{pp_rank}} dp={{dp_rank}} ({{instance}})"
    )
    for title, p in by_title.items():
        for t in p["targets"]:
            aggregations = re.findall(r"\b(sum|max|min|avg|count)\s*(?:by\s*\(([^)]*)\))?\s*\(", t["expr"])
            assert aggregations, (title, t["expr"])
            if title in per_rank:
                for op, by in aggregations:
                    labels = {x.strip() for x in by.split(",")}
                    assert set(PROCESS) <= labels, (title, op, t["expr"])
                    assert "moe_ep_rank" not in labels, (title, op, t["expr"])
                # The legend ends with the process: its deployment, ranks and endpoint.
                assert t["legendFormat"].endswith(generate.RANK_LEGEND), (title, t["legendFormat"])
                assert "rank" in p["description"], title
            else:
                assert all(r not in by for _, by in aggregations for r in generate.RANK_LABELS), title
    # The used share keeps its thresholds, now judged per rank.
    used = by_title["Used pages, per pool"]
    assert [s["value"] for s in used["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [None, 0.85, 0.95]


def test_self_cost_row():
    """The self-cost panels, after the latency row: host seconds per iteration by part (each part of a rank over
    that rank's iterations), iterations per second, the per-iteration quantiles; seconds shown as such (Grafana
    renders 1e-4 s as 100 µs), every description with the decode step to compare with."""
    d = load_dashboard()
    assert tuple(PER_RANK_SELF_COST) == generate.SELF_COST
    titles = [p["title"] for p in d["panels"]]
    i = titles.index("Self-cost")
    assert titles[i - 1] == "Op duration p50 / p99" and titles[i + 1 : i + 4] == PER_RANK_SELF_COST
    by_title = {p["title"]: p for p in panels(d)}
    by_part, iterations, quantiles = (by_title[t] for t in PER_RANK_SELF_COST)
    process = ", ".join(PROCESS)
    count = f"rate(kvalloc_overhead_iteration_seconds_count{{{FILTER}}}[$__rate_interval])"
    assert [t["expr"] for t in by_part["targets"]] == [
        f"sum by (part, {process}) (rate(kvalloc_overhead_seconds_total{{{FILTER}}}[$__rate_interval])) "
        f"/ ignoring(part) group_left() (sum by ({process}) ({count}) > 0)"
    ]
    assert [t["legendFormat"] for t in by_part["targets"]] == ["{{part}}, " + generate.RANK_LEGEND]
    assert by_part["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert [t["expr"] for t in iterations["targets"]] == [f"sum by ({process}) ({count})"]
    assert [(t["refId"], t["legendFormat"].split(",")[0]) for t in quantiles["targets"]] == [("A", "p50"), ("B", "p99")]
    assert all("kvalloc_overhead_iteration_seconds_bucket" in t["expr"] for t in quantiles["targets"])
    assert [by_title[t]["fieldConfig"]["defaults"]["unit"] for t in PER_RANK_SELF_COST] == ["s", "ops", "s"]
    for title in (PER_RANK_SELF_COST[0], PER_RANK_SELF_COST[2]):
        assert "about 10 ms, so 1% of it is 100 µs" in by_title[title]["description"], title
