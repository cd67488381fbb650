"""With the PodMonitor on and the chart's NetworkPolicies enforced, Prometheus can scrape the workers.

This machine's kernel cannot run an enforcing NetworkPolicy implementation (kube-network-policies needs
an nft queue it lacks), so the chart's rendered policies are evaluated here by the project's own
evaluator of the NetworkPolicy API's semantics (operator/warmpool_operator/activator/reach.py, what the
activator enforces for held requests): a Prometheus pod in its own namespace, listed in
networkPolicy.metricsClients, may open the worker port the PodMonitor scrapes; a pod of another
namespace still may not.  Needs the helm binary, no cluster."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml
from warmpool_devcluster import build
from warmpool_devcluster.chart_values import render_only_set_flags
from warmpool_operator.activator.reach import Caller, Target, admits
from warmpool_operator.rules.builders import pod_labels

from tests.support.e2e import REPO
from warmpool.contract.http import DEFAULT_WORKER_PORT, WORKER_PORT_NAME

pytestmark = pytest.mark.integration

MODELS = "models"
MONITORING = "monitoring"
PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}


def _policies(*values: str) -> list[dict[str, Any]]:
    helm = build.ensure_binaries(["helm"])["helm"]
    args = [str(helm), "template", "wp", str(REPO / "helm" / "warmpool"), "-n", "warmpool-system",
            "--kube-version", build.KUBERNETES_VERSION, *render_only_set_flags(),
            "--set", f"watch.namespaces[0]={MODELS}", "--set", "metrics.podMonitor.enabled=true"]
    for value in values:
        args += ["--set-json", value]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout)
            if isinstance(doc, dict) and doc.get("kind") == "NetworkPolicy" and doc["metadata"]["namespace"] == MODELS]


def _prometheus_in(namespace: str) -> Caller:
    return Caller(ip="10.244.0.9", namespace=namespace, labels=PROMETHEUS_LABELS,
                  namespace_labels={"kubernetes.io/metadata.name": namespace})


WORKER = Target(MODELS, pod_labels("tiny"), DEFAULT_WORKER_PORT, WORKER_PORT_NAME)
METRICS_CLIENTS = ('networkPolicy.metricsClients=[{"namespaceSelector": {"matchLabels": '
                   f'{{"kubernetes.io/metadata.name": "{MONITORING}"}}}}}}]')


def test_prometheus_listed_in_metrics_clients_may_scrape_the_workers() -> None:
    policies = _policies(METRICS_CLIENTS)
    assert policies, "the chart renders a workers' NetworkPolicy in the watched namespace"
    assert admits(policies, WORKER, _prometheus_in(MONITORING))
    assert not admits(policies, WORKER, _prometheus_in("elsewhere")), "only the listed peers are let in"


def test_without_metrics_clients_the_workers_stay_closed_to_other_namespaces() -> None:
    """metricsClients empty means "anyone" for the operator's metrics port, never for the workers' port
    (it serves the model too): Prometheus in its own namespace stays out, as the values say."""
    assert not admits(_policies(), WORKER, _prometheus_in(MONITORING))
