"""The control-layer tests' real backend: an API server that runs no controllers (``warmpool cluster
up --node-runtime none``), the operator's own client recording what it sends, and the watches,
the Deployment controller and the kubelet played by the test (see control_doubles.py).  Every
read and write the operator makes is the real server's: validation, resourceVersions, 409s,
server-side apply, the status subresource."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes_asyncio import config
from warmpool_operator.io import kube as k
from warmpool_operator.io.kube import Kube
from warmpool_operator.io.watch_cache import MANAGED
from warmpool_operator.model import Obj

from tests.support.control_doubles import CHILD_KINDS, PATH, ControlCluster, TestKube
from warmpool.contract.api import KIND, PLURAL
from warmpool.kube import MERGE_PATCH, KubeError

#: plural -> (Kind, the kind a watch event names)
KINDS: dict[str, tuple[k.Kind, str]] = {
    "deployments": (k.DEPLOYMENTS, "Deployment"), "replicasets": (k.REPLICASETS, "ReplicaSet"),
    "services": (k.SERVICES, "Service"), "configmaps": (k.CONFIGMAPS, "ConfigMap"),
    "secrets": (k.SECRETS, "Secret"), "pods": (k.PODS, "Pod"),
    "poddisruptionbudgets": (k.PDBS, "PodDisruptionBudget"), "endpointslices": (k.ENDPOINTSLICES, "EndpointSlice"),
    "networkpolicies": (k.NETWORKPOLICIES, "NetworkPolicy"),
    PLURAL: (k.WARMMODELS, KIND),
}
#: who the test's own edits are by: someone else, by hand
EDITOR = "test-editor"


class RecordingKube(TestKube):
    async def request(self, method: str, path: str, body: Any = None, query: Mapping[str, str] | None = None,
                      content_type: str = "application/json") -> Obj:
        match = PATH.match(path)
        assert match is not None, f"a path outside a namespace: {path}"
        self.record(method, match["plural"], match["name"], match["sub"], body)
        return await super().request(method, path, body, query, content_type)

    async def _unrecorded(self, method: str, path: str, body: Any = None, query: Mapping[str, str] | None = None,
                          content_type: str = "application/json") -> Obj:
        return await Kube.request(self, method, path, body, query, content_type)

    async def put(self, plural: str, obj: Mapping[str, Any]) -> Obj:
        kind = KINDS[plural][0]
        meta = obj["metadata"]
        query = {"fieldManager": EDITOR}
        if meta.get("resourceVersion"):
            stored = await self._unrecorded("PUT", kind.path(meta["namespace"], meta["name"]), dict(obj), query)
        else:
            stored = await self._unrecorded("POST", kind.path(meta["namespace"]), dict(obj), query)
        if obj.get("status"):
            stored = await self._unrecorded("PATCH", kind.path(meta["namespace"], meta["name"], "status"),
                                            {"status": obj["status"]}, query, MERGE_PATCH)
        return stored

    async def get_obj(self, plural: str, namespace: str, name: str) -> Obj | None:
        try:
            return await self._unrecorded("GET", KINDS[plural][0].path(namespace, name))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def delete_obj(self, plural: str, namespace: str, name: str) -> None:
        await self._unrecorded("DELETE", KINDS[plural][0].path(namespace, name))


class ApiCluster(ControlCluster):
    """A namespace of its own on the real API server."""

    def __init__(self, kube: RecordingKube, namespace: str) -> None:
        super().__init__(namespace)
        self.kube: RecordingKube = kube

    @classmethod
    async def open(cls, kubeconfig: Path) -> ApiCluster:
        kube = RecordingKube(await config.new_client_from_config(config_file=str(kubeconfig)))
        namespace = f"team-{uuid.uuid4().hex[:8]}"
        await Kube.request(kube, "POST", "/api/v1/namespaces",
                           {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        # What the service-account controller would make: pods are admitted only with it.
        await Kube.request(kube, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                           {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
        return cls(kube, namespace)

    # close: the namespace stays (deleting one needs the namespace controller, which this server lacks).

    async def watch(self) -> None:
        """What the label-filtered watches show: each kind listed by label, each object with its
        kind (a list leaves it out of its items)."""
        selector = ",".join(f"{key}={value}" for key, value in MANAGED.items())
        objects: list[Obj] = []
        for plural in (*CHILD_KINDS.values(), "replicasets", "pods"):
            kind, name = KINDS[plural]
            found = await self.kube._unrecorded("GET", kind.path(self.namespace), query={"labelSelector": selector})
            version = kind.prefix.removeprefix("/apis/").removeprefix("/api/")
            objects += [{**item, "kind": name, "apiVersion": version} for item in found.get("items") or []]
        self.index(objects)
