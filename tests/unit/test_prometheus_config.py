"""warmpool_devcluster.prometheus: the chart's monitors as Prometheus scrape jobs (pure translation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster import prometheus_config

pytestmark = pytest.mark.unit

KUBECONFIG = Path("/k/kubeconfig")


def pod_monitor(**endpoint: Any) -> dict[str, Any]:
    return {
        "kind": "PodMonitor", "metadata": {"name": "wp-workers", "namespace": "ops"},
        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/component": "worker"}},
                 "namespaceSelector": {"matchNames": ["a", "b"]},
                 "podMetricsEndpoints": [{"port": "http", "path": "/metrics", **endpoint}]},
    }


def service_and_monitor() -> list[dict[str, Any]]:
    service = {"kind": "Service", "metadata": {"name": "wp-metrics", "namespace": "ops", "labels": {"x": "1"}},
               "spec": {"selector": {"app.kubernetes.io/component": "operator"},
                        "ports": [{"name": "metrics", "port": 9090, "targetPort": "metrics"}]}}
    monitor = {"kind": "ServiceMonitor", "metadata": {"name": "wp", "namespace": "ops"},
               "spec": {"selector": {"matchLabels": {"x": "1"}}, "namespaceSelector": {"matchNames": ["ops"]},
                        "endpoints": [{"port": "metrics", "honorLabels": True}]}}
    return [service, monitor]


def test_pod_monitor_becomes_a_pod_role_job_with_its_selector_port_and_relabelings() -> None:
    relabel = {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}
    (job,) = prometheus_config.scrape_configs([pod_monitor(relabelings=[relabel])], KUBECONFIG, "2s")
    assert job["job_name"] == "podMonitor/ops/wp-workers/0" and job["scrape_interval"] == "2s"
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "kubeconfig_file": str(KUBECONFIG),
                                             "namespaces": {"names": ["a", "b"]}}]
    rules = job["relabel_configs"]
    assert rules[0] == {"source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component",
                                          "__meta_kubernetes_pod_labelpresent_app_kubernetes_io_component"],
                        "regex": "(worker);true", "action": "keep"}
    assert {"source_labels": ["__address__"], "regex": prometheus_config.POD_ADDRESS, "action": "keep"} in rules
    assert {"target_label": "job", "replacement": "ops/wp-workers"} in rules
    # The monitor's own relabelling comes last, translated to snake_case.
    assert rules[-1] == {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node",
                         "action": "replace"}


def test_service_monitor_resolves_its_service_to_the_pods_and_target_port() -> None:
    (job,) = prometheus_config.scrape_configs(service_and_monitor(), KUBECONFIG)
    assert job["honor_labels"] is True
    rules = job["relabel_configs"]
    assert rules[0]["source_labels"][0] == "__meta_kubernetes_pod_label_app_kubernetes_io_component"
    assert {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics",
            "action": "keep"} in rules
    assert {"target_label": "job", "replacement": "wp-metrics"} in rules


def test_address_guard_accepts_the_local_clusters_pod_ips_only() -> None:
    import re

    from warmpool_devcluster.node_network import POD_RANGE

    guard = re.compile(f"^(?:{prometheus_config.POD_ADDRESS})$")
    assert guard.match("10.244.3.17:8080") and str(POD_RANGE) == "10.244.0.0/16"
    for address in ("127.10.0.5:8080", "10.0.0.5:8080", "10.96.0.1:443", "192.168.1.2:9090", "172.16.0.1:80",
                    "10.2440.1.1:80", "example.com:80"):
        assert not guard.match(address), address


def test_untranslatable_input_fails_with_a_clear_error() -> None:
    with pytest.raises(prometheus_config.PrometheusError, match=r"relabeling fields not translated: \['bogus'\]"):
        prometheus_config.scrape_configs([pod_monitor(relabelings=[{"targetLabel": "a", "bogus": 1}])], KUBECONFIG)
    with pytest.raises(prometheus_config.PrometheusError, match=r"endpoint fields not translated: \['scheme'\]"):
        prometheus_config.scrape_configs([pod_monitor(scheme="https")], KUBECONFIG)
    service, monitor = service_and_monitor()
    service["metadata"]["labels"] = {}
    with pytest.raises(prometheus_config.PrometheusError, match="selects no Service"):
        prometheus_config.scrape_configs([service, monitor], KUBECONFIG)
    with pytest.raises(prometheus_config.PrometheusError, match="no PodMonitor or ServiceMonitor"):
        prometheus_config.scrape_configs([service], KUBECONFIG)
