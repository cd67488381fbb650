"""The node agent's warnings as Kubernetes Events, so a failure reaches ``kubectl describe`` and
the operator's dashboards, not only the agent's log.

A warning about one WarmModel goes on the WarmModel (its ``status.cacheNodes`` entry says it
too); one about the agent itself -- a failed pass, a watch that broke, an eviction that could not
run, a cached manifest that no longer parses -- goes on this node's Node object.  The same
warning is said again only when its text changes or after ``RESAY_S``, so a fault that lasts
does not flood the API server with one Event per pass.  Emitting is best effort: an API server
that refuses the Event (no RBAC for it, say) costs one log line, never the pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from warmpool.contract.api import API_GROUP_VERSION, KIND
from warmpool_nodecache.agent import ModelRef
from warmpool_nodecache.agent_kube import AgentKube

log = logging.getLogger("warmpool.node_agent")

#: Seconds before a warning that has not changed is said again.
RESAY_S = 600.0
#: Keys remembered at most (the oldest forgotten first): bounds the memory of a flapping cluster.
MAX_REMEMBERED = 4096

REASON_READ_FAILED = "NodeCacheReadFailed"
REASON_FILL_FAILED = "NodeCacheFillFailed"
REASON_PASS_FAILED = "NodeAgentPassFailed"
REASON_WATCH_FAILED = "NodeAgentWatchFailed"
REASON_EVICTION_FAILED = "NodeCacheEvictionFailed"
REASON_MANIFEST_UNREADABLE = "NodeCacheManifestUnreadable"
REASON_CLUSTER_NETWORKS_FAILED = "NodeAgentClusterNetworksFailed"


class Notices:
    def __init__(self, kube: AgentKube, node: str) -> None:
        self.kube, self.node = kube, node
        self._said: dict[tuple[str, str, str], tuple[str, float]] = {}
        self._refused_logged = False

    def node_object(self) -> dict[str, str]:
        # The kubelet's own Node Events carry the node's name as its uid: `kubectl describe node` finds them.
        return {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self.node}

    @staticmethod
    def model_object(ref: ModelRef) -> dict[str, str]:
        return {"apiVersion": API_GROUP_VERSION, "kind": KIND,
                "name": ref.name, "namespace": ref.namespace, "uid": ref.uid}

    async def warn(self, involved: Mapping[str, str], reason: str, message: str, topic: str = "") -> None:
        """Say ``message`` unless it was just said; ``topic`` keeps apart warnings of one reason
        about different things (two failing steps would otherwise re-say each other)."""
        key = (involved.get("uid") or involved.get("name") or "", reason, topic)
        said = self._said.get(key)
        now = time.monotonic()
        if said is not None and said[0] == message and now - said[1] < RESAY_S:
            return
        self._said.pop(key, None)
        self._said[key] = (message, now)
        while len(self._said) > MAX_REMEMBERED:
            self._said.pop(next(iter(self._said)))
        try:
            await self.kube.emit_event(involved, "Warning", reason, f"node {self.node}: {message}")
        except Exception as error:  # best effort (see the module docstring)
            if not self._refused_logged:
                self._refused_logged = True
                log.warning("node agent: cannot emit Events (%s: %s); warnings go to this log only",
                            type(error).__name__, error)

    def clear(self, involved: Mapping[str, str], reason: str, topic: str = "") -> None:
        """The warning is over: the next one of its kind is said at once."""
        self._said.pop((involved.get("uid") or involved.get("name") or "", reason, topic), None)
