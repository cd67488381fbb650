"""Every WarmModel has its gauges from its first pass, failed or not (control/reconciler.py and
io/metrics.py): a pass refused before any child exists (a forbidden hostPath, a name held by someone
else, waiting for a node agent) still shows the pool's warm count and minWarm, and a Degraded gauge
with the reason, so the alerts on them fire.  Over the in-memory API server and a real one (the
control_cluster fixture), as tests/integration/test_control_pass.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from prometheus_client import REGISTRY
from warmpool_operator.control.reconciler import Permanent, Reconciler, Temporary
from warmpool_operator.control.shared import Shared
from warmpool_operator.io.scrape_scheduler import ScrapeScheduler
from warmpool_operator.rules import status as st
from warmpool_operator.settings import OperatorConfig

from tests.support.control_doubles import Clock, ControlCluster, FakeWorkers, capture_events
from warmpool.contract.metrics import (
    METRIC_OPERATOR_DEGRADED,
    METRIC_OPERATOR_MIN_WARM_PODS,
    METRIC_OPERATOR_RECONCILE_ERRORS,
    METRIC_OPERATOR_WARM_PODS,
)

HOST_PATH_MODEL = {"hostPath": {"path": "/models/m"}}
HTTP_MODEL = {"http": {"url": "http://models.example/m"}}


async def _reconciler(cluster: ControlCluster, model: Mapping[str, Any], config: OperatorConfig) -> Reconciler:
    capture_events()
    clock = Clock()
    workers = FakeWorkers(clock)
    shared = Shared(cluster.kube, workers, ScrapeScheduler(workers, interval=1.0, concurrency=4), config,
                    monotonic=clock, wall=clock)
    body = await cluster.warmmodel("m", {"model": dict(model), "pool": {"replicas": 2, "minWarm": 3}})
    return Reconciler(body, shared, cluster.cache)


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def _degraded(namespace: str) -> dict[str, float]:
    """The WarmModel's DEGRADED series: reason -> value."""
    return {sample.labels["reason"]: sample.value for family in REGISTRY.collect()
            if family.name == METRIC_OPERATOR_DEGRADED for sample in family.samples
            if sample.labels["namespace"] == namespace and sample.labels["warmmodel"] == "m"}


async def test_a_forbidden_host_path_shows_the_pool_below_min_warm_and_degraded(
        control_cluster: ControlCluster) -> None:
    rec = await _reconciler(control_cluster, HOST_PATH_MODEL, OperatorConfig(allowed_host_paths=("/elsewhere",)))
    ns = control_cluster.namespace
    with pytest.raises(Permanent):
        await rec.sync(prompted=True)
    assert _value(METRIC_OPERATOR_WARM_PODS, namespace=ns, warmmodel="m") == 0
    assert _value(METRIC_OPERATOR_MIN_WARM_PODS, namespace=ns, warmmodel="m") == 3
    assert _degraded(ns) == {st.REASON_HOST_PATH_NOT_ALLOWED: 1}
    await rec.stop()  # the WarmModel gone (or the lead lost): its Degraded series goes
    assert _degraded(ns) == {}


async def test_a_degraded_pool_that_heals_keeps_one_series_at_zero(control_cluster: ControlCluster) -> None:
    rec = await _reconciler(control_cluster, HOST_PATH_MODEL, OperatorConfig(scrape_interval=1.0))
    ns = control_cluster.namespace
    theirs = await control_cluster.kube.put("services", {"apiVersion": "v1", "kind": "Service",
                                                         "metadata": {"name": "m", "namespace": ns},
                                                         "spec": {"ports": [{"name": "theirs", "port": 80}]}})
    with pytest.raises(Permanent):
        await rec.sync(prompted=True)
    assert _degraded(ns) == {st.REASON_CHILD_CONFLICT: 1}
    await control_cluster.kube.delete_obj("services", ns, theirs["metadata"]["name"])
    await control_cluster.watch()
    await rec.sync(prompted=True)
    assert _degraded(ns) == {"": 0}
    await rec.stop()


async def test_waiting_for_a_node_agent_counts_a_reconcile_error_and_shows_the_pool(
        control_cluster: ControlCluster) -> None:
    rec = await _reconciler(control_cluster, HTTP_MODEL, OperatorConfig(scrape_interval=1.0))
    ns = control_cluster.namespace
    before = _value(METRIC_OPERATOR_RECONCILE_ERRORS, kind="handler", reason="temporary") or 0.0
    with pytest.raises(Temporary, match="waiting for a node agent"):
        await rec.sync(prompted=True)
    assert _value(METRIC_OPERATOR_RECONCILE_ERRORS, kind="handler", reason="temporary") == before + 1
    assert _value(METRIC_OPERATOR_WARM_PODS, namespace=ns, warmmodel="m") == 0
    assert _value(METRIC_OPERATOR_MIN_WARM_PODS, namespace=ns, warmmodel="m") == 3
    await rec.stop()
