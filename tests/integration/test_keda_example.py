"""The KEDA example (examples/autoscaling/keda-scaledobject.yaml) scales a WarmModel that exists,
through the scale subresource the CRD has, within the pool's bounds, on metrics warmpool exports
under the names and labels it queries.  No KEDA CRD schema is at hand offline, so its shape is
checked here field by field (the ScaledObject fields and the prometheus scaler's metadata, which
KEDA takes as strings); promtool parses each query (an integration test: the cached binary)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from warmpool_operator.api.types import parse_spec

from warmpool.contract import metrics

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "autoscaling" / "keda-scaledobject.yaml"
TARGET = REPO / "examples" / "builtin-smollm2.yaml"
CRD = REPO / "crds" / "warmmodels.warmpool.dev.yaml"
#: keda.sh/v1alpha1 ScaledObject spec fields, and the prometheus scaler's metadata keys (KEDA docs).
SPEC_FIELDS = {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "idleReplicaCount", "pollingInterval",
               "cooldownPeriod", "initialCooldownPeriod", "fallback", "advanced", "triggers"}
PROMETHEUS_METADATA = {"serverAddress", "query", "threshold", "activationThreshold", "namespace",
                       "customHeaders", "ignoreNullValues", "unsafeSsl", "queryParameters"}
#: Every metric name warmpool exports (the contract's METRIC_* constants).
EXPORTED = {value for name, value in vars(metrics).items() if name.startswith("METRIC_") and isinstance(value, str)}
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")


def _example() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return document


def _queries() -> list[str]:
    return [trigger["metadata"]["query"] for trigger in _example()["spec"]["triggers"]]


@pytest.mark.unit
def test_it_scales_the_example_warmmodel_through_its_scale_subresource_within_its_bounds() -> None:
    scaled = _example()
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert set(scaled["spec"]) <= SPEC_FIELDS
    target = yaml.safe_load(TARGET.read_text())
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": target["apiVersion"], "kind": target["kind"],
                                                "name": target["metadata"]["name"]}
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["names"]["kind"] == target["kind"]
    (version,) = [v for v in crd["spec"]["versions"] if f"{crd['spec']['group']}/{v['name']}" == target["apiVersion"]]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.pool.replicas"
    pool = parse_spec(target["spec"]).pool
    assert pool.min_warm <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"] <= pool.max_replicas


@pytest.mark.unit
def test_each_trigger_is_a_prometheus_scaler_with_string_metadata() -> None:
    triggers = _example()["spec"]["triggers"]
    assert triggers
    for trigger in triggers:
        assert trigger["type"] == "prometheus"
        assert trigger.get("metricType", "AverageValue") in ("AverageValue", "Value")
        meta = trigger["metadata"]
        assert set(meta) <= PROMETHEUS_METADATA and {"serverAddress", "query", "threshold"} <= set(meta)
        assert all(isinstance(value, str) for value in meta.values())  # KEDA's metadata is map[string]string
        assert float(meta["threshold"]) > 0
        assert urlparse(meta["serverAddress"]).scheme in ("http", "https")


@pytest.mark.unit
def test_the_queries_name_exported_metrics_with_the_labels_their_series_carry() -> None:
    target = yaml.safe_load(TARGET.read_text())
    namespace = _example()["metadata"]["namespace"]
    named = set()
    for query in _queries():
        selectors = SELECTOR.findall(query)
        assert selectors, query
        for metric, matchers in selectors:
            named.add(metric)
            assert metric in EXPORTED, f"{metric} is not a metric warmpool exports (warmpool/contract/metrics.py)"
            labels = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', matchers))
            assert labels == {"namespace": namespace, "warmmodel": target["metadata"]["name"]}, query
    # the pool's queue and the requests held at zero
    assert {metrics.METRIC_REQUESTS_QUEUED, metrics.METRIC_ACTIVATOR_HELD} <= named


@pytest.mark.integration
def test_promtool_parses_every_query(tmp_path: Path) -> None:
    from warmpool_devcluster import build

    promtool = str(build.ensure_binaries(["promtool"])["promtool"])
    rules = {"groups": [{"name": "keda-example", "rules": [
        {"record": f"keda_example:query{i}", "expr": query} for i, query in enumerate(_queries())]}]}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
