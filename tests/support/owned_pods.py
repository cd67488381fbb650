"""The ownership chain the operator's worker pods have -- WarmModel -> Deployment -> ReplicaSet ->
Pod, each a controller ownerReference with the owner's uid -- made by hand, for tests on an API
server whose controllers do not run (or on a node where the pod's container never starts)."""

from __future__ import annotations

from typing import Any

from warmpool.contract.api import API_GROUP_VERSION, KIND
from warmpool.contract.pods import ANNOTATION_CACHE_REVISION, LABEL_MANAGED_BY, LABEL_MODEL, MANAGED_BY


def owner(api_version: str, kind: str, name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid, "controller": True}


def worker_labels(model: str) -> dict[str, str]:
    """The labels the operator puts on a worker pod: what a tenant's bare pod copies."""
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_MODEL: model}


def pod_body(name: str, model: str, node: str, revision: str, owners: list[dict[str, Any]]) -> dict[str, Any]:
    """A worker pod bound to ``node`` that names ``revision`` (the node agent's pin), with ``owners``."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": worker_labels(model),
                     "annotations": {ANNOTATION_CACHE_REVISION: revision}, "ownerReferences": owners},
        "spec": {"nodeName": node, "tolerations": [{"operator": "Exists"}],
                 "containers": [{"name": "worker", "image": "warmpool.local/none:never-run"}]},
    }


def _template(model: str) -> dict[str, Any]:
    # Where controllers run, the ReplicaSet's own pods stay unscheduled (no node matches), so it
    # keeps the hand-made pod, bound to a node, when it has one too many.
    return {"metadata": {"labels": worker_labels(model)},
            "spec": {"nodeSelector": {"warmpool.dev/test-no-such-node": "none"},
                     "containers": [{"name": "worker", "image": "warmpool.local/none:never-run"}]}}


def deployment_body(name: str, model: str, model_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": worker_labels(model),
                     "ownerReferences": [owner(API_GROUP_VERSION, KIND, model, model_uid)]},
        "spec": {"replicas": 1, "paused": True, "selector": {"matchLabels": worker_labels(model)},
                 "template": _template(model)},
    }


def replicaset_body(name: str, model: str, deployment: str, deployment_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": name, "labels": worker_labels(model),
                     "ownerReferences": [owner("apps/v1", "Deployment", deployment, deployment_uid)]},
        "spec": {"replicas": 1, "selector": {"matchLabels": worker_labels(model)}, "template": _template(model)},
    }
