"""The node agent's API-server access (the shared JSON client, ``warmpool.kube``), and the fill Lease.

Only the agent modules import this (the cache core stays standard-library only).  Like the
operator it calls the API by path and works with plain dicts; every request is bounded in time.

The fill Lease (:class:`FillLease`) guards one (node, revision) fill across agents: a
``coordination.k8s.io`` Lease whose ``spec.leaseTransitions`` is the version -- it only ever
grows, by one at each take-over -- and whose every write is made at the resourceVersion read,
so two agents racing get one 201/200 and one 409, never two holders.  A holder checks itself
(:meth:`FillLease.fence`) before it publishes: it renews at the version it holds, and a holder
whose last renewal is older than the lease's duration, or whose renewal is refused (taken over
by a higher version), gets LeaseLostError and publishes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp

from warmpool import contract
from warmpool.kube import (
    APPLY_PATCH,
    MERGE_PATCH,
    KubeClient,
    KubeError,
    Obj,
    client_from_environment,
    micro_time,
    parse_micro_time,
)
from warmpool_nodecache.lease import LeaseLostError

#: A watch lasts WATCH_SECONDS (the server ends it) and is then opened again; a silent stream
#: is given up after sock_read seconds.
WATCH_SECONDS = 50
WATCH_TIMEOUT = aiohttp.ClientTimeout(total=WATCH_SECONDS + 15, connect=5.0, sock_read=WATCH_SECONDS + 10)
WARMMODELS = f"/apis/{contract.API_GROUP}/{contract.API_VERSION}"
LEASES = "/apis/coordination.k8s.io/v1"


def field_manager(node: str) -> str:
    """This node's agent's field manager: one per node, so an agent's apply never drops another's entry."""
    return f"{contract.NODE_AGENT_FIELD_MANAGER}.{hashlib.sha256(node.encode()).hexdigest()[:12]}"


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
        return f"{WARMMODELS}{scope}/{contract.PLURAL}"

    def pods_here_query(self, namespace: str | None) -> tuple[str, dict[str, str]]:
        """Where the worker pods bound to this node are listed (the operator's, by their managed-by label)."""
        path = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
        return path, {"fieldSelector": f"spec.nodeName={self.node}",
                      "labelSelector": f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY}"}

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
            "source": {"component": contract.NODE_AGENT_FIELD_MANAGER, "host": self.node},
            "reportingComponent": contract.NODE_AGENT_FIELD_MANAGER, "reportingInstance": self.node[:128],
            "firstTimestamp": now[:19] + "Z", "lastTimestamp": now[:19] + "Z", "count": 1,
        }
        await self.request("POST", f"/api/v1/namespaces/{namespace}/events", body=body)

    async def apply_cache_entry(self, namespace: str, name: str, entry: Mapping[str, Any]) -> None:
        """Server-side apply of this node's status.cacheNodes entry, as this node's field manager."""
        body = {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": "WarmModel",
                "metadata": {"name": name, "namespace": namespace}, "status": {"cacheNodes": [dict(entry)]}}
        await self.request("PATCH", f"{WARMMODELS}/namespaces/{namespace}/{contract.PLURAL}/{name}/status",
                           body=body, query={"fieldManager": self.manager, "force": "true"},
                           content_type=APPLY_PATCH)


def lease_name(node: str, digest: str) -> str:
    """``warmpool-fill-<node hash>-<digest prefix>``: a DNS-1123 name for any node name."""
    node_hash = hashlib.sha256(node.encode()).hexdigest()[:12]
    return f"{contract.FILL_LEASE_PREFIX}-{node_hash}-{digest.removeprefix('sha256:')[:32]}"


#: The Lease one agent holds while it reads a WarmModel's manifest for no pod of its own (the
#: first digest, before any pod exists): only the agents' own name, the operator never reads it.
READ_LEASE_PREFIX = "warmpool-read"


def read_lease_name(uid: str) -> str:
    """``warmpool-read-<WarmModel uid hash>``: one per WarmModel, whatever its source."""
    return f"{READ_LEASE_PREFIX}-{hashlib.sha256(uid.encode()).hexdigest()[:32]}"


