"""Cache-aware placement (issue 44, item 4): the worker pods the operator builds for an
object-store source, placed by the real kube-scheduler (its default profile) on the real API
server, between a node whose agent published the revision (its label) and one without it.

No kubelet: the pods are only placed, never started (what happens on the node -- the init
container holding the worker until the agent has filled and published the revision there, or only
its partial view with startOnPartialCache -- is tests/unit/test_cache_source.py's and the node
agent's tests')."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.api.types import parse_spec
from warmpool_operator.model import CacheRevision, Target
from warmpool_operator.rules import builders

from tests.support.scheduler import scheduler
from warmpool import cachekeys
from warmpool.contract.nodecache import CACHE_NODE_LABEL_VALUE

pytestmark = pytest.mark.integration

DIGEST = "sha256:" + "ef" * 32
#: Pods placed one after another (a pool growing): every one on the cached node.
PODS = 3
WITHIN_S = 30.0


def _node(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
        "kubernetes.io/hostname": name, **labels}}}


def _node_status() -> dict[str, Any]:
    """Room for many pods, Ready: as a kubelet reports an idle node."""
    room = {"cpu": "32", "memory": "128Gi", "pods": "110"}
    return {"status": {"capacity": room, "allocatable": room,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}


@pytest.fixture()
def two_nodes(api_server: ClusterHandle) -> Iterator[tuple[str, str]]:
    """A node holding the revision (its agent's label) and one without; deleted afterwards."""
    suffix = uuid.uuid4().hex[:6]
    cached, empty = f"wp-cached-{suffix}", f"wp-empty-{suffix}"
    label = {cachekeys.cache_node_label(DIGEST): CACHE_NODE_LABEL_VALUE}
    try:
        for name, labels in ((cached, label), (empty, {})):
            api_server.kubectl("create", "-f", "-", input=json.dumps(_node(name, labels)))
            api_server.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p",
                               json.dumps(_node_status()))
            # The TaintNodesByCondition admission plugin's not-ready taint, lifted as the node
            # lifecycle controller lifts it from a Ready node.
            api_server.kubectl("taint", "node", name, "node.kubernetes.io/not-ready:NoSchedule-", check=False)
        yield cached, empty
    finally:
        for name in (cached, empty):
            api_server.kubectl("delete", "node", name, "--ignore-not-found", "--wait=false", check=False)


def test_the_pools_pods_land_on_the_node_holding_the_revision(
        api_server: ClusterHandle, two_nodes: tuple[str, str], tmp_path: Path) -> None:
    cached, empty = two_nodes
    namespace = f"placement-{uuid.uuid4().hex[:6]}"
    api_server.kubectl("create", "namespace", namespace)
    api_server.kubectl("-n", namespace, "create", "serviceaccount", "default")
    spec = parse_spec({"model": {"http": {"url": "http://127.0.0.1:8080/m"}}})
    template = builders.build_pod_template(Target("m", namespace, spec, CacheRevision("/var/lib/warmpool/cache",
                                                                                       DIGEST, namespace)))
    placed: list[str] = []
    try:
        with scheduler(api_server, tmp_path / "scheduler.log"):
            for i in range(PODS):
                pod = {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {**template["metadata"], "name": f"m-{i}"}, "spec": template["spec"]}
                api_server.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(pod))
                deadline = time.monotonic() + WITHIN_S
                while not (node := api_server.kubectl("-n", namespace, "get", "pod", f"m-{i}", "-o",
                                                      "jsonpath={.spec.nodeName}").stdout):
                    assert time.monotonic() < deadline, (tmp_path / "scheduler.log").read_text()[-3000:]
                    time.sleep(0.2)
                placed.append(node)
    finally:
        api_server.kubectl("-n", namespace, "delete", "pods", "--all", "--grace-period=0", "--force", "--wait=false",
                           check=False)
        api_server.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    print(f"\nplaced on: {placed} (cached: {cached}, empty: {empty})")
    assert placed == [cached] * PODS
