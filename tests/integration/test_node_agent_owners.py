"""Which pods the node agent trusts, on a real API server (no controllers, no node: the test makes
the Deployment, the ReplicaSet and the pods a WarmModel's pool would have).

A pod pins a revision against eviction, and makes the agent fill for and wait on its WarmModel,
only when its ownerReferences lead -- each uid checked against the object the API server holds --
through a ReplicaSet and a Deployment to a WarmModel.  A tenant's bare pod with the operator's
labels and a revision annotation, or one whose ownerReferences name owners that are not (a wrong
uid, a Deployment directly), pins nothing and holds back no eviction: ``--budget-bytes`` holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import config as kube_config
from warmpool_devcluster.testing import ClusterHandle
from warmpool_nodecache.agent_kube import AgentKube
from warmpool_nodecache.agent_loop import Agent, AgentConfig
from warmpool_nodecache.fill import fill_revision
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import Manifest, build_manifest, write_manifest
from warmpool_nodecache.netguard import AddressPolicy
from warmpool_nodecache.source import HttpSource, HttpSourceConfig

from tests.integration.test_node_agent import http_warmmodel
from tests.support.owned_pods import deployment_body, owner, pod_body, replicaset_body
from tests.support.range_server import serve_directory
from warmpool.contract.api import API_GROUP_VERSION, PLURAL
from warmpool.kube import KubeError

pytestmark = pytest.mark.integration

BLOCK = 16 * 1024


@contextlib.asynccontextmanager
async def _agent(api_server: ClusterHandle, config: AgentConfig) -> AsyncIterator[Agent]:
    kube = AgentKube(await kube_config.new_client_from_config(config_file=str(api_server.kubeconfig)), config.node)
    agent = Agent(config, kube)
    try:
        yield agent
    finally:
        for known in agent.known.values():
            known.cancel()
        agent.housekeeping.close()
        await agent.first_reads.close()
        await kube.close()


async def _create(kube: AgentKube, path: str, body: dict[str, Any]) -> dict[str, Any]:
    created: dict[str, Any] = await kube.request("POST", path, body=body)
    return created


async def _ticks_until(agent: Agent, done: Callable[[], bool], within_s: float, what: str) -> None:
    """Passes of the agent, one after another, until ``done`` (bounded in time)."""
    deadline = time.monotonic() + within_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s}s: {what}")
        await agent.tick()
        await asyncio.sleep(0.2)  # a fill or a read runs beside the passes


def _revision(tmp_path: Path, seed: int) -> tuple[Path, Manifest]:
    from warmpool_dev.testing_models import make_tiny_llama

    folder = make_tiny_llama(tmp_path / "store" / f"m{seed}", layers=1, seed=seed)
    write_manifest(folder, manifest := build_manifest(folder, block_size=BLOCK))
    return folder, manifest


def _fill(cache: CacheLayout, folder: Path) -> None:
    with serve_directory(folder) as server:
        fill_revision(cache, HttpSource(HttpSourceConfig(server.url, timeout_s=10)))


async def test_a_bare_labelled_pod_pins_nothing_and_a_warmmodel_owned_pod_does(
    api_server: ClusterHandle, tmp_path: Path,
) -> None:
    namespace = f"owners-{uuid.uuid4().hex[:6]}"
    api_server.kubectl("create", "namespace", namespace)
    node = f"owners-{namespace}"
    cache = CacheLayout(tmp_path / "cache")
    (named_dir, named), (other_dir, other) = _revision(tmp_path, 21), _revision(tmp_path, 22)
    config = AgentConfig(node=node, cache_root=cache.root, namespace=namespace, lease_namespace=namespace,
                         budget_bytes=0, interval_s=1.0, lease_duration_s=5.0,
                         policy=AddressPolicy.from_flags([], ["127.0.0.1/32"]))
    pods = f"/api/v1/namespaces/{namespace}/pods"
    apps = f"/apis/apps/v1/namespaces/{namespace}"
    with serve_directory(named_dir) as server:
        async with _agent(api_server, config) as agent:
            kube = agent.kube
            with contextlib.suppress(KubeError):  # no controller makes it here: pods need it to be admitted
                await _create(kube, f"/api/v1/namespaces/{namespace}/serviceaccounts",
                              {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
            await _create(kube, "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
            body = http_warmmodel("m", server.url, node)
            body["metadata"]["namespace"] = namespace
            wm = await _create(kube, f"/apis/{API_GROUP_VERSION}/namespaces/{namespace}/{PLURAL}", body)
            deployment = await _create(kube, f"{apps}/deployments", deployment_body("m", "m", wm["metadata"]["uid"]))
            rs = await _create(kube, f"{apps}/replicasets",
                               replicaset_body("m-1", "m", "m", deployment["metadata"]["uid"]))
            # What a tenant may make by hand: the operator's labels and a revision to pin, and
            # ownerReferences that name the real owners with a wrong uid, or skip the ReplicaSet.
            for name, owners in (
                ("bare", []),
                ("wrong-uid", [owner("apps/v1", "ReplicaSet", "m-1", str(uuid.uuid4()))]),
                ("no-replicaset", [owner("apps/v1", "Deployment", "m", deployment["metadata"]["uid"])]),
            ):
                await _create(kube, pods, pod_body(name, "m", node, named.digest, owners))
            for folder in (named_dir, other_dir):
                _fill(cache, folder)
            await agent.tick()
            # Nothing on this node is the WarmModel's: nothing pinned, and the budget of 0 holds.
            assert not agent.housekeeping.pins
            assert not cache.revision(named.digest_hex).exists() and not cache.revision(other.digest_hex).exists()

            # The pod the WarmModel's ReplicaSet owns: its revision is filled for its namespace,
            # pinned, and kept while the other revision goes.
            for folder in (named_dir, other_dir):
                _fill(cache, folder)
            await _create(kube, pods, pod_body("m-1-abcde", "m", node, named.digest,
                                               [owner("apps/v1", "ReplicaSet", "m-1", rs["metadata"]["uid"])]))
            await _ticks_until(agent, lambda: not cache.revision(other.digest_hex).exists(), 60,
                               "the revision no owned pod names evicted")
            assert cache.revision(named.digest_hex).is_dir()
            assert named.digest_hex in agent.housekeeping.pins
            assert cache.granted_link(named.digest_hex, namespace).is_dir()  # verified from its own source
    api_server.kubectl("delete", "namespace", namespace, "--wait=false")
    api_server.kubectl("delete", "node", node, "--wait=false", check=False)
