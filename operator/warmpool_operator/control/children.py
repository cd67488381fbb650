"""Child management: make a WarmModel's Secret, ConfigMap, Service, PDB, worker NetworkPolicy
(cluster-wide mode's ``--worker-policy-ingress``) and Deployment match
the pure builders, reading the live objects from the watch-fed :class:`~warmpool_operator.io.watch_cache.Cache`.

Never writes to an object this WarmModel does not own (:class:`ChildConflict`).  A drifted
child is server-side applied as ``warmpool-operator`` with force; when the result still
differs (fields of another manager) it is replaced whole.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf

from warmpool.contract.files import CONFIGMAP_KEY_PROMPTS
from warmpool.contract.pods import ANNOTATION_SPEC_HASH, LABEL_MANAGED_BY, MANAGED_BY
from warmpool.kube import KubeError
from warmpool_operator.io.kube import CONFIGMAPS, SECRETS, Kube, kind_of
from warmpool_operator.io.watch_cache import Cache
from warmpool_operator.model import Obj, Target
from warmpool_operator.rules import builders, control_token
from warmpool_operator.rules.drift import child_drifted
from warmpool_operator.rules.ownership import owned_by

log = logging.getLogger("warmpool.operator")


class ChildConflict(Exception):
    """A child's name is held by an object this WarmModel does not own: nothing was written to it."""

    def __init__(self, kind: str, namespace: str, name: str) -> None:
        super().__init__(f"{kind} {namespace}/{name} exists and is not owned by this WarmModel")


@dataclass
class Settled:
    """child ("Kind/name") -> (desired spec hash, live version) last written or found matching:
    a child still at that version needs no comparison (and a value the API server normalises,
    such as a quantity, never causes a write on every pass)."""

    versions: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass
class ChildrenMemory:
    """What the pool's child management remembers between passes (in memory only)."""

    settled: Settled = field(default_factory=Settled)
    #: the control token, once read or drawn (Secrets are not watched: read by name until known)
    token: str = ""

    def is_echo(self, child: Mapping[str, Any]) -> bool:
        """Whether a watch event shows a child at the version we settled on (our own write's echo)."""
        key = f"{child.get('kind')}/{(child.get('metadata') or {}).get('name')}"
        settled = self.settled.versions.get(key)
        return settled is not None and settled[1] == version(child)


def version(obj: Mapping[str, Any]) -> str:
    """What moves when an object's content may have changed: the generation where the kind keeps
    one (status writes leave it alone), else the resourceVersion."""
    meta = obj.get("metadata") or {}
    generation = int(meta.get("generation") or 0)
    return f"g{generation}" if generation else f"rv{meta.get('resourceVersion')}"


async def get_or_create(kube: Kube, cache: Cache, desired: Obj) -> tuple[Obj, bool]:
    """(the object, True) when we created it; (what is there, False) when it exists already.

    The live object comes from the cache; one that is not there (someone else's, without our
    labels, or ours not yet seen by the watch) makes the create fail with 409, and only then is
    it read from the API server."""
    meta = desired["metadata"]
    kind = str(desired["kind"])
    actual = cache.child(kind, meta["namespace"], meta["name"])
    if actual is not None:
        return actual, False
    try:
        return await kube.create(desired), True
    except KubeError as error:
        if error.status != 409:
            raise
        actual = await kube.get(kind_of(desired), meta["namespace"], meta["name"])
        if actual is None:
            raise
    return actual, False


async def ensure(kube: Kube, cache: Cache, desired: Obj, owner: Mapping[str, Any], settled: Settled) -> Obj:
    """Create the child, or bring it back to ``desired`` when the live object differs from it."""
    kopf.adopt(desired, owner=owner)  # type: ignore[arg-type]
    meta = desired["metadata"]
    kind, namespace, name = str(desired["kind"]), str(meta["namespace"]), str(meta["name"])
    actual, created = await get_or_create(kube, cache, desired)
    if not owned_by(actual, str(owner["metadata"]["uid"])):
        raise ChildConflict(kind, namespace, name)
    key = f"{kind}/{name}"
    want = str(meta["annotations"][ANNOTATION_SPEC_HASH])
    if created or settled.versions.get(key) == (want, version(actual)) or not child_drifted(actual, desired):
        settled.versions[key] = (want, version(actual))
        return actual
    log.info("%s %s/%s differs from the spec: applying", kind, namespace, name)
    try:
        result = await kube.apply(desired)
    except KubeError as error:
        # Merged with what another manager holds, the object can be invalid (a hand-edited port
        # keeps its name beside ours: "Duplicate value"): only the whole desired object is valid.
        if error.status not in (400, 409, 422):
            raise
        log.info("%s %s/%s: apply refused (%s): replacing it whole", kind, namespace, name, error)
        result = await _replace_whole(kube, desired, actual)
    else:
        if child_drifted(result, desired):
            log.info("%s %s/%s still differs (fields of another manager): replacing it whole", kind, namespace, name)
            result = await _replace_whole(kube, desired, result)
    settled.versions[key] = (want, version(result))
    return result


