"""The chart's monitors and rules as a plain Prometheus configuration (no process here).

The chart owns the facts of what is scraped (the worker PodMonitor's and the operator
ServiceMonitor's selectors, port names, paths and relabelling) and the alert rules.  This
module renders those objects with the chart's own ``helm template`` and turns them into
scrape jobs the way the Prometheus Operator would: one job per monitor endpoint,
``kubernetes_sd_configs`` against the cluster, the monitor's relabelling appended.  So a
Prometheus configured from it sees the same series, with the same labels, a user's
Prometheus gets from the chart's monitors.

One deviation: the ServiceMonitor's Service is resolved here to its pod selector and target
port and discovered with ``role: pod`` (what endpoint discovery would list), so one discovery
role serves both monitors.  Every target must be a pod address of the local cluster's real
node (the pod range `cluster up` gives its bridges); anything else is dropped before a scrape.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from warmpool_devcluster import build
from warmpool_devcluster.chart_values import render_only_set_flags

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "warmpool"
#: The release and namespace the dev cluster's scrape config is rendered for (the README's
#: `helm install warmpool helm/warmpool -n warmpool-system`).
DEFAULT_RELEASE = "warmpool"
DEFAULT_NAMESPACE = "warmpool-system"
DEFAULT_SCRAPE_INTERVAL = "5s"
#: Only the local cluster's pod addresses (node_network.POD_RANGE, 10.244.0.0/16) are ever scraped.
POD_ADDRESS = r"10\.244(\.[0-9]{1,3}){2}:[0-9]+"
#: The values that turn on every monitoring object of the chart for rendering.
MONITORING_VALUES = (
    "metrics.service.enabled=true",
    "metrics.serviceMonitor.enabled=true",
    "metrics.podMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
)


class PrometheusError(RuntimeError):
    """Prometheus could not be configured or started; the message says why and where its log is."""


def render_monitoring(
    release: str = DEFAULT_RELEASE,
    namespace: str = DEFAULT_NAMESPACE,
    extra_values: Sequence[str] = (),
    chart: Path = CHART,
) -> list[dict[str, Any]]:
    """The chart's Service, ServiceMonitor, PodMonitor and PrometheusRule, as `helm template` renders them."""
    helm = build.ensure_binaries(["helm"])["helm"]
    # The dev cluster's version: `helm template` would otherwise check the chart's kubeVersion against v1.20.
    args = [str(helm), "template", release, str(chart), "-n", namespace, "--kube-version", build.KUBERNETES_VERSION,
            *render_only_set_flags()]
    for value in (*MONITORING_VALUES, *extra_values):
        args += ["--set", value]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise PrometheusError(f"helm template failed ({proc.returncode}): {proc.stderr.strip()}")
    kinds = {"Service", "ServiceMonitor", "PodMonitor", "PrometheusRule"}
    return [doc for doc in yaml.safe_load_all(proc.stdout) if isinstance(doc, dict) and doc.get("kind") in kinds]


def _sanitize(label: str) -> str:
    """A Kubernetes label name as Prometheus' discovery meta label spells it."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _selector_keep(match_labels: Mapping[str, str]) -> list[dict[str, Any]]:
    return [
        {"source_labels": [f"__meta_kubernetes_pod_label_{_sanitize(key)}",
                           f"__meta_kubernetes_pod_labelpresent_{_sanitize(key)}"],
         "regex": f"({re.escape(str(value))});true", "action": "keep"}
        for key, value in sorted(match_labels.items())
    ]


def _user_relabelings(relabelings: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A monitor's `relabelings` (camelCase) as Prometheus `relabel_configs` (snake_case)."""
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label", "separator": "separator",
             "regex": "regex", "replacement": "replacement", "modulus": "modulus"}
    out = []
    for rule in relabelings:
        unknown = set(rule) - set(names) - {"action"}
        if unknown:
            raise PrometheusError(f"relabeling fields not translated: {sorted(unknown)}")
        translated: dict[str, Any] = {names[key]: value for key, value in rule.items() if key in names}
        translated["action"] = str(rule.get("action", "replace")).lower()
        out.append(translated)
    return out


#: The monitor endpoint fields this translation honours (interval gives way to the local, shorter
#: scrape interval); any other one is refused, not dropped.
_ENDPOINT_FIELDS = frozenset({"port", "path", "interval", "honorLabels", "relabelings"})


def _check_endpoint(endpoint: Mapping[str, Any]) -> None:
    unknown = set(endpoint) - _ENDPOINT_FIELDS
    if unknown:
        raise PrometheusError(f"endpoint fields not translated: {sorted(unknown)}")


def _sd_config(kubeconfig: Path, namespace_selector: Mapping[str, Any], own_namespace: str) -> dict[str, Any]:
    config: dict[str, Any] = {"role": "pod", "kubeconfig_file": str(kubeconfig)}
    if not namespace_selector.get("any"):
        config["namespaces"] = {"names": list(namespace_selector.get("matchNames") or [own_namespace])}
    return config


