"""Generates the Grafana dashboard (``grafana/dashboards/kvalloc.json``) from code, with grafana-foundation-sdk.

Contract
- ``python -m grafana.generate`` (``make grafana``) rewrites the committed JSON; ``--check`` writes nothing and
  exits 1 with a unified diff when the committed file differs from what this code generates (a test runs it).
- ``build()`` returns the SDK's ``Dashboard`` model; ``render()`` its JSON text, byte for byte what is committed
  (deterministic: no timestamps, explicit panel ids).
- Targets Grafana 11.6 (the SDK is pinned to its 11.6 epoch in pyproject.toml). Every query reads only metrics of
  the catalog (docs/metrics.md) and filters on every template variable (``VARIABLES``: ``engine``, ``model_name``,
  ``engine_type``, ``instance``, ``tp_rank``, ``pp_rank``, ``dp_rank``; each variable's own query is filtered by
  the ones before it); ``datasource`` selects the Prometheus data source. Every variable defaults to All, the
  regex ``.*``, which also matches series without that label. Every panel has a description that says what a bad
  value means.
- Labels: the demo labels its series ``engine="demo"`` (a single-process user passes any const labels, e.g.
  ``engine`` and rank labels); inside SGLang (the plugin, ``exporters.sglang.rank_labels``)
  the const labels are SGLang's scheduler labels, as its ``SchedulerMetricsCollector`` sets them: ``model_name``,
  ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, ``dp_rank`` only when set, plus
  ``--extra-metric-labels``, and no ``engine``. The dashboard serves both. ``moe_ep_rank`` has no variable and is
  not grouped by: SGLang derives it from ``tp_rank`` (see ``RANK_LABELS``).
- Ranks: the rank variables are the rank const labels (``RANK_LABELS``), which tell apart the scheduler processes
  (ranks) behind one /metrics endpoint in multiprocess mode (all ranks of one SGLang server share one
  ``instance``). Panels whose meaning is one allocator's state (occupancy, used share, live requests,
  fragmentation, free runs, SWA window, anything with a threshold or an alert behind it) have one series per rank
  (grouped by ``RANK``, every label that identifies a process: the variables' labels; legend ``RANK_LEGEND``,
  which names the deployment, ``tp=``, ``pp=``, ``dp=`` and the instance), never a sum over ranks: a full rank
  next to an empty one must not read as half full. So are the self-cost panels (``SELF_COST``: the host time the
  instrumentation adds per scheduler iteration, iterations per second, its per-iteration quantiles): each rank is a
  scheduler with iterations of its own, and what an iteration of one rank pays is that rank's cost divided by that
  rank's iterations (the ratio's two sides are matched rank by rank); a sum over ranks would average a slow rank
  away, where in TP the slowest rank sets the step. Other rates of events, histograms, the violation count and the
  page size stay aggregates over the selected ranks.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, common, heatmap, stat, timeseries
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

HERE = Path(__file__).resolve().parent
DASHBOARD_PATH = HERE / "dashboards" / "kvalloc.json"
UID = "kvalloc-allocator"
GRAFANA_VERSION = "11.6"

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
# The labels that name a deployment (the endpoint, ``instance``, comes next): the exporter's ``engine`` const label
# (the demo's ``engine="demo"``, a single-process user's own), and SGLang's scheduler labels ``model_name`` and
# ``engine_type`` (unified, prefill, decode, dynamic), which its plugin exports instead of an ``engine`` label.
DEPLOYMENT_LABELS = ("engine", "model_name", "engine_type")
# The rank const labels, as SGLang's SchedulerMetricsCollector sets them (``dp_rank`` only when DP is on) and as
# the exporter documents them for other engines: in multiprocess mode every rank of a server sits behind one
# instance and only these labels tell the ranks apart.
# Not ``moe_ep_rank``: SGLang sets it on every scheduler but derives it from ``tp_rank`` (``tp_rank % (tp_size /
# moe_dp_size) // (tp_size / moe_dp_size / moe_ep_size)``), so each tp_rank of a server has one moe_ep_rank. It
# never tells apart two processes that tp_rank, pp_rank and dp_rank do not: grouping by it would split no series,
# and a variable for it would select a set of tp_ranks, which the tp_rank variable selects as well. Queries leave
# it unfiltered (any value, or none) and per-rank panels aggregate it away; the alerts keep it on their labels.
# The same holds for SGLang's ``--extra-metric-labels`` (one server's flag: the same on all its ranks).
RANK_LABELS = ("tp_rank", "pp_rank", "dp_rank")
# The template variables after the data source, in the dashboard's order; each is filtered by the ones before it.
VARIABLES = (*DEPLOYMENT_LABELS, "instance", *RANK_LABELS)
# Every query's label filter: all of them. All default to All (regex .*), which also matches series that carry no
# such label (the demo has no SGLang label; SGLang has no engine label; a process without rank labels).
SEL = ", ".join(f'{v}=~"${v}"' for v in VARIABLES)
# One rank is one scheduler process, i.e. one allocator: the labels that identify it. Per-rank panels group by all
# of them (summing two engines', two models' or two instances' tp_rank 0 would be the same mistake as summing two
# ranks; two pipeline stages of one server differ only by pp_rank).
RANK = ", ".join(VARIABLES)
# The legend of a per-rank series: the deployment (the engine for the demo, model and engine type for SGLang), the
# ranks in SGLang's terms, the endpoint. A label the series lacks renders empty: "demo   tp= pp= dp= (host:port)"
# for the demo, " Qwen/Qwen3-8B unified tp=1 pp=0 dp= (host:port)" for SGLang without DP. The deployment labels
# are separate words, not run together, so that a series carrying both engine and model_name stays readable.
RANK_LEGEND = "{{engine}} {{model_name}} {{engine_type}} tp={{tp_rank}} pp={{pp_rank}} dp={{dp_rank}} ({{instance}})"


# The self-cost panels' titles (per rank, see the contract).
SELF_COST = (
    "Host time added per iteration, by part",
    "Scheduler iterations per second",
    "Host time added per iteration p50 / p99",
)
# A decode step to compare the self-cost with, for the descriptions: a GPU decode step of a small model at a high
# batch takes about 10 ms; 1% of it is 100 µs.
STEP_SCALE = (
    "For scale: a GPU decode step of a small model at a high batch takes about 10 ms, so 1% of it is 100 µs "
    "(the unit shows µs)."
)


def sel(extra: str = "") -> str:
    return "{" + SEL + (", " + extra if extra else "") + "}"


USED = sel('state="used"')


def q(expr: str, legend: str = "", ref: str = "A", *, instant: bool = False, heatmap_fmt: bool = False, exemplar=False):
    t = prom.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    if legend:
        t = t.legend_format(legend)
    t = t.instant() if instant else t.range()
    if heatmap_fmt:
        t = t.format(PromQueryFormat.HEATMAP)
    if exemplar:
        t = t.exemplar(True)
    return t


def ts(title: str, description: str, targets, *, unit: str = "short", w: int = 8, h: int = 8, stack=False, **kw):
    p = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .targets(targets)
        .unit(unit)
        .span(w)
        .height(h)
        .legend(
            common.VizLegendOptions()
            .show_legend(True)
            .display_mode(cm.LegendDisplayMode.LIST)
            .placement(cm.LegendPlacement.BOTTOM)
        )
        .tooltip(common.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
    )
    # Always some custom field config: the SDK's model reads an absent "custom" back as {} (round trip).
    p = p.line_width(1).fill_opacity(10)
    if stack:
        p = p.stacking(common.StackingConfig().mode(cm.StackingMode.NORMAL)).fill_opacity(60)
    if "min" in kw:
        p = p.min(kw["min"])
    if "max" in kw:
        p = p.max(kw["max"])
    return p


def thresholds(*steps: tuple[float | None, str]):
    return (
        dash.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=v, color=c) for v, c in steps])
    )


def stat_panel(title: str, description: str, targets, *, unit="short", w=4, h=8, steps=((None, "green"),)):
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .targets(targets)
        .unit(unit)
        .span(w)
        .height(h)
        .thresholds(thresholds(*steps))
        .color_mode(cm.BigValueColorMode.BACKGROUND)
        .graph_mode(cm.BigValueGraphMode.AREA)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


def rate(metric: str, extra: str = "", by: str = "") -> str:
    inner = f"rate({metric}{sel(extra)}[$__rate_interval])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def chain(name: str) -> str:
    """The label filter of a variable's own query: the variables before it (empty for the first)."""
    return ", ".join(f'{v}=~"${v}"' for v in VARIABLES[: VARIABLES.index(name)])


