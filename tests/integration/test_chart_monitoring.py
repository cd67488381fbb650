"""The chart's monitoring of the activator and the node agent, rendered (`helm template`, no cluster):
the node agent's probes, metrics port and resource defaults; a PodMonitor for each of them; the new
alerts, each linking a runbook page that exists, with the `for:` durations values can shorten and
defaults that stay as documented.  That they fire is tests/integration/test_promql.py's."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml
from warmpool_devcluster import build
from warmpool_devcluster.chart_values import render_only_set_flags

from tests.support.e2e import REPO

pytestmark = pytest.mark.integration

CHART = REPO / "helm" / "warmpool"
RUNBOOKS = REPO / "docs" / "runbooks"
ON = ("nodeAgent.enabled=true", "metrics.podMonitor.enabled=true", "metrics.prometheusRule.enabled=true")
NEW_ALERTS = {"WarmpoolModelDegraded": "model-degraded.md", "WarmpoolReconcileErrors": "reconcile-errors.md",
              "WarmpoolActivatorRefusing": "activator-refusing.md",
              "WarmpoolNodeAgentFillFailures": "node-agent-fill-failures.md"}


def _render(*values: str) -> list[dict[str, Any]]:
    helm = build.ensure_binaries(["helm"])["helm"]
    args = [str(helm), "template", "wp", str(CHART), "-n", "ops", "--kube-version", build.KUBERNETES_VERSION,
            *render_only_set_flags()]
    for value in values:
        args += ["--set", value]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if isinstance(doc, dict)]


def _one(objs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    return found


def test_the_node_agent_has_probes_a_metrics_port_and_resource_defaults() -> None:
    (container,) = _one(_render(*ON), "DaemonSet", "-node-agent")["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 9090, "health": 8081}, ports
    assert {"--metrics-port=9090", "--health-port=8081"} <= set(container["args"]), container["args"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"], container["resources"]


def test_the_activator_and_the_node_agent_get_pod_monitors_keeping_the_pools_labels() -> None:
    objs = _render(*ON)
    for suffix, component in (("-activator", "activator"), ("-node-agent", "node-agent")):
        monitor = _one(objs, "PodMonitor", suffix)
        assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == component
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True, endpoint
    assert not [o for o in _render("metrics.podMonitor.enabled=true")
                if o["kind"] == "PodMonitor" and o["metadata"]["name"].endswith("-node-agent")], "agent off: none"


def test_each_new_alert_links_its_runbook_and_its_durations_come_from_values() -> None:
    rules = {r["alert"]: r for r in _one(_render(*ON), "PrometheusRule", "")["spec"]["groups"][0]["rules"]}
    for alert, page in NEW_ALERTS.items():
        assert rules[alert]["annotations"]["runbook_url"].endswith(f"/{page}"), rules[alert]
        assert (RUNBOOKS / page).is_file(), page
    assert rules["WarmpoolModelDegraded"]["for"] == "5m" and rules["WarmpoolReconcileErrors"]["for"] == "10m"
    short = {r["alert"]: r for r in _one(_render(*ON, "metrics.prometheusRule.degradedFor=4s"), "PrometheusRule",
                                         "")["spec"]["groups"][0]["rules"]}
    assert short["WarmpoolModelDegraded"]["for"] == "4s"
    # Without the activator or the node agent, their alerts would read series nobody exports: left out.
    names = {r["alert"] for r in _one(_render("metrics.prometheusRule.enabled=true", "activator.enabled=false"),
                                      "PrometheusRule", "")["spec"]["groups"][0]["rules"]}
    assert not names & {"WarmpoolActivatorRefusing", "WarmpoolNodeAgentFillFailures"}, names
