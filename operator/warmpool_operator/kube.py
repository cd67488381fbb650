"""A thin JSON-in, JSON-out layer over ``kubernetes_asyncio``'s ApiClient.

The operator works with plain dicts (its builders produce them, kopf hands them in), so it
calls the API by path through the official client's ``call_api`` (auth, TLS and kubeconfig
handled there) and gets raw JSON back.  Non-2xx answers raise :class:`KubeError` carrying
the status code, so callers can tell 404 / 409 / 422 apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config

Obj = dict[str, Any]

#: Every API call is bounded in time (connect, read) seconds.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=30.0, connect=5.0)

MERGE_PATCH = "application/merge-patch+json"
#: Server-side apply: JSON is YAML, so the body is sent as JSON under this content type.
APPLY_PATCH = "application/apply-patch+yaml"
#: The field manager of every write the operator makes (server-side apply and plain writes alike).
FIELD_MANAGER = "warmpool-operator"


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Kind:
    """Where a kind lives in the API: group path prefix and plural."""

    prefix: str  # "/api/v1" or "/apis/apps/v1"
    plural: str

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        path = f"{self.prefix}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


DEPLOYMENTS = Kind("/apis/apps/v1", "deployments")
REPLICASETS = Kind("/apis/apps/v1", "replicasets")
SERVICES = Kind("/api/v1", "services")
CONFIGMAPS = Kind("/api/v1", "configmaps")
SECRETS = Kind("/api/v1", "secrets")
PODS = Kind("/api/v1", "pods")
PDBS = Kind("/apis/policy/v1", "poddisruptionbudgets")


def kind_of(obj: Mapping[str, Any]) -> Kind:
    return {
        "Deployment": DEPLOYMENTS,
        "Service": SERVICES,
        "ConfigMap": CONFIGMAPS,
        "Secret": SECRETS,
        "Pod": PODS,
        "PodDisruptionBudget": PDBS,
    }[str(obj["kind"])]


class Kube:
    """JSON access to the API server; one per operator process."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client

    @classmethod
    async def connect(cls) -> Kube:
        """In-cluster config when in a pod, else the kubeconfig ($KUBECONFIG honoured)."""
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            return cls(client.ApiClient())
        except config.ConfigException:
            return cls(await config.new_client_from_config())

    async def close(self) -> None:
        await self.api_client.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        response = await self.api_client.call_api(
            path,
            method,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT,
        )
        raw = await response.read()
        status = int(response.status)
        try:
            data = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            data = {"message": raw.decode(errors="replace")[:500]}
        if status >= 300:
            raise KubeError(status, str(data.get("reason", "")), str(data.get("message", ""))[:2000])
        result: Obj = data
        return result

    async def get(self, kind: Kind, namespace: str, name: str) -> Obj | None:
        try:
            return await self.request("GET", kind.path(namespace, name))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def list(self, kind: Kind, namespace: str, selector: str | None = None) -> list[Obj]:
        query = {"labelSelector": selector} if selector else None
        items: list[Obj] = (await self.request("GET", kind.path(namespace), query=query)).get("items") or []
        return items

    async def create(self, obj: Mapping[str, Any]) -> Obj:
        """POST: fails with 409 when the name is taken, so it never writes over someone else's object."""
        meta = obj["metadata"]
        return await self.request(
            "POST", kind_of(obj).path(meta["namespace"]), body=dict(obj), query={"fieldManager": FIELD_MANAGER}
        )

    async def replace(self, obj: Mapping[str, Any]) -> Obj:
        meta = obj["metadata"]
        return await self.request(
            "PUT",
            kind_of(obj).path(meta["namespace"], meta["name"]),
            body=dict(obj),
            query={"fieldManager": FIELD_MANAGER},
        )

    async def apply(self, obj: Mapping[str, Any]) -> Obj:
        """Server-side apply as ``warmpool-operator``, forcing conflicts: every field we set returns
        to our value, whoever changed it.  Only for objects known to exist and to be ours (apply
        would create or take over anything else)."""
        meta = obj["metadata"]
        return await self.request(
            "PATCH",
            kind_of(obj).path(meta["namespace"], meta["name"]),
            body=dict(obj),
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type=APPLY_PATCH,
        )

    async def patch(
        self, kind: Kind, namespace: str, name: str, patch: Mapping[str, Any], subresource: str | None = None
    ) -> Obj:
        return await self.request(
            "PATCH", kind.path(namespace, name, subresource), body=dict(patch), content_type=MERGE_PATCH
        )
