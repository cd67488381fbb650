"""The scale benchmark's floor: the same objects the operator makes, and the fastest sweep point."""

from __future__ import annotations

from typing import Any

import pytest
from warmpool_bench.scale import warmmodel_manifest
from warmpool_bench.scale_floor import best_concurrency, floor_objects, object_path

pytestmark = pytest.mark.unit


def test_the_floor_writes_each_warmmodel_and_the_five_children_the_operator_builds_for_it() -> None:
    objects = floor_objects([warmmodel_manifest("wm-0000", "ns"), warmmodel_manifest("wm-0001", "ns")])
    kinds = [o["kind"] for o in objects]
    assert kinds == ["WarmModel", "Secret", "ConfigMap", "Service", "PodDisruptionBudget", "Deployment"] * 2
    assert {o["metadata"]["namespace"] for o in objects} == {"ns"}
    assert object_path(objects[0]) == "/apis/warmpool.dev/v1alpha1/namespaces/ns/warmmodels/wm-0000"
    deployment = objects[5]
    assert object_path(deployment) == f"/apis/apps/v1/namespaces/ns/deployments/{deployment['metadata']['name']}"
    with pytest.raises(ValueError, match="not 'Pod'"):
        object_path({"kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}})


def test_the_fastest_point_of_the_sweep_wins_and_a_failed_point_never_does() -> None:
    sweep: list[dict[str, Any]] = [{"concurrency": 4, "per_s": 100.0}, {"concurrency": 16, "per_s": 250.0},
                                   {"concurrency": 32, "per_s": 250.0},
                                   {"concurrency": 64, "per_s": 900.0, "error": "3 of 360 writes failed"}]
    assert best_concurrency(sweep) == 16  # a tie goes to fewer requests in flight
    with pytest.raises(RuntimeError, match="every point of the floor's concurrency sweep failed"):
        best_concurrency([sweep[-1]])
