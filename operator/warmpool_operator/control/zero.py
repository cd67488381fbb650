"""Scale to zero, a pass step for pools with ``spec.pool.scaleToZero`` (rules/zero.py has the rules).

Each pass reads the requests the activator replicas hold (their annotations on the WarmModel), how
long the pool has been idle, and decides whether the pool is at zero; the scale step then asks the
Deployment for no pod or for the pool's size.  The Service's two EndpointSlices follow the pods:
the awake warm pods' addresses when there are any, the activator's otherwise.  The slice that
gains addresses is written before the one that loses them, so the Service is never without an
endpoint and no new connection is refused during a switch; connections already open stay where
they are (kube-proxy keeps established flows), so in-flight requests finish where they started.

A pass routes to pods that turned Ready before anything else it does (``route_ready_first``):
held requests wait on that switch.  With tracing on, a pass for held requests joins the hold's
trace (``hold_trace``), and the pass that leaves zero stamps the hold on the pod template
(``cold_start_trace``), so the new pods' cold starts join it too.

``ActivatorBoard`` holds the activator's addresses, fed by the watch of its Service's
EndpointSlices (app/handlers.py); a change pokes every scale-to-zero pool.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf

from warmpool.contract.pods import AWAKE_TRUE, LABEL_AWAKE
from warmpool.contract.zero import ANNOTATION_COLD_START_TRACE, DEFAULT_ACTIVATOR_PORT, cold_start_trace_value
from warmpool_operator.api.types import InvalidWarmModel
from warmpool_operator.control.children import ChildConflict, Settled, ensure
from warmpool_operator.io.kube import ENDPOINTSLICES, Kube
from warmpool_operator.io.watch_cache import Cache
from warmpool_operator.model import Obj, Target
from warmpool_operator.rules import zero
from warmpool_operator.rules.observation import PodObservation, pod_ready

log = logging.getLogger("warmpool.operator")

#: Seconds a pool gone to zero keeps its pods after its Service was switched to the activator:
#: kube-proxy applies a change of EndpointSlices within a second or two (its sync period), longer
#: on a loaded node.
ROUTE_SETTLE_SECONDS = 5.0


@dataclass
class ActivatorBoard:
    """The activator's ready addresses, from its Service's EndpointSlices (by slice uid)."""

    slices: dict[str, Obj] = field(default_factory=dict)

    def update(self, event_type: str | None, body: Mapping[str, Any]) -> bool:
        """Take one watch event; True when the addresses changed."""
        before = self.endpoints()
        uid = str((body.get("metadata") or {}).get("uid"))
        if event_type == "DELETED":
            self.slices.pop(uid, None)
        else:
            self.slices[uid] = {"ports": body.get("ports") or [], "endpoints": body.get("endpoints") or []}
        return self.endpoints() != before

    def endpoints(self) -> tuple[list[zero.Endpoint], int]:
        found, port = zero.ready_endpoints(self.slices.values())
        return found, port or DEFAULT_ACTIVATOR_PORT


@dataclass
class ZeroMemory:
    """What a scale-to-zero pool remembers between passes (in memory only)."""

    #: None until the first pass reads it back from the live Deployment (0 replicas: at zero)
    at_zero: bool | None = None
    #: monotonic time the pool last held a request (the pods' own activity is in the sleep state)
    last_held: float | None = None
    #: monotonic time the pool left zero (a pod started or woken for held requests is not idle yet)
    left_zero: float | None = None
    #: the latest activity of any pod seen so far (a pod's own record goes with the pod)
    last_active: float | None = None
    #: monotonic time the pool went to zero: its pods keep running ROUTE_SETTLE_SECONDS more
    went_to_zero: float | None = None
    #: the pod template's cold-start trace written when the pool last left zero, until it goes
    #: back: a later pass (its cache not yet showing the write, or the oldest hold gone) keeps it
    cold_start_stamp: str | None = None
    #: the bad held annotations already announced (``IgnoredHeld.news``): one Warning Event per
    #: distinct bad value, and only those still present are kept (as small as the annotations)
    announced_ignored: frozenset[tuple[str, str]] = frozenset()

    def settling(self, now: float) -> bool:
        """Whether the pods of a pool just gone to zero must still run: every node's kube-proxy
        follows the switch of the Service's slices to the activator only after a moment, and a
        connection it still sends to a stopped pod would be refused."""
        return bool(self.at_zero) and self.went_to_zero is not None and now - self.went_to_zero < ROUTE_SETTLE_SECONDS


def wake_wanted(target: Target, owner: Mapping[str, Any], wall: float) -> int:
    """Awake pods the held requests ask for: one, while the activator holds any."""
    policy = target.spec.pool.scale_to_zero
    if policy is None:
        return 0
    annotations = (owner.get("metadata") or {}).get("annotations") or {}
    return 1 if zero.held_requests(annotations, policy.hold_timeout_seconds, wall).requests else 0


def hold_trace(owner: Mapping[str, Any], wall: float) -> str | None:
    """The traceparent of a hold the activator reports on the WarmModel: the pass that serves the
    held requests joins the hold's trace (read before the spec is parsed, to parent the pass)."""
    try:
        policy = zero.scale_to_zero_of(owner)
    except InvalidWarmModel:
        return None  # the pass reports the spec; nothing is held for it
    if policy is None:
        return None
    annotations = (owner.get("metadata") or {}).get("annotations") or {}
    return zero.held_requests(annotations, policy.hold_timeout_seconds, wall).trace


