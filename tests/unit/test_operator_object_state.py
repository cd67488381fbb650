"""What the operator keeps per WarmModel, and what kopf writes of its own onto one
(io/watch_cache.py's slim copy, app/kopf_state.py's storages): no managed fields, no kubectl or
kopf copy of the content, and nothing of kopf's written by a handler that succeeded at once."""

from __future__ import annotations

import json
from typing import Any, cast

import kopf
import pytest
from warmpool_operator.app.kopf_state import KOPF_MARKER, MemoryDiffBaseStorage, QuietProgressStorage
from warmpool_operator.io.watch_cache import slim

from warmpool.contract.api import API_GROUP

pytestmark = pytest.mark.unit

SPEC = {"model": {"hostPath": {"path": "/models/m"}}, "pool": {"replicas": 1}}


def warmmodel(**annotations: str) -> dict[str, Any]:
    return {"apiVersion": "warmpool.dev/v1alpha1", "kind": "WarmModel",
            "metadata": {"name": "m", "namespace": "ns", "uid": "u-1", "labels": {"team": "a"},
                         "annotations": {"team": "a", **annotations},
                         "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}]},
            "spec": SPEC, "status": {"observedGeneration": 1}}


def test_the_kept_copy_drops_what_only_repeats_the_content() -> None:
    body = warmmodel(**{"kubectl.kubernetes.io/last-applied-configuration": json.dumps(SPEC),
                        f"{API_GROUP}/last-handled-configuration": json.dumps({"spec": SPEC})})
    kept = slim(body)
    assert "managedFields" not in kept["metadata"]
    assert kept["metadata"]["annotations"] == {"team": "a"}  # others' annotations stay (held requests)
    assert kept["metadata"]["labels"] == {"team": "a"} and kept["spec"] == SPEC and kept["status"]
    assert "kubectl.kubernetes.io/last-applied-configuration" in body["metadata"]["annotations"]  # not changed


def test_the_diff_base_is_kept_in_memory_and_forgotten_with_its_warmmodel() -> None:
    storage = MemoryDiffBaseStorage()
    body = kopf.Body(cast(kopf.RawBody, warmmodel()))
    patch = kopf.Patch()
    essence = storage.build(body=body)
    storage.store(body=body, patch=patch, essence=essence)
    assert not patch  # nothing written onto the object
    assert storage.fetch(body=body) == essence and essence["spec"] == SPEC
    storage.forget("u-1")
    assert storage.fetch(body=body) is None and len(storage) == 0


def test_progress_leaves_no_marker_when_the_handler_succeeded_at_once() -> None:
    storage = QuietProgressStorage(prefix=API_GROUP)
    body = kopf.Body(cast(kopf.RawBody, warmmodel()))
    marker = f"{API_GROUP}/{KOPF_MARKER}"
    done = kopf.Patch()
    storage.store(key=kopf.HandlerId("reconcile"), record={"success": True}, body=body, patch=done)
    storage.purge(key=kopf.HandlerId("reconcile"), body=body, patch=done)
    assert not done, f"a handler that succeeded at once wrote {dict(done)}"
    retried = kopf.Patch()
    storage.store(key=kopf.HandlerId("reconcile"), record={"retries": 1, "delayed": "x"}, body=body, patch=retried)
    annotations = retried["metadata"]["annotations"]
    assert annotations[marker] == "yes" and any(key != marker for key in annotations)