def label_variable(name: str, label: str, description: str, *, numeric: bool = False):
    """A template variable: the values of the label ``name`` among the series the variables before it select; All
    (regex .*) also matches series without the label."""
    c = chain(name)
    metric = f"kvalloc_page_size_tokens{{{c}}}" if c else "kvalloc_page_size_tokens"
    return (
        dash.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(DS)
        .query(f"label_values({metric}, {name})")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.NUMERICAL_ASC if numeric else dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def rank_variable(name: str, label: str, what: str):
    """A rank template variable: the const label ``name``, ranks sorted as numbers (2 before 10)."""
    return label_variable(
        name,
        label,
        f"The {name} const label of the exporter ({what}; all by default). Ranks that share one /metrics "
        "endpoint (multiprocess mode) differ only by their rank labels.",
        numeric=True,
    )


def build() -> dm.Dashboard:
    b = (
        dash.Dashboard("KV-cache allocator (instrumented-alloc)")
        .uid(UID)
        .description(
            "Page occupancy, fragmentation, sliding-window eviction, invariant violations and op latency of "
            "KV-cache page allocators wrapped by instrumented-alloc (metric prefix kvalloc_)."
        )
        .tags(["kvalloc", "kv-cache", "llm-serving"])
        .editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .time("now-30m", "now")
        .refresh("10s")
        .timezone("browser")
        .with_variable(dash.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            label_variable("engine", "Engine", "The engine const label of the exporter (all engines by default)")
        )
        .with_variable(
            label_variable(
                "model_name",
                "Model",
                "SGLang's model_name label: the served model name (all models by default). Series without it "
                "(the demo, other engines) match All only.",
            )
        )
        .with_variable(
            label_variable(
                "engine_type",
                "Engine type",
                "SGLang's engine_type label: unified, prefill or decode (PD disaggregation), dynamic (PD role "
                "switch); all by default. Series without it (the demo, other engines) match All only.",
            )
        )
        .with_variable(
            label_variable(
                "instance",
                "Instance",
                "The scraped /metrics endpoint (one per process or per multiprocess directory)",
            )
        )
        .with_variable(rank_variable("tp_rank", "TP rank", "tensor-parallel rank"))
        .with_variable(rank_variable("pp_rank", "PP rank", "pipeline-parallel rank"))
        .with_variable(rank_variable("dp_rank", "DP rank", "data-parallel rank"))
    )

    # -- occupancy ------------------------------------------------------------------------------------------
    b = b.with_row(dash.Row("Occupancy"))
    b = b.with_panel(
        ts(
            "Pages by state, per pool",
            "Pages of each pool by state (free, used, staged, reserved), one series per rank: the states of one "
            "rank's pool add up to its capacity (with several ranks selected the stack is their total; select one "
            "rank to see its own). Bad: a rank's free pages near zero for long (requests get retracted or "
            "refused), or used pages that stay up while that rank's live requests drop to zero (a leak; see the "
            "leak alert).",
            [q(f"sum by ({RANK}, pool, state) (kvalloc_pages{sel()})", "{{pool}} {{state}}, " + RANK_LEGEND)],
            w=10,
            stack=True,
        )
    )
    b = b.with_panel(
        stat_panel(
            "Used pages, per pool",
            "Used pages / capacity of each pool of each rank, now (never averaged over ranks: one full rank "
            "next to an empty one is 100% and 0%, not 50%). Bad: close to 100% (that rank's next prefill waits or "
            "is retracted).",
            [
                q(
                    f"sum by ({RANK}, pool) (kvalloc_pages{USED}) / sum by ({RANK}, pool) (kvalloc_pages{sel()})",
                    "{{pool}}, " + RANK_LEGEND,
                )
            ],
            unit="percentunit",
            w=5,
            steps=((None, "green"), (0.85, "orange"), (0.95, "red")),
        )
    )
    b = b.with_panel(
        ts(
            "Live requests",
            "Requests that hold KV, per rank. Bad: zero on a rank while its pages stay used (a leak), or a climb "
            "with no matching drop (requests never released).",
            [q(f"sum by ({RANK}) (kvalloc_requests_live{sel()})", RANK_LEGEND)],
            w=5,
            min=0,
        )
    )
    b = b.with_panel(
        stat_panel(
            "Page size",
            "Tokens per KV page (a configuration constant). Bad: a value other than the engine's configured page "
            "size, or different values across the engines you selected.",
            [q(f"max(kvalloc_page_size_tokens{sel()})", "tokens per page", instant=True)],
            w=4,
        )
    )
    b = b.with_panel(
        ts(
            "Page churn",
            "Pages handed out and released per second, per pool, summed over the selected ranks (select one rank "
            "to see its own). Bad: allocated persistently above freed while traffic is flat (pages are not coming "
            "back).",
            [
                q(rate("kvalloc_pages_allocated_total", by="pool"), "{{pool}} allocated"),
                q(rate("kvalloc_pages_freed_total", by="pool"), "{{pool}} freed", "B"),
            ],
            unit="ops",
            w=24,
        )
    )

    # -- fragmentation --------------------------------------------------------------------------------------
    b = b.with_row(dash.Row("Fragmentation"))
    b = b.with_panel(
        ts(
            "Internal fragmentation",
            "1 - committed tokens / allocated slots of live requests, per pool and rank: slots paid for but not "
            "holding a token yet (partly filled last pages, prealloc). Bad: high and rising (over-reservation; a "
            "larger page size or prealloc than the traffic needs).",
            [q(f"max by ({RANK}, pool) (kvalloc_internal_fragmentation_ratio{sel()})", "{{pool}}, " + RANK_LEGEND)],
            unit="percentunit",
            w=6,
            min=0,
            max=1,
        )
    )
    b = b.with_panel(
        ts(
            "External fragmentation",
            "1 - largest free run / free pages, per pool and rank (0 when nothing is free). Bad: above 0.5 for "
            "long (the free pages are scattered: contiguous allocations or kernels that prefer runs suffer; the "
            "fragmentation alert fires for that rank after 15 minutes).",
            [q(f"max by ({RANK}, pool) (kvalloc_external_fragmentation_ratio{sel()})", "{{pool}}, " + RANK_LEGEND)],
            unit="percentunit",
            w=6,
            min=0,
            max=1,
        )
    )
    b = b.with_panel(
        ts(
            "Free runs",
            "Maximal runs of consecutive free pages, per pool and rank. Bad: many runs while the largest run is "
            "short (free space chopped into small pieces).",
            [q(f"sum by ({RANK}, pool) (kvalloc_free_runs{sel()})", "{{pool}}, " + RANK_LEGEND)],
            w=6,
            min=0,
        )
    )
    b = b.with_panel(
        ts(
            "Largest free run",
            "The longest run of consecutive free pages, per pool and rank. Bad: far below that rank's free page "
            "count (see external fragmentation), or below the pages one prefill chunk needs.",
            [q(f"max by ({RANK}, pool) (kvalloc_largest_free_run_pages{sel()})", "{{pool}}, " + RANK_LEGEND)],
            w=6,
            min=0,
        )
    )

    # -- SWA ------------------------------------------------------------------------------------------------
    b = b.with_row(dash.Row("Sliding window (SWA)"))
    b = b.with_panel(
        ts(
            "SWA evicted tokens",
            "Tokens evicted from the SWA pool per second (they left the sliding window), per rank. Bad: zero on a "
            "rank while its tokens outside the window grow (eviction stalled: the SWA pool fills with KV no layer "
            "reads). Always zero for dense models.",
            [q(f"sum by ({RANK}) (rate(kvalloc_swa_evicted_tokens_total{sel()}[$__rate_interval]))", RANK_LEGEND)],
            unit="short",
            w=12,
            min=0,
        )
    )
    b = b.with_panel(
        ts(
            "Tokens outside the window",
            "Tokens that still hold SWA KV though they are outside the sliding window (evictable), per rank. Bad: "
            "growing without evictions on that rank (the SWA outside-window alert), or large compared with the SWA "
            "pool. Always zero for dense models.",
            [q(f"sum by ({RANK}) (kvalloc_swa_outside_window_tokens{sel()})", RANK_LEGEND)],
            w=12,
            min=0,
        )
    )

    # -- health ---------------------------------------------------------------------------------------------
    b = b.with_row(dash.Row("Health"))
    b = b.with_panel(
        ts(
            "Invariant violations by invariant",
            "Violations per second by invariant id (the invariant catalog), summed over the selected ranks (the "
            "alert names the rank; select it to see its own). Anything above zero is a bug in the engine's use of "
            "the allocator (double free, misaligned length, leak, ...). The points are exemplars: "
            "each carries the trace id of the request that broke the invariant and links to its trace.",
            [
                q(
                    f"sum by (invariant) (rate(kvalloc_invariant_violations_total{sel()}[$__rate_interval]))",
                    "{{invariant}}",
                    exemplar=True,
                )
            ],
            unit="ops",
            w=12,
            min=0,
        )
    )
    b = b.with_panel(
        stat_panel(
            "Violations since start",
            "Invariant violations counted by the selected processes since each started, all invariants (the "
            "counter itself: unlike a rate, it also shows violations made before the first scrape). Bad: anything "
            "but 0.",
            [q(f"sum(kvalloc_invariant_violations_total{sel()})", "violations", instant=True)],
            w=4,
            steps=((None, "green"), (1, "red")),
        )
    )
    b = b.with_panel(
        ts(
            "Allocation failures",
            "Allocations refused for lack of pages, per second, by pool and op, summed over the selected ranks. "
            "Bad: sustained (a rank is out of KV memory and retracting or queueing requests; the alloc failure "
            "alert fires for that rank after 10 minutes).",
            [q(rate("kvalloc_alloc_failures_total", by="pool, op"), "{{pool}} {{op}}")],
            unit="ops",
            w=4,
            min=0,
        )
    )
    b = b.with_panel(
        ts(
            "Dropped events",
            "Events an exporter sink (prometheus, otel, recorder) refused or failed on, per second. Bad: anything "
            "above 0 (that sink's metrics, traces or recording are incomplete).",
            [q(rate("kvalloc_events_dropped_total", by="sink"), "{{sink}}")],
            unit="ops",
            w=4,
            min=0,
        )
    )

    # -- latency --------------------------------------------------------------------------------------------
    b = b.with_row(dash.Row("Latency"))
    b = b.with_panel(
        heatmap.Panel()
        .title("Allocator op duration")
        .description(
            "Wall time of the inner allocator calls (all ops), as a heatmap of the histogram buckets. Bad: mass in "
            "the millisecond buckets (a free that sorts a large list, a device sync in the hot path, GC pauses)."
        )
        .datasource(DS)
        .targets(
            [
                q(
                    f"sum by (le) (increase(kvalloc_op_duration_seconds_bucket{sel()}[$__rate_interval]))",
                    "{{le}}",
                    heatmap_fmt=True,
                )
            ]
        )
        .calculate(False)
        .y_axis(heatmap.YAxisConfig().unit("s"))
        .rows_frame(heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.LE))
        .color(
            heatmap.HeatmapColorOptions()
            .mode("scheme")
            .scheme("Oranges")
            .exponent(0.5)
            .fill("dark-orange")
            .scale("exponential")
            .steps(64)
        )
        .cell_values(heatmap.CellValues().unit("short"))
        .span(12)
        .height(9)
    )
    b = b.with_panel(
        ts(
            "Op duration p50 / p99",
            "Median and 99th percentile wall time of each allocator op. Bad: a p99 far above the p50 (stalls) or "
            "above about a millisecond for decode allocations (the allocator is on the decode step's critical "
            "path).",
            [
                q(
                    "histogram_quantile(0.5, sum by (le, op) "
                    f"(rate(kvalloc_op_duration_seconds_bucket{sel()}[$__rate_interval])))",
                    "{{op}} p50",
                ),
                q(
                    "histogram_quantile(0.99, sum by (le, op) "
                    f"(rate(kvalloc_op_duration_seconds_bucket{sel()}[$__rate_interval])))",
                    "{{op}} p99",
                    "B",
                ),
            ],
            unit="s",
            w=12,
            h=9,
        )
    )

    # -- self-cost ------------------------------------------------------------------------------------------
    # What the instrumentation itself costs each rank's engine thread, per scheduler iteration: its host seconds by
    # part over the same rank's iterations (the histogram's _count counts them). ignoring(part) group_left(): every
    # part of a rank divided by that rank's iterations (one rank's denominator for its four parts; the empty label
    # list keeps the parenthesised right side from being read as group_left's labels); "> 0" drops a rank that did
    # not iterate in the window (an idle engine: no iteration to charge the time to, rather than +Inf).
    iterations = f"sum by ({RANK}) (rate(kvalloc_overhead_iteration_seconds_count{sel()}[$__rate_interval]))"
    b = b.with_row(dash.Row("Self-cost"))
    b = b.with_panel(
        ts(
            SELF_COST[0],
            "Host time the instrumentation itself spent on each rank's engine thread per scheduler iteration, "
            "stacked by part: hooks (the SGLang plugin's request bookkeeping), ledger (the request length writes "
            "and their verification), checks (the wrapper's own work in allocator calls and at the step "
            "boundary), exporters (the sinks on the engine thread: metrics, the recorder's queue, spans). It is "
            "added to that rank's iteration: host time the engine does not spend scheduling or launching kernels. "
            f"{STEP_SCALE} With several ranks selected the stack adds their series up: select one rank to read "
            "its own. Bad: a total above about 1% of your step time (100 µs at a 10 ms step), or a part that "
            "grows with the batch or the traffic (work per request or per page on the engine's thread).",
            [
                q(
                    f"sum by (part, {RANK}) (rate(kvalloc_overhead_seconds_total{sel()}[$__rate_interval])) "
                    f"/ ignoring(part) group_left() ({iterations} > 0)",
                    "{{part}}, " + RANK_LEGEND,
                )
            ],
            unit="s",
            w=10,
            stack=True,
            min=0,
        )
    )
    b = b.with_panel(
        ts(
            SELF_COST[1],
            "Scheduler iterations (the allocator's step boundaries) per second, per rank: what the self-cost is "
            "counted per. Bad: zero on a rank that serves traffic (its engine no longer calls the allocator's "
            "step: no per-iteration figures), or TP ranks of one server at different rates (they step together).",
            [q(iterations, RANK_LEGEND)],
            unit="ops",
            w=6,
            min=0,
        )
    )
    b = b.with_panel(
        ts(
            SELF_COST[2],
            "Median and 99th percentile of the host time the instrumentation added to one scheduler iteration, "
            "per rank (from the histogram, buckets 1 µs to 10 ms, interpolated within a bucket). The p99 is what "
            "the slow iterations pay, and in TP the slowest rank's iteration sets the step. "
            f"{STEP_SCALE} Bad: a p99 above about 1% of your step time (100 µs at a 10 ms step), or a p99 far "
            "above the p50 (some iterations pay much more: snapshots, sweeps, a large batch's checks).",
            [
                q(
                    f"histogram_quantile(0.5, sum by (le, {RANK}) "
                    f"(rate(kvalloc_overhead_iteration_seconds_bucket{sel()}[$__rate_interval])))",
                    "p50, " + RANK_LEGEND,
                ),
                q(
                    f"histogram_quantile(0.99, sum by (le, {RANK}) "
                    f"(rate(kvalloc_overhead_iteration_seconds_bucket{sel()}[$__rate_interval])))",
                    "p99, " + RANK_LEGEND,
                    "B",
                ),
            ],
            unit="s",
            w=8,
            min=0,
        )
    )

    # -- request footprint ----------------------------------------------------------------------------------
    b = b.with_row(dash.Row("Request footprint"))
    b = b.with_panel(
        bargauge.Panel()
        .title("Pages per request")
        .description(
            "Peak pages held per request, observed when the request is released, counted per bucket over the "
            "time range. Bad: a heavy tail in the top buckets (a few long requests hold most of the pool), or "
            "requests that keep more pages than their length needs (compare with the page size)."
        )
        .datasource(DS)
        .targets(
            [
                q(
                    f"sum by (le) (increase(kvalloc_request_pages_bucket{sel()}[$__range]))",
                    "{{le}}",
                    instant=True,
                    heatmap_fmt=True,
                )
            ]
        )
        .display_mode(cm.BarGaugeDisplayMode.GRADIENT)
        .orientation(cm.VizOrientation.VERTICAL)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .unit("short")
        .span(12)
        .height(8)
    )
    b = b.with_panel(
        ts(
            "Pages per request p50 / p99",
            "Median and 99th percentile of peak pages per released request. Bad: a p99 that approaches the pool "
            "size (one request can starve the others).",
            [
                q(
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(kvalloc_request_pages_bucket{sel()}[$__rate_interval])))",
                    "p50",
                ),
                q(
                    "histogram_quantile(0.99, sum by (le) "
                    f"(rate(kvalloc_request_pages_bucket{sel()}[$__rate_interval])))",
                    "p99",
                    "B",
                ),
            ],
            w=12,
            min=0,
        )
    )
    model = b.build()
    # Explicit, stable panel ids (rows included): links and the committed JSON must not depend on build order.
    for i, p in enumerate(model.panels or (), start=1):
        p.id_val = i
    return model


def render() -> str:
    return json.dumps(build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grafana.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff if the JSON is stale")
    ap.add_argument("--out", type=Path, default=DASHBOARD_PATH, help=f"default: {DASHBOARD_PATH}")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        old = args.out.read_text() if args.out.exists() else ""
        if old == text:
            return 0
        sys.stdout.writelines(
            difflib.unified_diff(old.splitlines(True), text.splitlines(True), str(args.out), "generated")
        )
        print(f"{args.out} is stale: run `make grafana`", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