async def _replace_whole(kube: Kube, desired: Obj, live: Mapping[str, Any]) -> Obj:
    """PUT ``desired`` over ``live`` (at its resourceVersion): list items and fields another
    manager added go; others' labels, annotations and owner references stay."""
    whole = copy.deepcopy(desired)
    meta = whole["metadata"]
    live_meta = live.get("metadata") or {}
    meta["resourceVersion"] = live_meta.get("resourceVersion")
    meta["ownerReferences"] = live_meta.get("ownerReferences") or meta["ownerReferences"]
    for field_name in ("labels", "annotations"):  # others' keys stay, ours win
        meta[field_name] = {**(live_meta.get(field_name) or {}), **(meta.get(field_name) or {})}
    if whole["kind"] == "Service":  # allocated fields are immutable: carry them over
        for key_name in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
            if key_name in (live.get("spec") or {}):
                whole["spec"][key_name] = live["spec"][key_name]
    return await kube.replace(whole)


def _pointer(key: str) -> str:
    """An RFC 6901 JSON pointer segment (``/`` and ``~`` escaped)."""
    return key.replace("~", "~0").replace("/", "~1")


async def ensure_secret(kube: Kube, target: Target, owner: Mapping[str, Any], key: bytes, known: str) -> str:
    """The control token (rules/control_token.py), written into the WarmModel's Secret, which
    its pods mount; never read back (``known``: the token this process last wrote there).

    The Secret is created, or when the name is taken, patched only if it is ours: the patch's
    ``test`` operations ask the API server to check our label and owner first, and a Secret that
    is someone else's is left untouched (a conflict) without the operator ever reading it."""
    uid = str(owner["metadata"]["uid"])
    token = control_token.derive(key, target.namespace, target.name, uid)
    if known == token:
        return token
    desired = builders.build_control_secret(target, token)
    kopf.adopt(desired, owner=owner)  # type: ignore[arg-type]
    name = desired["metadata"]["name"]
    try:
        await kube.create(desired)
        return token
    except KubeError as error:
        if error.status != 409:
            raise
    try:
        await kube.json_patch(SECRETS, target.namespace, name, [
            {"op": "test", "path": f"/metadata/labels/{_pointer(LABEL_MANAGED_BY)}",
             "value": MANAGED_BY},
            {"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": uid},
            {"op": "add", "path": "/data", "value": desired["data"]},
        ])
    except KubeError as error:
        # 422: a test failed (not ours); 403 from the chart's admission policy says the same.
        if error.status == 422 or (error.status == 403 and "ValidatingAdmissionPolicy" in error.message):
            raise ChildConflict("Secret", target.namespace, name) from None
        raise
    return token


async def ensure_configmap(kube: Kube, cache: Cache, target: Target, owner: Mapping[str, Any]) -> Obj:
    """Create the ConfigMap, or patch only the prompts key (the heat map key is control/learning.py's)."""
    desired = builders.build_configmap(target)
    kopf.adopt(desired, owner=owner)  # type: ignore[arg-type]
    name = desired["metadata"]["name"]
    actual, created = await get_or_create(kube, cache, desired)
    if not owned_by(actual, str(owner["metadata"]["uid"])):
        raise ChildConflict("ConfigMap", target.namespace, name)
    if created:
        return actual
    data = actual.get("data") or {}
    want = desired["data"].get(CONFIGMAP_KEY_PROMPTS)
    if data.get(CONFIGMAP_KEY_PROMPTS) == want:
        return actual
    return await kube.patch(CONFIGMAPS, target.namespace, name, {"data": {CONFIGMAP_KEY_PROMPTS: want}})


@dataclass
class Supporting:
    """What the children other than the Deployment left: the token, and the conflicts met."""

    token: str = ""
    conflicts: list[ChildConflict] = field(default_factory=list)
    #: the Secret or the ConfigMap is someone else's: no Deployment (its pods would mount it)
    mounted_conflict: bool = False


async def ensure_supporting(
    kube: Kube, cache: Cache, target: Target, owner: Mapping[str, Any], settled: Settled, key: bytes, known_token: str,
    worker_policy: Sequence[Mapping[str, Any]] | None = None,
) -> Supporting:
    """Secret, ConfigMap, Service and PDB, and with ``worker_policy`` (the ingress rules of
    ``--worker-policy-ingress``) the pool's worker NetworkPolicy; a conflict on one does not stop
    the others.

    All in one burst: none depends on another, so a first pass waits one round trip for its
    four or five creates, not one each.  The first error other than a conflict is raised once all
    have been answered (none is left writing behind the pass)."""
    out = Supporting()
    wanted = [builders.build_service(target), builders.build_pdb(target)]
    if worker_policy is not None:
        wanted.append(builders.build_network_policy(target, worker_policy))
    answers = await asyncio.gather(
        ensure_secret(kube, target, owner, key, known_token), ensure_configmap(kube, cache, target, owner),
        *(ensure(kube, cache, desired, owner, settled) for desired in wanted), return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, ChildConflict):
            raise answer
    token, configmap, *others = answers
    out.token = "" if isinstance(token, ChildConflict) else str(token)
    mounted = [answer for answer in (token, configmap) if isinstance(answer, ChildConflict)]
    out.mounted_conflict = bool(mounted)
    out.conflicts = mounted + [answer for answer in others if isinstance(answer, ChildConflict)]
    return out


def live_deployment(cache: Cache, target: Target, owner_uid: str) -> Obj | None:
    """Our Deployment as the watch last saw it; None when absent or someone else's."""
    live = cache.child("Deployment", target.namespace, builders.deployment_name(target.name))
    if live is None or not owned_by(live, owner_uid):
        return None
    return live