def cold_start_trace(memory: ZeroMemory, target: Target, owner: Mapping[str, Any], live: Obj | None,
                     replicas: int, wall: float) -> str | None:
    """The pod template's cold-start trace (warmpool/contract/zero.py): a new one when this pass
    starts pods at zero for held requests, so their cold starts join the hold's trace; otherwise
    the one written then, or what the live template carries: a changed template rolls the pods."""
    policy = target.spec.pool.scale_to_zero
    if policy is None:
        return None
    if memory.cold_start_stamp is not None:
        return memory.cold_start_stamp
    spec = (live or {}).get("spec") or {}
    kept = ((spec.get("template") or {}).get("metadata") or {}).get("annotations", {}).get(ANNOTATION_COLD_START_TRACE)
    if live is not None and int(spec.get("replicas") or 0) == 0 and replicas > 0:
        annotations = (owner.get("metadata") or {}).get("annotations") or {}
        held = zero.held_requests(annotations, policy.hold_timeout_seconds, wall)
        if held.trace is not None:
            memory.cold_start_stamp = cold_start_trace_value(held.trace, wall + policy.hold_timeout_seconds)
            return memory.cold_start_stamp
    return kept if isinstance(kept, str) else None


def pod_endpoints(target: Target, refs: Sequence[Any], pods: Mapping[str, Obj],
                  readiness: Mapping[str, bool]) -> list[zero.Endpoint]:
    """The pods the Service's selector would pick: Ready (warm), labelled awake, not terminating."""
    out: list[zero.Endpoint] = []
    for ref in refs:
        meta = (pods.get(ref.uid) or {}).get("metadata") or {}
        if not readiness.get(ref.uid) or meta.get("deletionTimestamp"):
            continue
        if (meta.get("labels") or {}).get(LABEL_AWAKE) != AWAKE_TRUE:
            continue
        out.append(zero.Endpoint(ref.ip, ref.name, target.namespace, ref.uid))
    return out


def decide_and_announce(memory: ZeroMemory, target: Target, owner: Mapping[str, Any], live: Obj | None,
                        observations: Sequence[PodObservation], last_active: float | None, now: float,
                        wall: float) -> zero.ZeroState:
    """Decide whether the pool is at zero this pass, and post an Event (ScaledToZero,
    ScaledFromZero, HeldAnnotationIgnored) when that changes or a held value is refused."""
    policy = target.spec.pool.scale_to_zero
    assert policy is not None
    annotations = (owner.get("metadata") or {}).get("annotations") or {}
    held = zero.held_requests(annotations, policy.hold_timeout_seconds, wall)
    announce_ignored(memory, owner, held.ignored)
    if memory.at_zero is None:
        memory.at_zero = live is not None and int((live.get("spec") or {}).get("replicas") or 0) == 0
    if held.requests:
        memory.last_held = now
    live_pods = [o for o in observations if not o.terminating]
    settled = [o for o in live_pods if o.warm or o.asleep or o.failure]
    memory.last_active = max((t for t in (last_active, memory.last_active) if t is not None), default=None)
    latest = max((t for t in (memory.last_active, memory.last_held, memory.left_zero) if t is not None),
                 default=None)
    made = zero.decide(policy, zero.ZeroInputs(
        held=held.requests, live_pods=len(live_pods), settled_pods=len(settled),
        idle_seconds=None if latest is None else now - latest, was_at_zero=memory.at_zero))
    if made.change is not None:
        if made.at_zero:
            memory.went_to_zero = now
            memory.cold_start_stamp = None  # the template keeps it; the next leave stamps its own
            _event(owner, zero.REASON_SCALED_TO_ZERO, f"scaled to zero: {made.change}; sleeping pods released too; "
                   "the activator holds the next request and starts a pod")
        else:
            memory.left_zero = now
            _event(owner, zero.REASON_SCALED_FROM_ZERO, f"leaving zero: {made.change}; "
                   + ("waking a sleeping pod" if any(o.asleep for o in live_pods) else "starting a pod"))
    memory.at_zero = made.at_zero
    return zero.ZeroState(made.at_zero, held.requests)


