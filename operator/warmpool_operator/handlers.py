"""kopf handlers: reconcile each WarmModel and keep its pool warm.

One level-based ``sync`` does everything, from what it observes now and nothing else:

1. parse the spec (a bad one -> ``PermanentError`` and ``Degraded=True``, retried only slowly);
2. make the children match the pure builders (Secret, ConfigMap, Service, PDB, Deployment;
   deterministic names, owner references by ``kopf.adopt``); a live child is compared with
   its desired form and, when it drifted, server-side applied back; an object of a child's
   name that this WarmModel does not own is never written to (``Degraded`` ChildConflict);
3. scrape our Deployment's worker pods' /metrics on their pod IPs, decide tiers per pod and
   per node, send the directives, annotate the pods (tier, deletion cost; best effort), emit
   Events on transitions;
4. scale up within maxReplicas while fewer than minWarm pods are verified warm, counting only
   pods whose own metrics say "not warm yet";
5. learn layer heat into the ConfigMap (rate-limited, best effort);
6. write status.

What a restart would forget is read back from the live objects: the extra pods from the
Deployment's replicas, each pod's last tier from its annotation.

The create/update/resume handlers and a timer per WarmModel all run ``sync`` under one
lock per object, so they never interleave; the timer is what notices a deleted child or a
pod turning cold, since neither changes the WarmModel itself.  Deletion needs no handler:
every child carries an owner reference and the garbage collector removes it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import copy
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf

from warmpool import contract
from warmpool.contract import Tier
from warmpool_operator import builders, gating, heat, host_paths, metrics, scrape
from warmpool_operator import status as st
from warmpool_operator.api import InvalidWarmModel, parse_spec
from warmpool_operator.builders import Obj, Target
from warmpool_operator.kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    PODS,
    REPLICASETS,
    SECRETS,
    Kind,
    Kube,
    KubeError,
    child_drifted,
    deployment_pods,
    kind_of,
    owned_by,
)
from warmpool_operator.settings import CONFIG, HANDLER_BACKOFF, HANDLER_RETRIES, HANDLER_TIMEOUT, RETRY_DELAY

log = logging.getLogger("warmpool.operator")

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
WARMMODELS = Kind(f"/apis/{GROUP}/{VERSION}", PLURAL)


class Permanent(Exception):
    """Retrying will not help until the WarmModel changes."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.degradation = st.Degradation(reason, message)


@dataclass
class ModelState:
    """What the operator remembers about one WarmModel between ticks (in memory only)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    gate: gating.GateState = field(default_factory=gating.GateState)
    cold: st.ColdStarts = field(default_factory=st.ColdStarts)
    heat: heat.HeatState = field(default_factory=heat.HeatState)
    #: pods added above the asked-for replicas because Ready pods are not verified warm; None
    #: until read back from the live Deployment (an operator restart must not scale the pool down)
    extra: int | None = None
    #: the generation that failed permanently, why, and when (monotonic): the timer leaves it
    #: alone until it changes or CONFIG.permanent_retry_interval has passed
    failed_generation: int | None = None
    failed_reason: str = ""
    failed_at: float = 0.0
    #: child ("Kind/name") -> (desired spec hash, live version) last written or found matching:
    #: a child still at that version needs no comparison (and a value the API server normalises,
    #: such as a quantity, never causes a write on every tick)
    settled: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: pods with our labels that are not our Deployment's (warned about once each)
    ignored: set[str] = field(default_factory=set)


@dataclass
class Runtime:
    kube: Kube | None = None
    session: aiohttp.ClientSession | None = None
    states: dict[str, ModelState] = field(default_factory=dict)


RUNTIME = Runtime()


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _state(uid: str) -> ModelState:
    return RUNTIME.states.setdefault(uid, ModelState())


def _kube() -> Kube:
    if RUNTIME.kube is None:
        raise kopf.TemporaryError("the Kubernetes client is not connected yet", delay=RETRY_DELAY)
    return RUNTIME.kube


# --------------------------------------------------------------------------- lifecycle


@kopf.on.login(retries=3, backoff=2.0)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the service account; elsewhere: the kubeconfig ($KUBECONFIG honoured)."""
    info: kopf.ConnectionInfo | None = kopf.login_with_service_account(**kwargs)
    return info or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup(retries=5, backoff=2.0, timeout=60)
