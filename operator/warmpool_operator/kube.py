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

from warmpool import contract

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
LEASES = Kind("/apis/coordination.k8s.io/v1", "leases")
WARMMODELS = Kind(f"/apis/{contract.API_GROUP}/{contract.API_VERSION}", contract.PLURAL)


def kind_of(obj: Mapping[str, Any]) -> Kind:
    return {
        "Deployment": DEPLOYMENTS,
        "Service": SERVICES,
        "ConfigMap": CONFIGMAPS,
        "Secret": SECRETS,
        "Pod": PODS,
        "PodDisruptionBudget": PDBS,
        "Lease": LEASES,
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


# --------------------------------------------------------------------------- pure helpers


def owned_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    """Whether ``obj`` carries an owner reference to ``owner_uid`` (a name match is not ownership)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(ref, Mapping) and ref.get("uid") == owner_uid for ref in refs)


def controller_uid(obj: Mapping[str, Any], kind: str) -> str | None:
    """The uid of ``obj``'s controlling owner when that owner is of ``kind``, else None."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") and ref.get("kind") == kind:
            return str(ref.get("uid") or "") or None
    return None


def _empty(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == "" or value == [] or value == {}


#: Maps whose every key matters: an extra key in a selector selects other pods.
EXACT_MAPS = frozenset({"selector", "matchLabels", "nodeSelector"})


def covers(live: Any, desired: Any, exact: bool = False) -> bool:
    """Whether the live object holds everything ``desired`` says (pure).

    Maps: every desired key, recursively (keys the API server defaults, such as a port's
    protocol, may be extra), except selectors (:data:`EXACT_MAPS`), whose keys must be the same;
    lists: the same length, item by item (an extra port, container or argument is drift);
    scalars: equal, where a zero value the server omits (``omitempty``) equals a missing one.
    """
    if isinstance(desired, Mapping):
        if live is None:
            return all(_empty(v) for v in desired.values())
        if not isinstance(live, Mapping):
            return False
        if exact and set(live) != set(desired):
            return False
        return all(covers(live.get(k), v, exact=k in EXACT_MAPS) for k, v in desired.items())
    if isinstance(desired, list):
        if live is None:
            return not desired
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(covers(have, want) for have, want in zip(live, desired, strict=True))
        )
    if live is None:
        return _empty(desired)
    return bool(live == desired)


def child_drifted(live: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether a child differs from its desired form in content, labels or annotations.

    Owner references are checked apart (:func:`owned_by`); status and server-set metadata
    are not compared.
    """
    want_meta = desired.get("metadata") or {}
    have_meta = live.get("metadata") or {}
    for key in ("labels", "annotations"):
        if not covers(have_meta.get(key) or {}, want_meta.get(key) or {}):
            return True
    return any(not covers(live.get(k), v) for k, v in desired.items() if k not in ("metadata", "status"))


def deployment_pods(
    pods: list[Obj], replicasets: list[Obj], deployment_uid: str
) -> tuple[list[Obj], list[Obj]]:
    """(ours, others): a pod is ours only when its controller is a ReplicaSet whose controller is
    the Deployment ``deployment_uid``, and it is not on the host's network (its IP is the node's:
    scraping it would reach whatever else listens there, and the control token with it).
    Matching labels are not enough: anyone may label a pod."""
    ours_rs = {
        str((rs.get("metadata") or {}).get("uid"))
        for rs in replicasets
        if controller_uid(rs, "Deployment") == deployment_uid
    }
    ours: list[Obj] = []
    others: list[Obj] = []
    for pod in pods:
        owned = controller_uid(pod, "ReplicaSet") in ours_rs
        host_network = bool((pod.get("spec") or {}).get("hostNetwork"))
        (ours if owned and not host_network else others).append(pod)
    return ours, others
