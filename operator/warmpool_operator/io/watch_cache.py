"""Watch-fed views of what the operator owns: children, ReplicaSets and worker pods.

kopf indexes (registered in app/handlers.py, one per kind, each filtered by the
``app.kubernetes.io/managed-by=warmpool-operator`` label; Secrets are never watched) keep the latest copy of every
labelled object in memory, so a reconcile reads them here instead of GETting them.  An object
of a child's name that lacks our labels (someone else's) is not in the cache: creating ours
then fails with 409 and that one object is read from the API server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from warmpool.contract.api import API_GROUP, KIND
from warmpool.contract.pods import LABEL_MANAGED_BY, LABEL_MODEL, MANAGED_BY
from warmpool_operator.model import Obj

#: The label every object the operator makes carries; the watches are filtered on it.
MANAGED = {LABEL_MANAGED_BY: MANAGED_BY}


#: Annotations that repeat an object's content and that no pass reads: kubectl's copy of what was
#: applied, and the essence kopf kept on WarmModels before it was kept in memory (app/kopf_state.py).
UNREAD_ANNOTATIONS = ("kubectl.kubernetes.io/last-applied-configuration",
                      f"{API_GROUP}/last-handled-configuration")


def slim(body: Mapping[str, Any]) -> Obj:
    """A copy without ``managedFields`` (the largest part of an object, never read here) and the
    annotations that only repeat its content (UNREAD_ANNOTATIONS)."""
    out = dict(body)
    meta = dict(out.get("metadata") or {})
    meta.pop("managedFields", None)
    annotations = meta.get("annotations")
    if annotations and any(key in annotations for key in UNREAD_ANNOTATIONS):
        meta["annotations"] = {k: v for k, v in annotations.items() if k not in UNREAD_ANNOTATIONS}
    out["metadata"] = meta
    return out


#: What a pass reads of a worker pod's spec (rules/ownership.py, control/observe.py); the rest of it
#: (containers, volumes, probes: most of a pod's size) is not kept.
POD_SPEC_READ = ("nodeName", "hostNetwork")
#: What a pass reads of a ReplicaSet's spec: its replica count, never its pod template.
REPLICASET_SPEC_READ = ("replicas",)


def slim_worker(body: Mapping[str, Any], spec_read: tuple[str, ...]) -> Obj:
    """A worker pod or ReplicaSet as the cache keeps it: ``slim``, with only the spec fields the
    passes read (``spec_read``).  At 1,000 WarmModels the pod templates held twice over (pods and
    ReplicaSets) were most of the operator's memory.  Nothing writes these copies back: pods are
    patched."""
    out = slim(body)
    spec = out.get("spec") or {}
    out["spec"] = {key: spec[key] for key in spec_read if key in spec}
    return out


def model_key(namespace: str | None, labels: Mapping[str, str]) -> tuple[str, str] | None:
    """(namespace, WarmModel name) of a pod or ReplicaSet by its model label; None without one."""
    model = labels.get(LABEL_MODEL)
    if not namespace or not model:
        return None
    return str(namespace), str(model)


def warmmodel_owner(body: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(namespace, name, uid) of the WarmModel owning a child, from its owner references."""
    meta = body.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("kind") == KIND:
            return str(meta.get("namespace")), str(ref.get("name")), str(ref.get("uid"))
    return None


def uid_of(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")


@dataclass(frozen=True)
class Cache:
    """Read-only access to the indexes.  ``children`` maps a child kind ("Deployment", ...) to
    its index, keyed (namespace, name); pods and ReplicaSets are keyed (namespace, model).

    ``gone``: uids of objects a resync (control/resync.py) found deleted while a watch was down.  kopf
    lists again after a broken watch but sends no DELETED for what went meanwhile, so its
    indexes keep those objects; they are hidden here instead.  One set, shared by every Cache."""

    children: Mapping[str, kopf.Index[Any, Any]]
    replicasets: kopf.Index[Any, Any]
    pods: kopf.Index[Any, Any]
    gone: set[str] = field(default_factory=set)

    def _values(self, index: kopf.Index[Any, Any], key: Any) -> list[Obj]:
        try:
            store = index[key]
        except KeyError:
            return []
        return [value for value in store if isinstance(value, dict) and uid_of(value) not in self.gone]

    def child(self, kind: str, namespace: str, name: str) -> Obj | None:
        index = self.children.get(kind)
        found = self._values(index, (namespace, name)) if index is not None else []
        return found[0] if found else None

    def pods_of(self, namespace: str, model: str) -> list[Obj]:
        return self._values(self.pods, (namespace, model))

    def replicasets_of(self, namespace: str, model: str) -> list[Obj]:
        return self._values(self.replicasets, (namespace, model))

    def indexes(self) -> dict[str, kopf.Index[Any, Any]]:
        """Every index by the kind it holds."""
        return {**self.children, "ReplicaSet": self.replicasets, "Pod": self.pods}

    def stored_uids(self) -> set[str]:
        """The uid of every object the indexes hold, ``gone`` or not."""
        return {uid_of(value) for index in self.indexes().values() for key in list(index)
                for value in index.get(key, ()) if isinstance(value, dict)}

    def held(self, kind: str) -> list[Obj]:
        """Every object of a kind the index holds and ``gone`` does not hide, in every namespace."""
        index = self.indexes()[kind]
        return [value for key in list(index) for value in self._values(index, key)]
