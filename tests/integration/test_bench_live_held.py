"""`bench predict --live`'s stand-in for the activator, on the real API server: the requests its load
generator holds for a pool from zero reach the WarmModel as the activator's annotation, in the format the
operator reads, and the key goes once nothing is held (a key left behind would keep the pool from zero)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from warmpool_bench.predict_live_held import REPLICA, HeldReporter
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.rules.zero import held_requests

from tests.support.e2e import warmmodel
from warmpool.contract.zero import held_annotation

pytestmark = pytest.mark.integration


def _annotations(cluster: ClusterHandle, namespace: str) -> dict[str, Any]:
    body = json.loads(cluster.kubectl("get", "-n", namespace, "warmmodel", "held", "-o", "json").stdout)
    return dict(body["metadata"].get("annotations") or {})


def _until(check: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {what}"
        time.sleep(0.1)


def test_held_requests_reach_the_warmmodel_as_the_activator_writes_them(
        cluster: ClusterHandle, crd: str, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(warmmodel("held", Path("/nonexistent/m"))))
    api: Any = config.new_client_from_config(config_file=str(cluster.kubeconfig))  # type: ignore[no-untyped-call]
    custom = client.CustomObjectsApi(api)
    reporter = HeldReporter(custom, namespace, "held")
    key = held_annotation(REPLICA)
    reporter.start()
    try:
        reporter.set(3)
        _until(lambda: key in _annotations(cluster, namespace), "the held count written")
        held = held_requests(_annotations(cluster, namespace), hold_timeout_seconds=60, now_wall=time.time())
        assert held.requests == 3 and held.replicas == 1 and not held.ignored, held  # what the operator reads of it
        reporter.set(5)
        _until(lambda: _annotations(cluster, namespace).get(key, "").startswith("5 "), "the new count written")
        reporter.set(0)
        _until(lambda: key not in _annotations(cluster, namespace), "the key removed at zero held")
        reporter.set(2)
        _until(lambda: key in _annotations(cluster, namespace), "a second hold written")
    finally:
        reporter.stop()
    assert key not in _annotations(cluster, namespace)  # stop removes a key still written
    assert not reporter.errors and reporter.writes >= 5