def _common_relabelings(port: str | int) -> list[dict[str, Any]]:
    """What the Prometheus Operator adds to every pod-backed target: the port, no finished pods,
    and the namespace/pod/container labels."""
    port_keep = ({"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": str(port),
                  "action": "keep"} if isinstance(port, str) else
                 {"source_labels": ["__meta_kubernetes_pod_container_port_number"], "regex": str(port),
                  "action": "keep"})
    return [
        port_keep,
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)", "action": "drop"},
        {"source_labels": ["__address__"], "regex": POD_ADDRESS, "action": "keep"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"target_label": "endpoint", "replacement": str(port)},
    ]


def _pod_monitor_jobs(monitor: Mapping[str, Any], kubeconfig: Path, interval: str) -> list[dict[str, Any]]:
    meta, spec = monitor["metadata"], monitor["spec"]
    jobs = []
    for index, endpoint in enumerate(spec.get("podMetricsEndpoints") or []):
        _check_endpoint(endpoint)
        jobs.append({
            "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{index}",
            "honor_labels": bool(endpoint.get("honorLabels", False)),
            "scrape_interval": interval,
            "metrics_path": endpoint.get("path", "/metrics"),
            "kubernetes_sd_configs": [_sd_config(kubeconfig, spec.get("namespaceSelector") or {},
                                                 meta["namespace"])],
            "relabel_configs": [
                *_selector_keep(spec["selector"].get("matchLabels") or {}),
                *_common_relabelings(endpoint["port"]),
                {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
                *_user_relabelings(endpoint.get("relabelings") or []),
            ],
        })
    return jobs


def _service_monitor_jobs(monitor: Mapping[str, Any], services: Sequence[Mapping[str, Any]],
                          kubeconfig: Path, interval: str) -> list[dict[str, Any]]:
    meta, spec = monitor["metadata"], monitor["spec"]
    wanted = spec["selector"].get("matchLabels") or {}
    selected = [s for s in services if all((s["metadata"].get("labels") or {}).get(k) == v
                                           for k, v in wanted.items())]
    if not selected:
        raise PrometheusError(f"ServiceMonitor {meta['name']} selects no Service among the rendered objects")
    jobs = []
    for service in selected:
        for index, endpoint in enumerate(spec.get("endpoints") or []):
            _check_endpoint(endpoint)
            ports = [p for p in service["spec"]["ports"] if p.get("name") == endpoint["port"]]
            if not ports:
                raise PrometheusError(f"Service {service['metadata']['name']} has no port named {endpoint['port']!r}")
            target_port = ports[0].get("targetPort", ports[0]["port"])
            jobs.append({
                "job_name": f"serviceMonitor/{meta['namespace']}/{meta['name']}/{index}",
                "honor_labels": bool(endpoint.get("honorLabels", False)),
                "scrape_interval": interval,
                "metrics_path": endpoint.get("path", "/metrics"),
                "kubernetes_sd_configs": [_sd_config(kubeconfig, spec.get("namespaceSelector") or {},
                                                     meta["namespace"])],
                "relabel_configs": [
                    # The Service's selector stands in for its endpoints (module docstring).
                    *_selector_keep(service["spec"]["selector"]),
                    *_common_relabelings(target_port),
                    {"target_label": "service", "replacement": service["metadata"]["name"]},
                    {"target_label": "job", "replacement": service["metadata"]["name"]},
                    *_user_relabelings(endpoint.get("relabelings") or []),
                ],
            })
    return jobs


def scrape_configs(objects: Sequence[Mapping[str, Any]], kubeconfig: Path,
                   interval: str = DEFAULT_SCRAPE_INTERVAL) -> list[dict[str, Any]]:
    """Prometheus scrape jobs equivalent to the rendered PodMonitors and ServiceMonitors."""
    services = [o for o in objects if o["kind"] == "Service"]
    jobs: list[dict[str, Any]] = []
    for obj in objects:
        if obj["kind"] == "PodMonitor":
            jobs += _pod_monitor_jobs(obj, kubeconfig, interval)
        elif obj["kind"] == "ServiceMonitor":
            jobs += _service_monitor_jobs(obj, services, kubeconfig, interval)
    if not jobs:
        raise PrometheusError("the rendered chart has no PodMonitor or ServiceMonitor to scrape from")
    return jobs


def rule_groups(objects: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The PrometheusRules' groups as one Prometheus rule file."""
    groups = [group for o in objects if o["kind"] == "PrometheusRule" for group in o["spec"]["groups"]]
    return {"groups": groups}


def prometheus_config(objects: Sequence[Mapping[str, Any]], kubeconfig: Path, rules_file: Path,
                      interval: str = DEFAULT_SCRAPE_INTERVAL) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules_file)],
        "scrape_configs": scrape_configs(objects, kubeconfig, interval),
    }