class FillLease:
    """One agent's attempt at the (node, revision) fill Lease (see the module docstring); with a
    ``name`` of its own, any other Lease the agents take the same way (the read Lease)."""

    def __init__(self, kube: AgentKube, namespace: str, node: str, digest: str, duration_s: float,
                 name: str | None = None) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name or lease_name(node, digest)
        self.duration_s = max(1, round(duration_s))
        self.identity = f"{node}/{uuid.uuid4().hex[:12]}"
        self.version: int | None = None
        self._renewed = 0.0  # monotonic time of the last successful write
        self._body: Obj | None = None
        # The renewer task and the fill's fence both renew: one write at a time, or the second
        # would carry a stale resourceVersion and read its own 409 as a take-over.
        self._writing = asyncio.Lock()

    @property
    def _path(self) -> str:
        return f"{LEASES}/namespaces/{self.namespace}/leases"

    @property
    def renewed_at(self) -> float:
        """``time.monotonic()`` of the last write that took or renewed the Lease."""
        return self._renewed

    def _expired(self, lease: Mapping[str, Any], now: datetime) -> bool:
        spec = lease.get("spec") or {}
        if not spec.get("holderIdentity"):
            return True  # released
        renewed = parse_micro_time(spec.get("renewTime")) or parse_micro_time(spec.get("acquireTime"))
        return renewed is None or now - renewed > timedelta(seconds=float(spec.get("leaseDurationSeconds") or 0))

    async def try_acquire(self) -> bool:
        """Take the Lease if it is absent, released or expired; the version goes up by one."""
        now = datetime.now(UTC)
        try:
            lease = await self.kube.request("GET", f"{self._path}/{self.name}")
        except KubeError as error:
            if error.status != 404:
                raise
            lease = None
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": self.duration_s,
                "acquireTime": micro_time(now), "renewTime": micro_time(now)}
        try:
            if lease is None:
                body: Obj = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                             "metadata": {"name": self.name, "namespace": self.namespace},
                             "spec": {**spec, "leaseTransitions": 1}}
                self._body = await self.kube.request("POST", self._path, body=body,
                                                     query={"fieldManager": self.kube.manager})
            else:
                if not self._expired(lease, now):
                    return False
                version = int((lease.get("spec") or {}).get("leaseTransitions") or 0) + 1
                body = {**lease, "spec": {**(lease.get("spec") or {}), **spec, "leaseTransitions": version}}
                self._body = await self.kube.request("PUT", f"{self._path}/{self.name}", body=body,
                                                     query={"fieldManager": self.kube.manager})
        except KubeError as error:
            if error.status in (409, 422):
                return False  # another agent wrote first
            raise
        self.version = int(self._body["spec"]["leaseTransitions"])
        self._renewed = time.monotonic()
        return True

    async def renew(self) -> None:
        """Renew at the version held; LeaseLostError when it expired here or was taken over."""
        async with self._writing:
            await self._renew()

    async def _renew(self) -> None:
        if self.version is None or self._body is None:
            raise LeaseLostError(f"fill Lease {self.namespace}/{self.name}: not held")
        if time.monotonic() - self._renewed > self.duration_s:
            late = time.monotonic() - self._renewed - self.duration_s
            raise LeaseLostError(f"fill Lease {self.name}: version {self.version} expired {late:.1f}s ago")
        body = {**self._body, "spec": {**self._body["spec"], "renewTime": micro_time(datetime.now(UTC))}}
        try:
            self._body = await self.kube.request("PUT", f"{self._path}/{self.name}", body=body,
                                                 query={"fieldManager": self.kube.manager})
        except KubeError as error:
            if error.status in (404, 409):
                self.version = None
                raise LeaseLostError(f"fill Lease {self.name}: taken over ({error})") from None
            raise
        self._renewed = time.monotonic()

    async def release(self) -> None:
        """Give the Lease up (the version stays recorded); a lost Lease is left alone."""
        async with self._writing:
            await self._release()

    async def _release(self) -> None:
        if self.version is None or self._body is None:
            return
        spec = {k: v for k, v in self._body["spec"].items() if k != "holderIdentity"}
        body = {**self._body, "spec": spec}
        with contextlib.suppress(KubeError):  # taken over or gone: either way no longer ours
            await self.kube.request("PUT", f"{self._path}/{self.name}", body=body,
                                    query={"fieldManager": self.kube.manager})
        self.version = None
