"""The node agent's API-server access (the shared JSON client, ``warmpool.kube``), and the fill Lease.

Only the agent modules import this (the cache core stays standard-library only).  Like the
operator it calls the API by path and works with plain dicts; every request is bounded in time.

The fill Lease (:func:`agent_lease` under :func:`lease_name`) guards one (node, revision) fill
across agents: a ``coordination.k8s.io`` Lease (``warmpool.lease``) whose version only ever
grows, by one at each take-over, and whose every write is made at the resourceVersion read, so
two agents racing get one success and one 409, never two holders.  A holder checks itself (its
fence) before it publishes: it renews at the version it holds, and a holder whose last renewal
is older than the lease's duration, or whose renewal is refused (taken over by a higher
version), gets LeaseLostError and publishes nothing.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any

import aiohttp

from warmpool.contract.api import API_GROUP, API_GROUP_VERSION, API_VERSION, PLURAL
from warmpool.contract.pods import LABEL_MANAGED_BY, MANAGED_BY
from warmpool.kube import (
    APPLY_PATCH,
    MERGE_PATCH,
    KubeClient,
    KubeError,
    Obj,
    client_from_environment,
    micro_time,
)
from warmpool.lease import Lease, Observed

#: Prefix of the coordination.k8s.io Lease guarding one (node, revision) fill.
FILL_LEASE_PREFIX = "warmpool-fill"
#: Field manager of a node agent's server-side apply of its WarmModel status entry; one per node
#: (``<this>.<node-hash>``), so one agent's apply never drops another node's entry.
NODE_AGENT_FIELD_MANAGER = "warmpool-node-agent"


#: A watch lasts WATCH_SECONDS (the server ends it) and is then opened again; a silent stream
#: is given up after sock_read seconds.
WATCH_SECONDS = 50
WATCH_TIMEOUT = aiohttp.ClientTimeout(total=WATCH_SECONDS + 15, connect=5.0, sock_read=WATCH_SECONDS + 10)
WARMMODELS = f"/apis/{API_GROUP}/{API_VERSION}"
LEASES = "/apis/coordination.k8s.io/v1"


def field_manager(node: str) -> str:
    """This node's agent's field manager: one per node, so an agent's apply never drops another's entry."""
    return f"{NODE_AGENT_FIELD_MANAGER}.{hashlib.sha256(node.encode()).hexdigest()[:12]}"


class AgentKube(KubeClient):
    """JSON access to the API server for one agent process (the shared client, warmpool.kube)."""

    def __init__(self, api_client: Any, node: str) -> None:
        super().__init__(api_client)
        self.node = node
        self.manager = field_manager(node)

    @classmethod
    async def connect(cls, node: str) -> AgentKube:
        """In-cluster config in a pod, else the kubeconfig ($KUBECONFIG honoured)."""
        return cls(await client_from_environment(), node)

    @staticmethod
    def warmmodels_path(namespace: str | None) -> str:
        scope = f"/namespaces/{namespace}" if namespace else ""
        return f"{WARMMODELS}{scope}/{PLURAL}"

    def pods_here_query(self, namespace: str | None) -> tuple[str, dict[str, str]]:
        """Where the worker pods bound to this node are listed: by the operator's managed-by label, a
        filter only -- anyone may label a pod; whose a pod is, ``agent_owners`` checks."""
        path = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
        return path, {"fieldSelector": f"spec.nodeName={self.node}",
                      "labelSelector": f"{LABEL_MANAGED_BY}={MANAGED_BY}"}

    async def warmmodels(self, namespace: str | None) -> list[Obj]:
        items: list[Obj] = (await self.request("GET", self.warmmodels_path(namespace))).get("items") or []
        return items

    async def pods_here(self, namespace: str | None) -> list[Obj]:
        path, query = self.pods_here_query(namespace)
        items: list[Obj] = (await self.request("GET", path, query=query)).get("items") or []
        return items

    async def watch_events(self, path: str, query: Mapping[str, str]) -> AsyncIterator[str]:
        """The types of the watch events on ``path`` (ADDED for what exists, then changes) until
        the server ends the watch after WATCH_SECONDS.  Only wake-ups: each pass lists anew."""
        params = {**query, "watch": "1", "timeoutSeconds": str(WATCH_SECONDS)}
        response = await self.api_client.call_api(
            path, "GET", query_params=list(params.items()), header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"], _preload_content=False, _request_timeout=WATCH_TIMEOUT,
        )
        try:
            if int(response.status) >= 300:
                raise KubeError(int(response.status), "", (await response.read()).decode(errors="replace")[:500])
            async for line in response.content:
                if line.strip():
                    yield str(json.loads(line).get("type"))
        finally:
            response.release()

    async def config_map_key(self, namespace: str, name: str, key: str) -> str | None:
        try:
            cm = await self.request("GET", f"/api/v1/namespaces/{namespace}/configmaps/{name}")
        except KubeError as error:
            if error.status == 404:
                return None
            raise
        value = (cm.get("data") or {}).get(key)
        return value if isinstance(value, str) else None

    async def node_labels(self) -> dict[str, str]:
        node = await self.request("GET", f"/api/v1/nodes/{self.node}")
        return dict((node.get("metadata") or {}).get("labels") or {})

    async def patch_node_labels(self, patch: Mapping[str, str | None]) -> None:
        await self.request("PATCH", f"/api/v1/nodes/{self.node}", body={"metadata": {"labels": dict(patch)}},
                           content_type=MERGE_PATCH)

    async def emit_event(self, involved: Mapping[str, str], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about ``involved`` (apiVersion, kind, name, uid; namespace when namespaced:
        the Event goes there, a cluster-scoped object's into ``default``, as the kubelet's do)."""
        now = micro_time(datetime.now(UTC))
        namespace = involved.get("namespace") or "default"
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{involved.get('name', 'object')[:200]}.", "namespace": namespace},
            "involvedObject": dict(involved), "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": NODE_AGENT_FIELD_MANAGER, "host": self.node},
            "reportingComponent": NODE_AGENT_FIELD_MANAGER, "reportingInstance": self.node[:128],
            "firstTimestamp": now[:19] + "Z", "lastTimestamp": now[:19] + "Z", "count": 1,
        }
        await self.request("POST", f"/api/v1/namespaces/{namespace}/events", body=body)

    async def apply_cache_entry(self, namespace: str, name: str, entry: Mapping[str, Any]) -> None:
        """Server-side apply of this node's status.cacheNodes entry, as this node's field manager."""
        body = {"apiVersion": API_GROUP_VERSION, "kind": "WarmModel",
                "metadata": {"name": name, "namespace": namespace}, "status": {"cacheNodes": [dict(entry)]}}
        await self.request("PATCH", f"{WARMMODELS}/namespaces/{namespace}/{PLURAL}/{name}/status",
                           body=body, query={"fieldManager": self.manager, "force": "true"},
                           content_type=APPLY_PATCH)


