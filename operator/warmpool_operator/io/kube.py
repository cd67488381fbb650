"""The operator's API access: the shared JSON client (warmpool.kube) with the kinds the operator
writes, by path, and its verbs (get, list, create, replace, server-side apply, merge patch).

The operator works with plain dicts (its builders produce them, kopf hands them in).  Non-2xx
answers raise :class:`~warmpool.kube.KubeError` carrying the status code, so callers can tell
404 / 409 / 422 apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from warmpool.contract.api import API_GROUP, API_VERSION, PLURAL
from warmpool.kube import (
    APPLY_PATCH,
    DEFAULT_MAX_IN_FLIGHT,
    JSON_PATCH,
    MERGE_PATCH,
    KubeClient,
    KubeError,
    client_from_environment,
)
from warmpool_operator.model import Obj

#: The field manager of every write the operator makes (server-side apply and plain writes alike).
FIELD_MANAGER = "warmpool-operator"


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
ENDPOINTSLICES = Kind("/apis/discovery.k8s.io/v1", "endpointslices")
NETWORKPOLICIES = Kind("/apis/networking.k8s.io/v1", "networkpolicies")
WARMMODELS = Kind(f"/apis/{API_GROUP}/{API_VERSION}", PLURAL)


def kind_of(obj: Mapping[str, Any]) -> Kind:
    return {
        "Deployment": DEPLOYMENTS,
        "Service": SERVICES,
        "ConfigMap": CONFIGMAPS,
        "Secret": SECRETS,
        "Pod": PODS,
        "PodDisruptionBudget": PDBS,
        "Lease": LEASES,
        "EndpointSlice": ENDPOINTSLICES,
        "NetworkPolicy": NETWORKPOLICIES,
    }[str(obj["kind"])]


class Kube(KubeClient):
    """JSON access to the API server; one per operator process."""

    @classmethod
    async def connect(cls, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> Kube:
        """In-cluster config when in a pod, else the kubeconfig ($KUBECONFIG honoured)."""
        return cls(await client_from_environment(), max_in_flight)

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

    async def delete(self, kind: Kind, namespace: str, name: str) -> None:
        """Delete an object; one already gone is no error."""
        try:
            await self.request("DELETE", kind.path(namespace, name))
        except KubeError as error:
            if error.status != 404:
                raise

    async def json_patch(self, kind: Kind, namespace: str, name: str, operations: Sequence[Mapping[str, Any]]) -> Obj:
        """An RFC 6902 patch: one whose ``test`` operation fails changes nothing (422 Invalid)."""
        return await self.request("PATCH", kind.path(namespace, name), body=[dict(op) for op in operations],
                                  content_type=JSON_PATCH, query={"fieldManager": FIELD_MANAGER})

    async def patch(
        self, kind: Kind, namespace: str, name: str, patch: Mapping[str, Any], subresource: str | None = None
    ) -> Obj:
        return await self.request(
            "PATCH", kind.path(namespace, name, subresource), body=dict(patch), content_type=MERGE_PATCH
        )
