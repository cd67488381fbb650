"""A resync finds what was deleted while a watch was down (resync.py, #14), on the real API server.

kopf's indexes are stood in for by plain mappings of the same shape (key -> the objects held),
filled with objects read back from the API server; the deletions are real.  Which of them a
resync reports, hides and restores through which WarmModel is what these check; the whole loop
(an API server restart, the operator's watches listing again) is
test_operator_watch_restart.py's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes_asyncio import config
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.control import resync
from warmpool_operator.control.registry import Registry
from warmpool_operator.io.kube import CONFIGMAPS, Kube
from warmpool_operator.io.watch_cache import Cache

from tests.support.e2e import warmmodel
from warmpool.contract.api import KIND, PLURAL
from warmpool.contract.pods import LABEL_MANAGED_BY, LABEL_MODEL, MANAGED_BY

pytestmark = pytest.mark.integration

T = TypeVar("T")
Obj = dict[str, Any]


def _run(cluster: ClusterHandle, action: Callable[[Kube], Awaitable[T]]) -> T:
    async def main() -> T:
        kube = Kube(await config.new_client_from_config(config_file=str(cluster.kubeconfig)))
        try:
            return await action(kube)
        finally:
            await kube.close()

    return asyncio.run(main())


def _configmap(namespace: str, name: str, owner: Obj | None = None) -> Obj:
    meta: Obj = {"name": name, "namespace": namespace,
                 "labels": {LABEL_MANAGED_BY: MANAGED_BY, LABEL_MODEL: "m"}}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": owner["apiVersion"], "kind": KIND,
                                    "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"]}]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"k": name}}


def _cache(configmaps: list[Obj]) -> Cache:
    held: dict[Any, list[Obj]] = {}
    for obj in configmaps:
        held.setdefault((obj["metadata"]["namespace"], obj["metadata"]["name"]), []).append(obj)
    children: dict[str, Any] = {"Deployment": {}, "Service": {}, "ConfigMap": held, "PodDisruptionBudget": {}}
    return Cache(children=children, replicasets={}, pods={})  # type: ignore[arg-type]


def test_deleted_and_replaced_objects_are_reported_and_live_ones_are_not(cluster: ClusterHandle,
                                                                         namespace: str) -> None:
    async def scenario(kube: Kube) -> tuple[list[tuple[str, str, str]], Obj]:
        made = {name: await kube.create(_configmap(namespace, name)) for name in ("kept", "deleted", "replaced")}
        cache = _cache(list(made.values()))
        await kube.request("DELETE", CONFIGMAPS.path(namespace, "deleted"))
        await kube.request("DELETE", CONFIGMAPS.path(namespace, "replaced"))
        newer = await kube.create(_configmap(namespace, "replaced"))  # the same name, another uid
        found = await resync.deleted_children(kube, cache)
        return [(d.kind, d.name, d.obj["metadata"]["uid"]) for d in found], {"made": made, "newer": newer}

    found, objs = _run(cluster, scenario)
    made = objs["made"]
    assert sorted(found) == sorted([("ConfigMap", "deleted", made["deleted"]["metadata"]["uid"]),
                                    ("ConfigMap", "replaced", made["replaced"]["metadata"]["uid"])])
    assert objs["newer"]["metadata"]["uid"] != made["replaced"]["metadata"]["uid"]


class Recorder:
    """What the registry does to a WarmModel's reconciler in a resync: poke it or stop it."""

    def __init__(self, body: Obj) -> None:
        self.body = body
        self.pokes = 0
        self.stopped = False

    @property
    def uid(self) -> str:
        return str(self.body["metadata"]["uid"])

    def poke(self) -> None:
        self.pokes += 1

    async def stop(self, *, save: bool = False) -> None:
        self.stopped = True


def test_a_resync_hides_what_went_pokes_its_warmmodel_and_stops_a_deleted_one(
    cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path
) -> None:
    for name in ("kept", "gone"):
        manifest = tmp_path / f"{name}.json"
        manifest.write_text(json.dumps(warmmodel(name, tmp_path)))
        cluster.kubectl("-n", namespace, "create", "-f", str(manifest))
    bodies = {name: json.loads(cluster.kubectl("-n", namespace, "get", PLURAL, name, "-o", "json").stdout)
              for name in ("kept", "gone")}

    async def scenario(kube: Kube) -> tuple[Registry, dict[str, Recorder], Cache, list[Obj]]:
        child = await kube.create(_configmap(namespace, "kept-config", owner=bodies["kept"]))
        sibling = await kube.create(_configmap(namespace, "kept-other", owner=bodies["kept"]))
        registry = Registry(kube=kube, workers=None, scheduler=None)  # type: ignore[arg-type]
        cache = _cache([child, sibling])
        registry.cache = Cache(children=cache.children, replicasets=cache.replicasets, pods=cache.pods,
                               gone=registry.gone)
        recorders = {name: Recorder(body) for name, body in bodies.items()}
        registry.by_key.update({(namespace, name): rec for name, rec in recorders.items()})  # type: ignore[misc]
        await kube.request("DELETE", CONFIGMAPS.path(namespace, "kept-config"))
        cluster.kubectl("-n", namespace, "delete", PLURAL, "gone", "--wait=true", "--timeout=60s")
        await registry.resync()
        return registry, recorders, registry.cache, [child, sibling]

    registry, recorders, cache, (child, sibling) = _run(cluster, scenario)
    assert registry.gone == {child["metadata"]["uid"]}
    assert cache.child("ConfigMap", namespace, "kept-config") is None, "the deleted child is still served"
    assert cache.child("ConfigMap", namespace, "kept-other") == sibling
    assert recorders["kept"].pokes == 1 and not recorders["kept"].stopped
    assert recorders["gone"].stopped and (namespace, "gone") not in registry.by_key
    assert (namespace, "kept") in registry.by_key