def lease_name(node: str, digest: str) -> str:
    """``warmpool-fill-<node hash>-<digest prefix>``: a DNS-1123 name for any node name."""
    node_hash = hashlib.sha256(node.encode()).hexdigest()[:12]
    return f"{FILL_LEASE_PREFIX}-{node_hash}-{digest.removeprefix('sha256:')[:32]}"


#: The Lease one agent holds while it reads a WarmModel's manifest for no pod of its own (the
#: first digest, before any pod exists): only the agents' own name, the operator never reads it.
READ_LEASE_PREFIX = "warmpool-read"


def read_lease_name(uid: str) -> str:
    """``warmpool-read-<WarmModel uid hash>``: one per WarmModel, whatever its source."""
    return f"{READ_LEASE_PREFIX}-{hashlib.sha256(uid.encode()).hexdigest()[:32]}"


def agent_lease(kube: AgentKube, namespace: str, name: str, duration_s: float, observed: Observed) -> Lease:
    """One attempt of this agent at the Lease ``name`` (the shared implementation,
    ``warmpool.lease``): a fresh identity per attempt, so a later attempt of the same agent takes
    the Lease over at a higher version instead of renewing an abandoned one.  ``observed`` is what
    the agent saw of that Lease in its earlier attempts (expiry is judged by the agent's own clock)."""
    return Lease(kube, namespace, name, f"{kube.node}/{uuid.uuid4().hex[:12]}", duration_s,
                 field_manager=kube.manager, observed=observed)
