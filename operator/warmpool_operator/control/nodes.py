"""The Node watch: which nodes are lost or cordoned (rules/node_health.py), kept on the board every
pass reads, and a pass for each pool with a pod on a node whose state changed.  Beside it, the watch
of the nodes' Leases, which finds a node whose kubelet went quiet sooner than its Ready condition
does (rules/node_leases.py).

Nodes are cluster-scoped: an operator installed for some namespaces only may not be allowed to
read them.  It then says so once and treats every node as healthy -- pods on a lost node wait for
Kubernetes' own eviction (300 s by default), and a drain is held by the PDB alone -- instead of
failing or retrying a forbidden watch for ever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp

from warmpool.kube import KubeClient, KubeError
from warmpool_operator.io.list_watch import list_watch
from warmpool_operator.io.watch_cache import Cache, model_key
from warmpool_operator.rules.node_health import NodeBoard
from warmpool_operator.rules.node_leases import NodeLeases

log = logging.getLogger("warmpool.operator")

NODES_PATH = "/api/v1/nodes"
#: Where each kubelet renews its node's Lease (named after the node).
NODE_LEASES_PATH = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
#: What the operator says, once, when it may not read Nodes.
FORBIDDEN_MESSAGE = (
    "cannot read Nodes (%s): every node is treated as healthy, so pods on a lost node are replaced only "
    "after Kubernetes evicts them and pods on a cordoned node are not replaced ahead of a drain; grant "
    "get/list/watch on nodes (the chart's ClusterRole does) to act on node loss and drains"
)
LEASES_FORBIDDEN_MESSAGE = (
    "cannot read the nodes' Leases in kube-node-lease (%s): a node whose kubelet stops is noticed only "
    "once Kubernetes marks it NotReady (50 s and more); grant get/list/watch on leases there (the "
    "chart's Role in kube-node-lease does) to notice it in 15-35 s"
)


async def readable(kube: KubeClient, path: str, forbidden_message: str) -> bool:
    """Whether the collection at ``path`` may be read; says ``forbidden_message`` once when not.
    Any other failure counts as readable: the watch lists again until it works."""
    try:
        await kube.request("GET", path, query={"limit": "1"})
    except KubeError as error:
        if error.status in (401, 403):
            log.warning(forbidden_message, f"HTTP {error.status}")
            return False
    except (aiohttp.ClientError, TimeoutError, OSError):
        pass
    return True


async def follow_nodes(kube: KubeClient, board: NodeBoard, changed: Callable[[set[str]], None]) -> None:
    """Keep ``board`` in step with the cluster's Nodes and call ``changed`` with the names whose
    state changed; runs until cancelled, or returns at once (``board.readable`` False) when Nodes
    may not be read."""
    if not await readable(kube, NODES_PATH, FORBIDDEN_MESSAGE):
        board.readable = False
        return

    def on_event(event_type: str, node: Mapping[str, Any]) -> None:
        if board.update(event_type, node):
            changed({str((node.get("metadata") or {}).get("name"))})

    def on_list() -> None:  # the list that follows brings back what is still there
        known = board.clear()
        if known:
            changed(known)

    await list_watch(kube, NODES_PATH, None, on_event, on_list, asyncio.Event())


async def follow_node_leases(kube: KubeClient, board: NodeBoard, changed: Callable[[set[str]], None],
                            grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
    """Keep ``board.silent`` to the nodes whose Lease renewals stopped for ``grace_s`` while
    another node's went on, and call ``changed`` with the names that fell silent or renewed again;
    runs until cancelled, or returns at once when the Leases may not be read."""
    if not await readable(kube, NODE_LEASES_PATH, LEASES_FORBIDDEN_MESSAGE):
        return
    leases = NodeLeases()

    def on_event(event_type: str, lease: Mapping[str, Any]) -> None:
        leases.update(event_type, lease, clock())
        news = leases.judge(grace_s)
        if news:
            board.silent = set(leases.silent)
            for name in sorted(news):
                if name in leases.silent:
                    log.warning("node %s renewed no Lease for %g s while others did: its pods are replaced",
                                name, grace_s)
                else:
                    log.info("node %s renews its Lease again", name)
            changed(news)

    await list_watch(kube, NODE_LEASES_PATH, None, on_event, leases.relist, asyncio.Event())


def pools_on(cache: Cache | None, nodes: Iterable[str]) -> set[tuple[str, str]]:
    """(namespace, WarmModel) of every pool with a worker pod bound to one of ``nodes``."""
    names = set(nodes)
    found: set[tuple[str, str]] = set()
    if cache is None or not names:
        return found
    for pod in cache.held("Pod"):
        if str((pod.get("spec") or {}).get("nodeName") or "") in names:
            meta = pod.get("metadata") or {}
            key = model_key(meta.get("namespace"), meta.get("labels") or {})
            if key is not None:
                found.add(key)
    return found
