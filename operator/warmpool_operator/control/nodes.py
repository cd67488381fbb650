"""The Node watch: which nodes are lost or cordoned (rules/node_health.py), kept on the board every
pass reads, and a pass for each pool with a pod on a node whose state changed.

Nodes are cluster-scoped: an operator installed for some namespaces only may not be allowed to
read them.  It then says so once and treats every node as healthy -- pods on a lost node wait for
Kubernetes' own eviction (300 s by default), and a drain is held by the PDB alone -- instead of
failing or retrying a forbidden watch for ever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp

from warmpool.kube import KubeClient, KubeError
from warmpool_operator.io.list_watch import list_watch
from warmpool_operator.io.watch_cache import Cache, model_key
from warmpool_operator.rules.node_health import NodeBoard

log = logging.getLogger("warmpool.operator")

NODES_PATH = "/api/v1/nodes"
#: What the operator says, once, when it may not read Nodes.
FORBIDDEN_MESSAGE = (
    "cannot read Nodes (%s): every node is treated as healthy, so pods on a lost node are replaced only "
    "after Kubernetes evicts them and pods on a cordoned node are not replaced ahead of a drain; grant "
    "get/list/watch on nodes (the chart's ClusterRole does) to act on node loss and drains"
)


async def follow_nodes(kube: KubeClient, board: NodeBoard, changed: Callable[[set[str]], None]) -> None:
    """Keep ``board`` in step with the cluster's Nodes and call ``changed`` with the names whose
    state changed; runs until cancelled, or returns at once (``board.readable`` False) when Nodes
    may not be read."""
    try:
        await kube.request("GET", NODES_PATH, query={"limit": "1"})
    except KubeError as error:
        if error.status in (401, 403):
            board.readable = False
            log.warning(FORBIDDEN_MESSAGE, f"HTTP {error.status}")
            return
        # Anything else may pass: the watch below lists again until it works.
    except (aiohttp.ClientError, TimeoutError, OSError):
        pass

    def on_event(event_type: str, node: Mapping[str, Any]) -> None:
        if board.update(event_type, node):
            changed({str((node.get("metadata") or {}).get("name"))})

    def on_list() -> None:  # the list that follows brings back what is still there
        known = board.clear()
        if known:
            changed(known)

    await list_watch(kube, NODES_PATH, None, on_event, on_list, asyncio.Event())


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
