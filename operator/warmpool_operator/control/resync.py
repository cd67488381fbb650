"""Objects deleted while a watch was down, found by listing once more.

kopf restarts a broken watch from where it was.  When the API server no longer holds that place
(a "410 Gone": after an API server restart, or a watch down for minutes) kopf lists the kind
again, and an object deleted in between never gets its DELETED event: kopf's index keeps it, and
its WarmModel would never restore it (a deleted Service stayed deleted, seen in CI).

A resync lists each kind the operator indexes, by our label, in each namespace the indexes hold
objects of.  A held object the list lacks is read by name (it may have been made after the list
was taken) and, if it is gone or its name now belongs to another uid, reported here; the
registry hides it from the cache and asks its WarmModel for a pass.  WarmModels deleted
meanwhile are found the same way, and their reconcilers stopped.

When it runs (registry.py): soon after a watch is seen listing again, and every
``--resync-interval`` seconds as a backstop (a kind whose every object went lists nothing to
notice the relist by).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from warmpool.contract.pods import LABEL_MANAGED_BY, MANAGED_BY
from warmpool_operator.io.kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    NETWORKPOLICIES,
    PDBS,
    PODS,
    REPLICASETS,
    SERVICES,
    WARMMODELS,
    Kind,
    Kube,
)
from warmpool_operator.io.watch_cache import Cache, uid_of
from warmpool_operator.model import Obj

#: The API path of every kind the cache holds, by the kind's name (io/watch_cache.py: Cache.indexes()).
KINDS: dict[str, Kind] = {
    "Deployment": DEPLOYMENTS,
    "Service": SERVICES,
    "ConfigMap": CONFIGMAPS,
    "PodDisruptionBudget": PDBS,
    "NetworkPolicy": NETWORKPOLICIES,
    "ReplicaSet": REPLICASETS,
    "Pod": PODS,
}
#: The watches' own filter (io/watch_cache.py: MANAGED), as a label selector.
SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
#: After a relist is noticed, the seconds to wait before listing: the other watches broken by the
#: same cause list again meanwhile, and one resync covers them all.
SETTLE_SECONDS = 2.0


@dataclass(frozen=True)
class Deleted:
    """A held object the API server no longer has."""

    kind: str
    obj: Obj

    @property
    def namespace(self) -> str:
        return str((self.obj.get("metadata") or {}).get("namespace") or "")

    @property
    def name(self) -> str:
        return str((self.obj.get("metadata") or {}).get("name") or "")


async def _missing(kube: Kube, kind: Kind, namespace: str, held: list[Obj], selector: str | None) -> list[Obj]:
    """Those of ``held`` (all in ``namespace``) that the API server no longer has."""
    listed = {uid_of(obj) for obj in await kube.list(kind, namespace, selector)}
    missing: list[Obj] = []
    for obj in held:
        if uid_of(obj) in listed:
            continue
        # Made after the list was taken, or gone: only a read by name tells.
        live = await kube.get(kind, namespace, str((obj.get("metadata") or {}).get("name")))
        if live is None or uid_of(live) != uid_of(obj):
            missing.append(obj)
    return missing


def _by_namespace(objs: Iterable[Obj]) -> dict[str, list[Obj]]:
    grouped: dict[str, list[Obj]] = {}
    for obj in objs:
        grouped.setdefault(str((obj.get("metadata") or {}).get("namespace") or ""), []).append(obj)
    return grouped


async def deleted_children(kube: Kube, cache: Cache) -> list[Deleted]:
    """Every object the cache holds that was deleted without the watch telling (one LIST per kind
    and namespace held, and one GET per object the list lacks)."""
    found: list[Deleted] = []
    indexed = cache.indexes()
    for kind_name, kind in KINDS.items():
        if kind_name not in indexed:
            continue  # not indexed (NetworkPolicies without --worker-policy-ingress): nothing held
        for namespace, held in sorted(_by_namespace(cache.held(kind_name)).items()):
            found += [Deleted(kind_name, obj) for obj in await _missing(kube, kind, namespace, held, SELECTOR)]
    return found


async def deleted_warmmodels(kube: Kube, known: Iterable[Obj]) -> list[Obj]:
    """Those of ``known`` (the WarmModels the operator reconciles, as last seen) that are gone."""
    found: list[Obj] = []
    for namespace, held in sorted(_by_namespace(known).items()):
        found += await _missing(kube, WARMMODELS, namespace, held, None)
    return found