async def connect(**_: Any) -> None:
    RUNTIME.kube = await Kube.connect()
    RUNTIME.session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=CONFIG.scrape_timeout),
        connector=aiohttp.TCPConnector(limit=CONFIG.scrape_concurrency * 2, force_close=True),
        trust_env=False,  # never send scrapes through a proxy from the environment
    )


@kopf.on.cleanup()
async def disconnect(**_: Any) -> None:
    if RUNTIME.session is not None:
        await RUNTIME.session.close()
    if RUNTIME.kube is not None:
        await RUNTIME.kube.close()


# --------------------------------------------------------------------------- children


async def get_or_create(kube: Kube, kind: Kind, desired: Obj) -> tuple[Obj, bool]:
    """(the object, True) when we created it; (what is there, False) when it exists already,
    including when another writer created it between our read and our create (409)."""
    meta = desired["metadata"]
    actual = await kube.get(kind, meta["namespace"], meta["name"])
    if actual is not None:
        return actual, False
    try:
        return await kube.create(desired), True
    except KubeError as error:
        if error.status != 409:
            raise
        actual = await kube.get(kind, meta["namespace"], meta["name"])
        if actual is None:
            raise
    return actual, False


class ChildConflict(Exception):
    """A child's name is held by an object this WarmModel does not own: nothing was written to it."""

    def __init__(self, kind: str, namespace: str, name: str) -> None:
        super().__init__(f"{kind} {namespace}/{name} exists and is not owned by this WarmModel")


def _version(obj: Mapping[str, Any]) -> str:
    """What moves when an object's content may have changed: the generation where the kind keeps
    one (status writes leave it alone), else the resourceVersion."""
    meta = obj.get("metadata") or {}
    generation = int(meta.get("generation") or 0)
    return f"g{generation}" if generation else f"rv{meta.get('resourceVersion')}"


async def ensure(kube: Kube, desired: Obj, owner: Mapping[str, Any], state: ModelState) -> Obj:
    """Create the child, or bring it back to ``desired`` when the live object differs from it.

    Never writes to an object this WarmModel does not own (:class:`ChildConflict`).  A drifted
    child is server-side applied as warmpool-operator with force, so hand edits of our fields
    are undone; what another manager added (an extra port, container or argument) survives an
    apply, so when the result still differs the object is replaced whole.
    """
    kopf.adopt(desired, owner=owner)  # type: ignore[arg-type]
    meta = desired["metadata"]
    kind, namespace, name = str(desired["kind"]), str(meta["namespace"]), str(meta["name"])
    actual, created = await get_or_create(kube, kind_of(desired), desired)
    if not owned_by(actual, str(owner["metadata"]["uid"])):
        raise ChildConflict(kind, namespace, name)
    key = f"{kind}/{name}"
    want = str(meta["annotations"][contract.ANNOTATION_SPEC_HASH])
    if created or state.settled.get(key) == (want, _version(actual)) or not child_drifted(actual, desired):
        state.settled[key] = (want, _version(actual))
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
    state.settled[key] = (want, _version(result))
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