def announce_ignored(memory: ZeroMemory, owner: Mapping[str, Any], ignored: Sequence[zero.IgnoredHeld]) -> None:
    """A Warning Event for each bad held annotation value not announced before: the key, and why
    it was not counted (the admission policy refuses such values too; one that got past it costs
    one Event per value, and an activator whose clock runs far ahead one while it stays ahead, not
    one per pass or per rewrite)."""
    present = frozenset(bad.news for bad in ignored)
    for bad in ignored:
        if bad.news not in memory.announced_ignored:
            _event(owner, zero.REASON_HELD_IGNORED, f"annotation {bad.key} not counted: {bad.why}", type_="Warning")
    memory.announced_ignored = present


def _event(owner: Mapping[str, Any], reason: str, message: str, type_: str = "Normal") -> None:
    kopf.event(owner, type=type_, reason=reason, message=message[:1024])  # type: ignore[arg-type]
    meta = owner.get("metadata") or {}
    level = logging.WARNING if type_ == "Warning" else logging.INFO
    log.log(level, "%s/%s: %s", meta.get("namespace"), meta.get("name"), message)


async def route(kube: Kube, cache: Cache, target: Target, owner: Mapping[str, Any], settled: Settled,
                pods: Sequence[zero.Endpoint], board: ActivatorBoard) -> list[ChildConflict]:
    """Write the Service's two slices, the one gaining addresses first (see the module docstring)."""
    activators, port = board.endpoints()
    pods_slice, activator_slice = zero.build_slices(target, pods, activators, port)
    # To pods: the pods' slice first.  To the activator: the activator's first.
    order = (pods_slice, activator_slice) if pods else (activator_slice, pods_slice)
    conflicts: list[ChildConflict] = []
    for desired in order:
        try:
            await ensure(kube, cache, desired, owner, settled)
        except ChildConflict as conflict:
            conflicts.append(conflict)
    if not pods and not activators:
        log.warning("%s/%s: no awake warm pod and no activator address: the Service has no endpoint "
                    "(is the activator running, and --activator-service set?)", target.namespace, target.name)
    return conflicts


async def route_ready_first(kube: Kube, cache: Cache, target: Target, owner: Mapping[str, Any], settled: Settled,
                            memory: ZeroMemory, refs: Sequence[Any], pods: Mapping[str, Obj],
                            board: ActivatorBoard) -> None:
    """At the start of a pass, route the Service to the pods that turned Ready, before the pass
    scrapes, decides and directs them (a few hundred milliseconds on a busy node): requests the
    activator holds wait on this switch.  Only towards pods, and only for a pool not at zero;
    the pass's own routing step writes the same slices again only if they differ, and reports
    a slice that is not ours."""
    endpoints = ready_first(target, memory, refs, pods)
    if endpoints:
        await route(kube, cache, target, owner, settled, endpoints, board)


def ready_first(target: Target, memory: ZeroMemory, refs: Sequence[Any],
                pods: Mapping[str, Obj]) -> list[zero.Endpoint]:
    """The pods :func:`route_ready_first` routes to: Ready, awake, not terminating, of a
    scale-to-zero pool known not to be at zero (none otherwise)."""
    if target.spec.pool.scale_to_zero is None or memory.at_zero is not False:
        return []
    return pod_endpoints(target, refs, pods, {ref.uid: pod_ready(pods[ref.uid]) for ref in refs})


async def follow(kube: Kube, cache: Cache, target: Target, owner: Mapping[str, Any], settled: Settled,
                 pods: Sequence[zero.Endpoint] | None, board: ActivatorBoard) -> list[ChildConflict]:
    """The Service's routing this pass: ``pods`` None (no scaleToZero), its selector; else our two
    slices, to ``pods`` or (empty) to the activator."""
    if pods is None:
        await unroute(kube, cache, target)
        return []
    return await route(kube, cache, target, owner, settled, pods, board)


async def unroute(kube: Kube, cache: Cache, target: Target) -> None:
    """A pool without scaleToZero: its Service selects its pods again, and our slices go (kube-proxy
    would merge them with the EndpointSlice controller's)."""
    for name in zero.slice_names(target.name):
        if cache.child("EndpointSlice", target.namespace, name) is not None:
            await kube.delete(ENDPOINTSLICES, target.namespace, name)
