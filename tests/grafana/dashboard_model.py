"""Reading the committed Grafana dashboard and alert rules the way Grafana and Prometheus do (test helpers).

Contract
- ``load_dashboard()``: the committed dashboard JSON (a dict); ``load_rules()``: the rule groups of every
  ``grafana/alerts/*.yml`` that is not a ``*_test.yml``.
- ``PER_RANK``: the titles of the panels that show one allocator's state, one series per rank (never a sum over
  ranks: in multiprocess mode every rank sits behind one instance).
- ``PER_RANK_SELF_COST``: the titles of the self-cost panels, also one series per rank (and part, quantile): what
  the instrumentation costs one rank's iterations, over that rank's iterations.
- ``panels(d)``: every non-row panel; ``targets(d)``: ``(panel, target)`` for every query of every panel.
- ``interpolate(expr, values)``: ``$name`` / ``${name}`` / ``${name:format}`` replaced from ``values`` (template
  variables and Grafana's ``$__`` built-ins, already formatted); an unknown variable raises ``KeyError`` so a
  test can never send a query with a ``$`` left in it.
- ``grafana_regex_escape(value)``: what Grafana's Prometheus data source puts in a query for one selected value
  of a multi-value / include-All variable used in ``=~``: the value with regex metacharacters escaped, written
  with the doubled backslash a PromQL string literal needs.
- ``metric_names(expr)``: the ``kvalloc_*`` names an expression reads (every metric of the catalog has the
  prefix; an expression that read anything else would be caught by the integration test's non-empty results).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "kvalloc.json"
RULES = sorted(p for p in (GRAFANA / "alerts").glob("*.yml") if not p.name.endswith("_test.yml"))
RULE_TESTS = sorted((GRAFANA / "alerts").glob("*_test.yml"))

# Panels that show one allocator's state (or have a threshold or an alert behind them): one series per rank, never
# a sum over ranks. The other panels are rates, histograms, counts or the page size: aggregates of the selection.
PER_RANK = [
    "Pages by state, per pool",
    "Used pages, per pool",
    "Live requests",
    "Internal fragmentation",
    "External fragmentation",
    "Free runs",
    "Largest free run",
    "SWA evicted tokens",
    "Tokens outside the window",
]

# The instrumentation's own host time per scheduler iteration, per rank: each rank's cost over its own iterations.
PER_RANK_SELF_COST = [
    "Host time added per iteration, by part",
    "Scheduler iterations per second",
    "Host time added per iteration p50 / p99",
]

_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_METRIC = re.compile(r"\bkvalloc_[A-Za-z0-9_]*")
# Grafana's prometheus data source, escapeForRegex: these characters get a backslash, itself escaped for the
# PromQL string literal.
_REGEX_META = re.compile(r"([\\^$*+?.()|\[\]{}/])")


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def load_rules() -> list[dict]:
    """Every rule of every group of the rule files."""
    out = []
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            out.extend(group["rules"])
    return out


def panels(d: dict) -> list[dict]:
    return [p for p in d["panels"] if p["type"] != "row"]


def targets(d: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in panels(d) for t in p.get("targets", [])]


def interpolate(expr: str, values: dict[str, str]) -> str:
    return _VAR.sub(lambda m: values[m.group(1) or m.group(2)], expr)


def grafana_regex_escape(value: str) -> str:
    return _REGEX_META.sub(r"\\\\\1", value)


def metric_names(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))