async def ensure_secret(kube: Kube, target: Target, owner: Mapping[str, Any]) -> str:
    """The control token: drawn once, kept for the WarmModel's life (pods hold it mounted)."""
    name = builders.control_secret_name(target.name)
    actual = await kube.get(SECRETS, target.namespace, name)
    if actual is not None and not owned_by(actual, str(owner["metadata"]["uid"])):
        raise ChildConflict("Secret", target.namespace, name)
    if actual is not None:
        raw = (actual.get("data") or {}).get(contract.CONTROL_SECRET_KEY)
        try:
            token = base64.b64decode(raw or "", validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            token = ""
        if token:
            return token
    token = secrets.token_urlsafe(32)
    desired = builders.build_control_secret(target, token)
    kopf.adopt(desired, owner=owner)  # type: ignore[arg-type]
    if actual is None:
        try:
            await kube.create(desired)
        except KubeError as error:
            if error.status == 409:  # made meanwhile: the next pass reads it (and checks whose it is)
                raise kopf.TemporaryError("control Secret created concurrently", delay=1) from None
            raise
    else:  # ours, but its token is missing or unreadable
        await kube.patch(SECRETS, target.namespace, name, {"data": desired["data"]})
    return token


async def ensure_configmap(kube: Kube, target: Target, owner: Mapping[str, Any]) -> Obj:
    """Create the ConfigMap, or patch only the prompts key (the heat map key is heat.py's)."""
    desired = builders.build_configmap(target)
    kopf.adopt(desired, owner=owner)  # type: ignore[arg-type]
    name = desired["metadata"]["name"]
    actual, created = await get_or_create(kube, CONFIGMAPS, desired)
    if not owned_by(actual, str(owner["metadata"]["uid"])):
        raise ChildConflict("ConfigMap", target.namespace, name)
    if created:
        return actual
    data = actual.get("data") or {}
    want = desired["data"].get(contract.CONFIGMAP_KEY_PROMPTS)
    if data.get(contract.CONFIGMAP_KEY_PROMPTS) == want:
        return actual
    return await kube.patch(CONFIGMAPS, target.namespace, name, {"data": {contract.CONFIGMAP_KEY_PROMPTS: want}})


async def _live_extra(kube: Kube, target: Target, owner: Mapping[str, Any]) -> int:
    """Extra pods the live Deployment runs above the asked-for replicas (after an operator
    restart: the pool keeps them until a pass decides otherwise, instead of dropping them)."""
    live = await kube.get(DEPLOYMENTS, target.namespace, builders.deployment_name(target.name))
    if live is None or not owned_by(live, str(owner["metadata"]["uid"])):
        return 0
    return st.extra_from_live(target.spec, int((live.get("spec") or {}).get("replicas") or 0))


async def ensure_children(kube: Kube, target: Target, owner: Mapping[str, Any], state: ModelState) -> tuple[str, Obj]:
    """(control token, Deployment) after making every child match the spec.

    A child whose name is held by an object this WarmModel does not own is left untouched, and
    the pass ends ``Permanent`` (Degraded ChildConflict naming each one) once the others are
    made; the Deployment is not made while the Secret or the ConfigMap is someone else's, since
    its pods would mount that object.
    """
    conflicts: list[ChildConflict] = []
    token = ""
    try:
        try:
            token = await ensure_secret(kube, target, owner)
        except ChildConflict as conflict:
            conflicts.append(conflict)
        try:
            await ensure_configmap(kube, target, owner)
        except ChildConflict as conflict:
            conflicts.append(conflict)
        mounted_conflict = bool(conflicts)
        for desired in (builders.build_service(target), builders.build_pdb(target)):
            try:
                await ensure(kube, desired, owner, state)
            except ChildConflict as conflict:
                conflicts.append(conflict)
        deployment: Obj | None = None
        if not mounted_conflict:
            if state.extra is None:
                state.extra = await _live_extra(kube, target, owner)
            replicas = builders.desired_replicas(target.spec, state.extra)
            try:
                deployment = await ensure(kube, builders.build_deployment(target, replicas), owner, state)
            except ChildConflict as conflict:
                conflicts.append(conflict)
    except KubeError as error:
        if error.status in (400, 422):
            # The API server refuses a child built from this spec (e.g. requests above limits, or
            # an admission policy): retried slowly and on any change (an outside fix heals it).
            raise Permanent(st.REASON_CHILD_REJECTED, f"the API server refused a child: {error.message}") from None
        raise
    if conflicts or deployment is None:
        names = "; ".join(str(conflict) for conflict in conflicts)
        raise Permanent(st.REASON_CHILD_CONFLICT, f"{names}: left untouched (delete or rename it to let this "
                        "WarmModel create its own)")
    return token, deployment


# --------------------------------------------------------------------------- pods


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def _url(ip: str, port: int, path: str) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{path}"


async def _our_pods(kube: Kube, target: Target, state: ModelState, deployment: Obj) -> list[Obj]:
    """The worker pods of our Deployment (through its ReplicaSets), never just any pod that
    carries the selector's labels: only these are scraped and sent the control token."""
    selector = builders.selector_string(target.name)
    pods = await kube.list(PODS, target.namespace, selector)
    replicasets = await kube.list(REPLICASETS, target.namespace, selector)
    ours, others = deployment_pods(pods, replicasets, str(deployment["metadata"]["uid"]))
    for pod in others:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid"))
        if uid not in state.ignored:
            state.ignored.add(uid)
            log.warning("pod %s/%s carries %s's labels but is not a pod of its Deployment (or uses the host's "
                        "network): ignored, never scraped", target.namespace, meta.get("name"), target.name)
    state.ignored &= {str((p.get("metadata") or {}).get("uid")) for p in others}
    return ours


def _seed_gate(gate: gating.GateState, refs: list[gating.PodRef], pods: Mapping[str, Obj]) -> None:
    """After an operator restart, each pod's last directive comes back from its tier annotation
    (what this operator wrote), so hysteresis holds and no tier "changes" to what it already was."""
    for ref in refs:
        if ref.uid in gate.directives:
            continue
        note = ((pods[ref.uid].get("metadata") or {}).get("annotations") or {}).get(contract.ANNOTATION_TIER)
        try:
            tier = Tier(str(note))
        except ValueError:
            continue
        gate.directives[ref.uid] = tier
        if tier is not Tier.UNKNOWN:
            gate.pod_tiers.setdefault(ref.uid, tier)


async def observe_pods(
    kube: Kube, body: Mapping[str, Any], target: Target, state: ModelState, token: str, deployment: Obj
) -> list[st.PodObservation]:
    """Scrape, decide tiers, send directives, annotate pods; the observations for status."""
    pods = await _our_pods(kube, target, state, deployment)
    port = target.spec.pod.port
    refs: list[gating.PodRef] = []
    by_uid: dict[str, Obj] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid"))
        by_uid[uid] = pod
        ip = str((pod.get("status") or {}).get("podIP") or "")
        if meta.get("deletionTimestamp") or not ip or (pod.get("status") or {}).get("phase") != "Running":
            continue
        if not CONFIG.allowed(ip):
            log.warning("pod %s/%s: IP %s is outside --scrape-network: not scraped", target.namespace, meta["name"], ip)
            continue
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        refs.append(gating.PodRef(uid=uid, name=str(meta.get("name")), node=node, ip=ip))

    session = RUNTIME.session
    samples: dict[str, scrape.Sample] = {}
    if session is not None and refs:
        urls = {ref.uid: _url(ref.ip, port, contract.PATH_METRICS) for ref in refs}
        samples = await scrape.scrape_all(session, urls, CONFIG.scrape_timeout, CONFIG.scrape_concurrency)
    for uid, scraped in samples.items():
        if scraped.error is not None:
            metrics.SCRAPE_FAILURES.labels(scraped.error.split(":")[0]).inc()
            log.info("pod %s: metrics unusable (%s): tier unknown", by_uid[uid]["metadata"]["name"], scraped.error)
        elif scraped.used_ratio is None:
            metrics.SCRAPE_FAILURES.labels("no memory figure").inc()

    _seed_gate(state.gate, refs, by_uid)
    decisions = gating.decide(refs, samples, state.gate, target.spec.gating.thresholds())
    by_decision = {d.pod.uid: d for d in decisions}

    # Directives: re-sent every tick (they expire in the worker after the TTL, so a dead
    # operator never pins a pool to a stale tier).
    if session is not None:
        sendable = [
            (d.pod.uid, _url(d.pod.ip, port, contract.PATH_CONTROL_TIER), d.tier)
            for d in decisions
            if d.tier is not Tier.UNKNOWN
        ]
        if sendable:
            results = await scrape.send_all(
                session, sendable, token, CONFIG.ttl(), CONFIG.scrape_timeout, CONFIG.scrape_concurrency
            )
            for uid, error in results.items():
                if error is not None:
                    log.info("pod %s: tier directive not delivered: %s", by_decision[uid].pod.name, error)

    observations: list[st.PodObservation] = []
    for uid, pod in by_uid.items():
        meta = pod.get("metadata") or {}
        decision = by_decision.get(uid)
        sample = samples.get(uid)
        obs = st.PodObservation(
            uid=uid,
            name=str(meta.get("name")),
            ready=_pod_ready(pod),
            terminating=bool(meta.get("deletionTimestamp")),
            sample=sample,
            decision=decision,
            failure=st.pod_failure(pod),
        )
        observations.append(obs)
        state.cold.record(uid, sample)
        if obs.terminating:
            continue
        tier = decision.tier if decision is not None else Tier.UNKNOWN
        if decision is not None:
            metrics.TIER_DECISIONS.labels("pod", tier.value).inc()
            metrics.TIER_DECISIONS.labels("node", decision.node_tier.value).inc()
        await _annotate(kube, target, pod, tier, gating.deletion_cost(obs.warm, tier, sample))
        if decision is not None and decision.changed:
            _tier_event(body, pod, decision)
    return observations


async def _annotate(kube: Kube, target: Target, pod: Mapping[str, Any], tier: Tier, cost: int) -> None:
    """Best effort: a refused or failed patch of one pod is logged and counted, and the pass goes
    on (the other pods, the scale decision and the status matter more than one annotation)."""
    meta = pod.get("metadata") or {}
    have = meta.get("annotations") or {}
    want = {contract.ANNOTATION_TIER: tier.value, contract.ANNOTATION_POD_DELETION_COST: str(cost)}
    if all(have.get(k) == v for k, v in want.items()):
        return
    try:
        await kube.patch(PODS, target.namespace, str(meta.get("name")), {"metadata": {"annotations": want}})
    except KubeError as error:
        if error.status == 404:  # a pod that just went away needs no annotation
            return
        metrics.WRITE_FAILURES.labels(metrics.WRITE_POD_ANNOTATION).inc()
        log.warning("pod %s/%s: annotation not written (%s): carrying on", target.namespace, meta.get("name"), error)
    except (aiohttp.ClientError, TimeoutError) as error:
        metrics.WRITE_FAILURES.labels(metrics.WRITE_POD_ANNOTATION).inc()
        log.warning("pod %s/%s: annotation not written (%s: %s): carrying on", target.namespace, meta.get("name"),
                    type(error).__name__, error)


def _tier_event(body: Mapping[str, Any], pod: Mapping[str, Any], decision: gating.Decision) -> None:
    level = "unknown" if decision.used_ratio is None else f"{decision.used_ratio * 100:.0f}% used"
    before = decision.previous.value if decision.previous is not None else "none"
    message = (
        f"pod {decision.pod.name} on {decision.pod.node or '?'}: tier {before} -> {decision.tier.value} "
        f"(memory {level}; pod {decision.pod_tier.value}, node {decision.node_tier.value})"
    )
    kind = "Warning" if decision.tier in (Tier.PAUSED, Tier.UNKNOWN) else "Normal"
    pod_ref = {"apiVersion": "v1", "kind": "Pod", "metadata": pod.get("metadata") or {}}
    kopf.event([body, pod_ref], type=kind, reason="TierChanged", message=message)  # type: ignore[list-item]
    log.info("%s", message)


# --------------------------------------------------------------------------- status


async def write_status(kube: Kube, body: Mapping[str, Any], status: Obj) -> None:
    """Merge-patch the status subresource when it changed.

    The conditions list is written whole (a merge patch replaces lists), which is right
    because every tick computes all four.  A 409 (someone changed the object between our
    read and write, e.g. under a future resourceVersion precondition) is retried a few times.
    """
    old = body.get("status") or {}
    if all(old.get(k) == v for k, v in status.items()):
        return
    meta = body["metadata"]
    for attempt in range(3):
        try:
            await kube.patch(WARMMODELS, meta["namespace"], meta["name"], {"status": status}, subresource="status")
            return
        except KubeError as error:
            if error.status == 404:
                return  # deleted meanwhile
            if error.status != 409 or attempt == 2:
                raise
            await asyncio.sleep(0.2 * (attempt + 1))


# --------------------------------------------------------------------------- sync


async def sync(body: Mapping[str, Any], kind: str) -> None:
    """One level-based pass over a WarmModel (see the module docstring)."""
    kube = _kube()
    meta = body["metadata"]
    uid, name, namespace = str(meta["uid"]), str(meta["name"]), str(meta["namespace"])
    generation = int(meta.get("generation") or 0)
    state = _state(uid)
    started = time.monotonic()
    async with state.lock:
        try:
            try:
                spec = parse_spec(body.get("spec") or {})
            except InvalidWarmModel as error:
                raise Permanent(st.REASON_INVALID_SPEC, str(error)) from None
            # Before any child: a node directory outside the allowed prefixes is never mounted.
            refused = host_paths.refusal(spec, CONFIG.allowed_host_paths)
            if refused is not None:
                raise Permanent(st.REASON_HOST_PATH_NOT_ALLOWED, refused)
            target = Target(name=name, namespace=namespace, spec=spec)
            token, deployment = await ensure_children(kube, target, body, state)
            state.failed_generation = None
            observations = await observe_pods(kube, body, target, state, token, deployment)

            warm = sum(o.warm for o in observations if not o.terminating)
            extra = st.extra_pods(observations, spec.pool.min_warm)
            if extra != state.extra:
                log.info("%s/%s: %d warm of minWarm %d; extra pods %s -> %d", namespace, name, warm,
                         spec.pool.min_warm, state.extra, extra)
                state.extra = extra
                replicas = builders.desired_replicas(spec, extra)
                try:
                    deployment = await ensure(kube, builders.build_deployment(target, replicas), body, state)
                except ChildConflict as conflict:  # replaced by someone else's since the pass began
                    raise Permanent(st.REASON_CHILD_CONFLICT, str(conflict)) from None
            metrics.WARM_PODS.labels(namespace, name).set(warm)

            await _learn_heat(kube, target, state, observations)
            status = st.compute_status(
                name=name,
                spec=spec,
                generation=generation,
                pods=observations,
                deployment=deployment,
                cold_starts=state.cold,
                previous=body.get("status"),
                now=_now(),
            )
            await write_status(kube, body, status)
        except Permanent as error:
            metrics.RECONCILE_ERRORS.labels(kind, "permanent").inc()
            first = state.failed_generation != generation or state.failed_reason != error.degradation.reason
            state.failed_generation = generation
            state.failed_reason = error.degradation.reason
            state.failed_at = time.monotonic()
            status = st.compute_status(
                name=name,
                spec=None,
                generation=generation,
                pods=(),
                deployment=None,
                cold_starts=state.cold,
                previous=body.get("status"),
                now=_now(),
                degraded=error.degradation,
            )
            await write_status(kube, body, status)
            if first:
                kopf.event(body, type="Warning", reason=error.degradation.reason, message=str(error))  # type: ignore[arg-type]
            raise
        except (KubeError, aiohttp.ClientError, TimeoutError, OSError) as error:
            metrics.RECONCILE_ERRORS.labels(kind, "temporary").inc()
            raise kopf.TemporaryError(f"{type(error).__name__}: {error}", delay=RETRY_DELAY) from error
        finally:
            metrics.RECONCILE_SECONDS.labels(kind).observe(time.monotonic() - started)


async def _learn_heat(kube: Kube, target: Target, state: ModelState, observations: list[st.PodObservation]) -> None:
    samples = [o.sample for o in observations if o.sample is not None]
    payload = heat.due(state.heat, samples, CONFIG.heat_write_interval)
    if payload is None:
        return
    name = builders.configmap_name(target.name)
    try:
        await kube.patch(CONFIGMAPS, target.namespace, name, {"data": {contract.CONFIGMAP_KEY_HEATMAP: payload}})
    except (KubeError, aiohttp.ClientError, TimeoutError) as error:
        # Best effort: the heat map is an optimisation; status must still be written.  Not marked
        # written, so the next due pass tries again.
        metrics.WRITE_FAILURES.labels(metrics.WRITE_HEAT_MAP).inc()
        log.warning("%s/%s: heat map not written (%s): carrying on", target.namespace, target.name, error)
        return
    heat.written(state.heat, payload)
    log.info("%s/%s: heat map updated", target.namespace, target.name)


# --------------------------------------------------------------------------- kopf entry points


@kopf.on.resume(GROUP, VERSION, PLURAL, retries=HANDLER_RETRIES, backoff=HANDLER_BACKOFF, timeout=HANDLER_TIMEOUT)
@kopf.on.create(GROUP, VERSION, PLURAL, retries=HANDLER_RETRIES, backoff=HANDLER_BACKOFF, timeout=HANDLER_TIMEOUT)
@kopf.on.update(
    GROUP, VERSION, PLURAL, field="spec", retries=HANDLER_RETRIES, backoff=HANDLER_BACKOFF, timeout=HANDLER_TIMEOUT
)
async def reconcile(body: kopf.Body, **_: Any) -> None:
    try:
        await sync(body, "handler")
    except Permanent as error:
        raise kopf.PermanentError(f"{error.degradation.reason}: {error}") from None


def _waiting_out(state: ModelState) -> bool:
    """Whether a permanently failed WarmModel still waits before its next unchanged try.

    A refused child waits ``CONFIG.permanent_retry_interval`` (minutes by default), so that an
    outside fix (an admission policy relaxed, a quota raised) heals it without a spec edit and
    without hammering the API server.  A name conflict is looked at every tick: that is only
    reads, and the freed name is taken at once.
    """
    if state.failed_reason == st.REASON_CHILD_CONFLICT:
        return False
    return time.monotonic() - state.failed_at < CONFIG.permanent_retry_interval


@kopf.timer(
    GROUP,
    VERSION,
    PLURAL,
    interval=CONFIG.scrape_interval,
    initial_delay=min(2.0, CONFIG.scrape_interval),
    retries=None,
    backoff=HANDLER_BACKOFF,
    timeout=max(30.0, 3 * CONFIG.scrape_interval),
)
async def tick(body: kopf.Body, meta: kopf.Meta, **_: Any) -> None:
    """Every scrape interval: the same sync, so deleted children and cold pods are noticed."""
    state = _state(str(meta["uid"]))
    if state.failed_generation == meta.get("generation") and _waiting_out(state):
        return  # failed for good at this generation: wait for a change or the slow retry, do not hammer
    try:
        await sync(body, "timer")
    except Permanent:
        return  # status and an Event already say so
    except kopf.TemporaryError as error:
        log.info("%s/%s: tick: %s", meta.get("namespace"), meta.get("name"), error)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, retries=1)
async def forget(meta: kopf.Meta, **_: Any) -> None:
    """Children go with the owner references; only our memory of the object is dropped."""
    RUNTIME.states.pop(str(meta["uid"]), None)
    with contextlib.suppress(KeyError):
        metrics.WARM_PODS.remove(str(meta.get("namespace")), str(meta.get("name")))
