"""Whose an object is, by its owner references (pure): a name match is never ownership, and
matching labels are not either (anyone may label a pod)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from warmpool_operator.model import Obj


def owned_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    """Whether ``obj`` carries an owner reference to ``owner_uid`` (a name match is not ownership)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(ref, Mapping) and ref.get("uid") == owner_uid for ref in refs)


def controller_uid(obj: Mapping[str, Any], kind: str) -> str | None:
    """The uid of ``obj``'s controlling owner when that owner is of ``kind``, else None."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") and ref.get("kind") == kind:
            return str(ref.get("uid") or "") or None
    return None


def deployment_pods(
    pods: list[Obj], replicasets: list[Obj], deployment_uid: str
) -> tuple[list[Obj], list[Obj]]:
    """(ours, others): a pod is ours only when its controller is a ReplicaSet whose controller is
    the Deployment ``deployment_uid``, and it is not on the host's network (its IP is the node's:
    scraping it would reach whatever else listens there, and the control token with it).
    Matching labels are not enough: anyone may label a pod."""
    ours_rs = {
        str((rs.get("metadata") or {}).get("uid"))
        for rs in replicasets
        if controller_uid(rs, "Deployment") == deployment_uid
    }
    ours: list[Obj] = []
    others: list[Obj] = []
    for pod in pods:
        owned = controller_uid(pod, "ReplicaSet") in ours_rs
        host_network = bool((pod.get("spec") or {}).get("hostNetwork"))
        (ours if owned and not host_network else others).append(pod)
    return ours, others
