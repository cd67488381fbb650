"""What the operator's watch cache keeps of worker pods and ReplicaSets: what the passes read,
not their pod templates."""

from __future__ import annotations

import json
from typing import Any

import pytest
from warmpool_operator.api.types import parse_spec
from warmpool_operator.io.watch_cache import POD_SPEC_READ, REPLICASET_SPEC_READ, slim_worker
from warmpool_operator.model import Target
from warmpool_operator.rules import builders
from warmpool_operator.rules.observation import pod_fingerprint
from warmpool_operator.rules.ownership import deployment_pods

pytestmark = pytest.mark.unit


def _pod_and_replicaset() -> tuple[dict[str, Any], dict[str, Any]]:
    model = {"model": {"hostPath": {"path": "/models/m"}}, "pool": {"replicas": 1}}
    target = Target(name="m", namespace="ns", spec=parse_spec(model))
    template = builders.build_deployment(target, 1)["spec"]["template"]
    replicaset = {"kind": "ReplicaSet", "metadata": {
        "name": "m-abc", "namespace": "ns", "uid": "rs-1", "labels": template["metadata"]["labels"],
        "managedFields": [{"manager": "kube-controller-manager"}],
        "ownerReferences": [{"kind": "Deployment", "uid": "dep-1", "controller": True, "name": "m"}]},
        "spec": {"replicas": 1, "selector": {}, "template": template},
        "status": {"replicas": 1, "readyReplicas": 1}}
    pod = {"kind": "Pod", "metadata": {
        "name": "m-abc-x", "namespace": "ns", "uid": "pod-1", "labels": template["metadata"]["labels"],
        "annotations": {"a": "b"}, "managedFields": [{"manager": "kubelet"}],
        "ownerReferences": [{"kind": "ReplicaSet", "uid": "rs-1", "controller": True, "name": "m-abc"}]},
        "spec": {**template["spec"], "nodeName": "node-1"},
        "status": {"phase": "Running", "podIP": "10.0.0.5", "conditions": [{"type": "Ready", "status": "True"}],
                   "containerStatuses": [{"name": "worker", "state": {"running": {}}, "restartCount": 2}]}}
    return pod, replicaset


def test_the_cache_keeps_metadata_status_and_the_spec_fields_a_pass_reads_not_the_template() -> None:
    pod, replicaset = _pod_and_replicaset()
    kept_pod, kept_rs = slim_worker(pod, POD_SPEC_READ), slim_worker(replicaset, REPLICASET_SPEC_READ)
    assert kept_pod["spec"] == {"nodeName": "node-1"} and kept_rs["spec"] == {"replicas": 1}
    assert "managedFields" not in kept_pod["metadata"] and kept_pod["status"] == pod["status"]
    assert kept_pod["metadata"]["annotations"] == {"a": "b"}
    assert len(json.dumps(kept_pod)) < len(json.dumps(pod)) / 2  # the template was most of it
    # What the passes compute from them is the same as from the whole objects.
    assert pod_fingerprint(kept_pod, deleted=False) == pod_fingerprint(pod, deleted=False)
    assert pod_fingerprint(kept_rs, deleted=False) == pod_fingerprint(replicaset, deleted=False)
    whole = deployment_pods([pod], [replicaset], "dep-1")
    trimmed = deployment_pods([kept_pod], [kept_rs], "dep-1")
    assert [p["metadata"]["uid"] for p in trimmed[0]] == [p["metadata"]["uid"] for p in whole[0]] == ["pod-1"]
    assert "spec" in pod and "containers" in pod["spec"]  # the watch's own copy is left as it was
