"""The scale floor's pooled server-side apply against a real API server: every object lands, a
second apply changes nothing, and a write the server refuses is named, not lost in a count."""

from __future__ import annotations

import json
import uuid

import pytest
from warmpool_bench.scale import warmmodel_manifest
from warmpool_bench.scale_floor import apply_all, floor_objects, timed_apply
from warmpool_devcluster.testing import ClusterHandle

pytestmark = pytest.mark.integration


def test_every_object_is_applied_at_the_given_concurrency_and_a_refused_one_is_named(
        api_server: ClusterHandle) -> None:
    namespace = f"floor-{uuid.uuid4().hex[:8]}"
    api_server.kubectl("create", "namespace", namespace)
    try:
        objects = floor_objects([warmmodel_manifest(f"wm-{i:04d}", namespace) for i in range(5)])
        point = timed_apply(api_server.kubeconfig, objects, concurrency=4)
        assert "error" not in point and point["objects"] == 30 and point["per_s"] > 0, point
        for plural in ("warmmodels", "secrets", "configmaps", "services", "poddisruptionbudgets", "deployments"):
            items = json.loads(api_server.kubectl("get", plural, "-n", namespace, "-o", "json").stdout)["items"]
            assert len(items) == 5, (plural, [i["metadata"]["name"] for i in items])
        assert apply_all(api_server.kubeconfig, objects, concurrency=8) == []  # the same again: all accepted
        bad = warmmodel_manifest("wm-bad", namespace)
        bad["spec"]["pool"]["replicas"] = -1  # the CRD's schema refuses it
        failures = apply_all(api_server.kubeconfig, [bad, *objects[:6]], concurrency=2)
        assert len(failures) == 1 and failures[0].startswith("WarmModel wm-bad: 422"), failures
    finally:
        api_server.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
