"""Every PromQL expression the project ships, found where it lives, and how each is judged.

Three sources: the Grafana dashboard JSON (each panel target's ``expr``, and the template
variables' ``label_values(<expr>, label)`` queries), the chart's alert rules (each rule's
``expr``), and the runbooks (each ```` ```promql ```` fenced block, one expression per block:
the convention docs/runbooks/README.md states).

On a healthy live pool an expression is expected to return data, except where this module
says otherwise, in one place:

- ``NEEDS``: an expression that cannot return data until a feature exists (``needs [x]``);
- ``QUIET_METRICS``: counters that expose no series until the first event they count (a
  labelled ``prometheus_client`` Counter); an expression over them must be valid, and may
  return nothing on a healthy pool (or a zero rate, once one event happened);
- alerts: their expression must return nothing on a healthy pool (nothing fires), while
  every series it reads exists.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmpool.contract.metrics import (
    METRIC_ACTIVATOR_HELD,
    METRIC_ACTIVATOR_REQUESTS,
    METRIC_NODE_AGENT_FILL_FAILURES,
    METRIC_OPERATOR_RECONCILE_ERRORS,
    METRIC_OPERATOR_SCRAPE_FAILURES,
)

#: Expressions that need a feature before they can return data: where -> "needs [feature]: why".
NEEDS: dict[str, str] = {}

#: Panels not on the dashboard yet, for want of a metric (kept here so the list has one home).
PANELS_WAITING: dict[str, str] = {}

#: Metrics that expose no series until their first event (labelled counters, and the activator's per-pool gauge).
QUIET_METRICS: dict[str, str] = {
    METRIC_OPERATOR_SCRAPE_FAILURES: "no series until the operator's first failed scrape",
    METRIC_OPERATOR_RECONCILE_ERRORS: "no series until the first failed reconcile",
    METRIC_ACTIVATOR_REQUESTS: "no series until the activator learns of a pool with spec.pool.scaleToZero",
    METRIC_ACTIVATOR_HELD: "no series until the activator learns of a pool with spec.pool.scaleToZero",
    METRIC_NODE_AGENT_FILL_FAILURES: "no series until a node agent serves a WarmModel with an http or s3 source",
}

#: What the dashboard's variables stand for when an expression is run outside Grafana.
DASHBOARD_VARIABLES = {"$warmmodel": ".*"}

_PROMQL_BLOCK = re.compile(r"^```promql[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_LABEL_VALUES = re.compile(r"^label_values\((?P<expr>.+),\s*[a-zA-Z_][a-zA-Z0-9_]*\)$", re.S)


@dataclass(frozen=True)
class Expression:
    where: str  # e.g. "dashboard: Tier mix / A", "alert: WarmpoolTierPaused", "runbook: x.md #2"
    expr: str
    is_alert: bool = False


def _substitute(expr: str) -> str:
    for variable, value in DASHBOARD_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def dashboard_expressions(dashboard: Mapping[str, Any]) -> list[Expression]:
    found = []
    for variable in (dashboard.get("templating") or {}).get("list") or []:
        if variable.get("type") == "query":
            match = _LABEL_VALUES.match(str(variable["query"]).strip())
            if match is None:
                raise ValueError(f"dashboard variable {variable['name']}: not label_values(<expr>, <label>)")
            found.append(Expression(f"dashboard variable ${variable['name']}", _substitute(match["expr"])))
    for panel in dashboard["panels"]:
        for target in panel.get("targets") or []:
            found.append(Expression(f"dashboard: {panel['title']} / {target['refId']}", _substitute(target["expr"])))
    return found


def rule_expressions(rule_objects: Iterable[Mapping[str, Any]]) -> list[Expression]:
    found = []
    for obj in rule_objects:
        for group in obj["spec"]["groups"]:
            for rule in group["rules"]:
                name = rule.get("alert") or rule.get("record")
                found.append(Expression(f"alert: {name}", str(rule["expr"]), is_alert="alert" in rule))
    return found


def runbook_expressions(runbooks: Path) -> list[Expression]:
    found = []
    for page in sorted(runbooks.glob("*.md")):
        for index, match in enumerate(_PROMQL_BLOCK.finditer(page.read_text()), start=1):
            found.append(Expression(f"runbook: {page.name} #{index}", match[1].strip()))
    return found


def selectors(ast: Any) -> list[str]:
    """Every vector/matrix selector in a parse_query AST, as an instant selector string."""
    out: list[str] = []
    if isinstance(ast, dict):
        if ast.get("type") in ("vectorSelector", "matrixSelector"):
            matchers = ",".join(f"{m['name']}{m['type']}{json.dumps(m['value'])}" for m in ast["matchers"])
            out.append("{" + matchers + "}")
        for value in ast.values():
            out += selectors(value)
    elif isinstance(ast, list):
        for item in ast:
            out += selectors(item)
    return out


def quiet_metric(selector: str, quiet: Sequence[str] = tuple(QUIET_METRICS)) -> str | None:
    """The QUIET_METRICS name a selector reads, if any."""
    for name in quiet:
        if f'__name__="{name}"' in selector:
            return name
    return None
