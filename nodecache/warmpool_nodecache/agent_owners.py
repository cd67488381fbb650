"""Which WarmModel a pod on this node belongs to: its ownerReferences chain, checked -- never its labels.

A pod counts for the agent -- its WarmModel is filled on this node, the revision it names is
pinned against eviction, and eviction waits while that WarmModel's manifest is unread -- only when
its controller is a ReplicaSet whose controller is a Deployment whose controller is one of the
WarmModels the pass listed.  Each link is checked against the object the API server returns for
it (its uid, and its own controller), so neither a pod's labels (anyone who may create a pod may
label it) nor an ownerReference naming objects that do not exist, or whose uid differs, make a pod
ours.  A tenant's bare pod with the operator's labels and a revision annotation pins nothing and
holds back no eviction.

ReplicaSets and Deployments are read by name and remembered by uid for ``ttl_s`` (at most
``max_entries``; the oldest go first): the pods on one node are few and their owners fewer, so a
pass reads only what changed.  At most ``max_reads`` reads per pass: a pod whose chain would need
more counts for nothing this pass (a node holds a bounded number of pods, so only a flood of
pods with made-up owners reaches the bound).  A read failing otherwise than 404 fails the pass
(no pin dropped, no eviction on a guess).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from warmpool.contract.api import API_GROUP
from warmpool.kube import KubeError
from warmpool_nodecache.agent_kube import AgentKube

log = logging.getLogger("warmpool.node_agent")

APPS = "/apis/apps/v1"

#: (namespace, WarmModel name)
ModelKey = tuple[str, str]


@dataclass(frozen=True)
class _Ref:
    kind: str
    api_group: str
    name: str
    uid: str


def controller(obj: Mapping[str, Any]) -> _Ref | None:
    """The object's controlling owner reference (``controller: true``), or None."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            group = str(ref.get("apiVersion") or "").rpartition("/")[0]
            return _Ref(str(ref.get("kind")), group, str(ref.get("name")), str(ref.get("uid")))
    return None


class _ReadBudget(Exception):
    """This pass read as many owners as it may."""


class PodOwners:
    """The owner chain of this node's pods, read and remembered (see the module docstring)."""

    def __init__(self, kube: AgentKube, ttl_s: float = 300.0, max_entries: int = 4096, max_reads: int = 512) -> None:
        self.kube, self.ttl_s, self.max_entries, self.max_reads = kube, ttl_s, max_entries, max_reads
        #: (plural, namespace, name, uid) -> (the object's controller or None when it is not that
        #: object, monotonic time it was read)
        self._seen: OrderedDict[tuple[str, str, str, str], tuple[_Ref | None, float]] = OrderedDict()
        self._reads = 0

    async def owned(self, pods: Iterable[Mapping[str, Any]], models: Mapping[str, ModelKey],
                    ) -> list[tuple[Mapping[str, Any], ModelKey]]:
        """Each pod a listed WarmModel owns, with that WarmModel (``models``: uid -> (namespace, name))."""
        self._reads = 0
        found: list[tuple[Mapping[str, Any], ModelKey]] = []
        for pod in pods:
            try:
                model = await self.model_of(pod, models)
            except _ReadBudget:
                name = (pod.get("metadata") or {}).get("name")
                log.warning("node agent: pod %s not judged this pass: %d owner reads already", name, self.max_reads)
                continue
            if model is not None:
                found.append((pod, model))
        return found

    async def model_of(self, pod: Mapping[str, Any], models: Mapping[str, ModelKey]) -> ModelKey | None:
        namespace = str((pod.get("metadata") or {}).get("namespace"))
        rs = controller(pod)
        if rs is None or (rs.kind, rs.api_group) != ("ReplicaSet", "apps"):
            return None
        deployment = await self._controller_of("replicasets", namespace, rs)
        if deployment is None or (deployment.kind, deployment.api_group) != ("Deployment", "apps"):
            return None
        model = await self._controller_of("deployments", namespace, deployment)
        if model is None or (model.kind, model.api_group) != ("WarmModel", API_GROUP):
            return None
        key = models.get(model.uid)
        return key if key == (namespace, model.name) else None

    async def _controller_of(self, plural: str, namespace: str, ref: _Ref) -> _Ref | None:
        """The controller of the object ``ref`` names -- None when no object of that uid exists."""
        key = (plural, namespace, ref.name, ref.uid)
        now = time.monotonic()
        cached = self._seen.get(key)
        if cached is not None and now - cached[1] < self.ttl_s:
            return cached[0]
        if self._reads >= self.max_reads:
            raise _ReadBudget
        self._reads += 1
        try:
            obj = await self.kube.request("GET", f"{APPS}/namespaces/{namespace}/{plural}/{ref.name}")
        except KubeError as error:
            if error.status != 404:
                raise
            obj = {}
        found = controller(obj) if (obj.get("metadata") or {}).get("uid") == ref.uid else None
        self._seen[key] = (found, now)
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return found
