"""The WarmModel's status, computed from what a pass observed (pure).

Inputs are the live objects and the workers' own metrics; the previous status is read
only to keep a condition's ``lastTransitionTime`` when its status did not change (that
is what the field means), never to decide anything.  All four conditions are written
from the first visit on, each with a CamelCase reason; a feature's own condition (the
Predictive one of spec.pool.predictive) is written only while the feature is on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from warmpool.contract.api import (
    CONDITION_DEGRADED,
    CONDITION_PROGRESSING,
    CONDITION_READY,
    CONDITION_WARMUP_GATED,
    Tier,
)
from warmpool_operator.api.types import (
    Condition,
    ForecastStatus,
    LearnedBucketsStatus,
    TierCounts,
    WarmModelSpec,
    WarmModelStatus,
    dump_status,
)
from warmpool_operator.rules.builders import selector_string, service_name
from warmpool_operator.rules.observation import ColdStarts, PodObservation, wake_figures
from warmpool_operator.rules.progress import pool_progress
from warmpool_operator.rules.zero import REASON_SCALED_TO_ZERO, REASON_STARTING_ON_DEMAND, ZeroState

# Reasons (CamelCase, one word each).
REASON_MIN_WARM_REACHED = "MinWarmReached"
REASON_NO_WARM_MINIMUM = "NoWarmMinimum"
REASON_BELOW_MIN_WARM = "BelowMinWarm"
REASON_RECONCILING = "Reconciling"
REASON_INVALID_SPEC = "InvalidSpec"
REASON_CHILD_REJECTED = "ChildRejected"
#: A child's name is held by an object this WarmModel does not own: nothing is written to it.
REASON_CHILD_CONFLICT = "ChildConflict"
#: The model's hostPath (or nodeCache) lies outside the operator's --allowed-host-path prefixes.
REASON_HOST_PATH_NOT_ALLOWED = "HostPathNotAllowed"
REASON_AS_EXPECTED = "AsExpected"
REASON_ROLLING_OUT = "RollingOut"
REASON_SCALING = "Scaling"
REASON_WARMING_UP = "WarmingUp"
REASON_STABLE = "Stable"
REASON_MEMORY_PRESSURE = "MemoryPressure"
REASON_FULL_WARMUP = "FullWarmup"
REASON_METRICS_UNAVAILABLE = "MetricsUnavailable"
REASON_NO_PODS = "NoPods"
REASON_ROLLOUT_STALLED = "RolloutStalled"
REASON_PODS_FAILING = "PodsFailing"

#: Failing pods named in the Ready condition's message (the rest are counted).
FAILURES_SHOWN = 3

# Events on the WarmModel, once per transition of its Ready condition (reasons, CamelCase).
#: Ready turned True: minWarm pods verified warm (or minWarm 0, or at zero on demand).
EVENT_POOL_READY = "PoolReady"
#: Ready turned False while the spec is fine: fewer warm pods than minWarm.
EVENT_BELOW_MIN_WARM = "BelowMinWarm"


def _condition(
    type_: str, status: str, reason: str, message: str, generation: int, previous: Mapping[str, Any], now: str
) -> Condition:
    old = previous.get(type_) or {}
    since = old.get("lastTransitionTime") if old.get("status") == status else None
    return Condition(
        type=type_,
        status=status,  # type: ignore[arg-type]
        reason=reason,
        message=message[:32768],
        observed_generation=generation,
        last_transition_time=since or now,
    )


def previous_conditions(status: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    return {str(c.get("type")): c for c in (status or {}).get("conditions") or [] if isinstance(c, Mapping)}


@dataclass(frozen=True)
class Degradation:
    reason: str
    message: str


@dataclass(frozen=True)
class _Stamp:
    """Makes the pass's conditions: one generation, one clock reading, one previous status."""

    generation: int
    previous: Mapping[str, Any]
    now: str

    def __call__(self, type_: str, status: str, reason: str, message: str) -> Condition:
        return _condition(type_, status, reason, message, self.generation, self.previous, self.now)


def _degraded_conditions(cond: _Stamp, why: Degradation) -> list[Condition]:
    return [
        cond(CONDITION_READY, "False", why.reason, f"not reconciled: {why.message}"),
        cond(CONDITION_PROGRESSING, "False", why.reason, "waiting for the spec to be fixed"),
        cond(CONDITION_DEGRADED, "True", why.reason, why.message),
        cond(CONDITION_WARMUP_GATED, "Unknown", why.reason, "no pods are managed"),
    ]


def _ready_condition(cond: _Stamp, min_warm: int, pods: Sequence[PodObservation],
                     zero: ZeroState | None = None) -> Condition:
    warm = sum(p.warm for p in pods)
    ready = sum(p.ready for p in pods)
    if zero is not None and warm == 0:
        if zero.held:
            return cond(CONDITION_READY, "False", REASON_STARTING_ON_DEMAND,
                        f"{zero.held} request(s) held by the activator while a pod wakes or starts")
        if zero.at_zero:
            return cond(CONDITION_READY, "True", REASON_SCALED_TO_ZERO,
                        "at zero, will start on demand: the activator holds the next request and a pod "
                        "is woken or started for it")
    if min_warm == 0:
        return cond(CONDITION_READY, "True", REASON_NO_WARM_MINIMUM, f"minWarm is 0; {warm} pods warm")
    if warm >= min_warm:
        return cond(CONDITION_READY, "True", REASON_MIN_WARM_REACHED,
                    f"{warm} of {len(pods)} pods verified warm (minWarm {min_warm})")
    counts = f"{warm} of {len(pods)} pods verified warm, {ready} Ready; minWarm is {min_warm}"
    # Ready by the kubelet, yet unreadable: what keeps the pool from being verified warm.
    unreadable = sorted(p.name for p in pods if p.ready and p.metrics_unavailable and not p.node_lost)
    if unreadable:
        return cond(CONDITION_READY, "False", REASON_METRICS_UNAVAILABLE,
                    f"{counts}; metrics unavailable from: {', '.join(unreadable)}")
    return cond(CONDITION_READY, "False", REASON_BELOW_MIN_WARM, counts + _failing_pods(pods))


def _failing(pod: PodObservation) -> bool:
    """A pod with a failure to show: not Ready, or on a lost node (whose Ready nobody updates yet)."""
    return pod.failure is not None and (not pod.ready or pod.node_lost)


def _failing_pods(pods: Sequence[PodObservation]) -> str:
    """Why pods are not coming up, when some are failing (the first few, each with its container's
    last words): what keeps the pool below minWarm, at a glance in `kubectl describe wm`."""
    failing = sorted((p for p in pods if _failing(p)), key=lambda p: p.name)
    if not failing:
        return ""
    shown = "; ".join(f"{p.name}: {p.failure}" for p in failing[:FAILURES_SHOWN])
    more = f"; and {len(failing) - FAILURES_SHOWN} more" if len(failing) > FAILURES_SHOWN else ""
    return f"; failing: {shown}{more}"


def _progressing_condition(cond: _Stamp, pods: Sequence[PodObservation],
                           deployment: Mapping[str, Any] | None) -> Condition:
    warm = sum(p.warm for p in pods)
    dep_spec = (deployment or {}).get("spec") or {}
    dep_status = (deployment or {}).get("status") or {}
    want = int(dep_spec.get("replicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    total = int(dep_status.get("replicas") or 0)
    generation_seen = int(dep_status.get("observedGeneration") or 0) >= int(
        ((deployment or {}).get("metadata") or {}).get("generation") or 0
    )
    failing = sorted(f"{p.name}: {p.failure}" for p in pods if _failing(p))
    rolling = deployment is not None and (not generation_seen or updated < want or total > want)
    if failing:
        # A pod that crash-loops will not come up by itself: say so instead of "rolling out".
        return cond(CONDITION_PROGRESSING, "False", REASON_ROLLOUT_STALLED if rolling else REASON_PODS_FAILING,
                    ("rollout stalled: " if rolling else "")
                    + f"{len(failing)} pod(s) failing ({'; '.join(failing)}); {warm} warm pod(s) keep serving")
    if deployment is None:
        return cond(CONDITION_PROGRESSING, "True", REASON_RECONCILING, "creating children")
    if rolling:
        return cond(CONDITION_PROGRESSING, "True", REASON_ROLLING_OUT,
                    f"{updated} of {want} pods updated, {total} exist")
    if len(pods) != want:
        return cond(CONDITION_PROGRESSING, "True", REASON_SCALING, f"{len(pods)} pods, want {want}")
    if warm < len(pods):
        return cond(CONDITION_PROGRESSING, "True", REASON_WARMING_UP,
                    f"{len(pods) - warm} of {len(pods)} pods not yet verified warm")
    return cond(CONDITION_PROGRESSING, "False", REASON_STABLE, "all pods warm")


def _gated_condition(cond: _Stamp, pods: Sequence[PodObservation]) -> Condition:
    unknown = [p.name for p in pods if p.decision is None or p.decision.tier is Tier.UNKNOWN]
    gated = [p for p in pods if p.decision is not None and p.decision.tier in (Tier.TRUNCATED, Tier.PAUSED)]
    if gated:
        detail = ", ".join(f"{p.name}={p.decision.tier.value}" for p in gated if p.decision is not None)
        extra = f"; metrics unavailable: {', '.join(sorted(unknown))}" if unknown else ""
        return cond(CONDITION_WARMUP_GATED, "True", REASON_MEMORY_PRESSURE, f"{detail}{extra}")
    if unknown:
        return cond(CONDITION_WARMUP_GATED, "Unknown", REASON_METRICS_UNAVAILABLE,
                    f"no trustworthy memory figure from: {', '.join(sorted(unknown))}")
    if not pods:
        return cond(CONDITION_WARMUP_GATED, "False", REASON_NO_PODS, "no worker pods")
    return cond(CONDITION_WARMUP_GATED, "False", REASON_FULL_WARMUP, "every pod runs the full warm-up")


def _tier_counts(pods: Iterable[PodObservation]) -> TierCounts:
    counts = TierCounts()
    for pod in pods:
        tier = pod.decision.tier if pod.decision is not None else Tier.UNKNOWN
        setattr(counts, tier.value, getattr(counts, tier.value) + 1)
    return counts


def compute_status(
    *,
    name: str,
    spec: WarmModelSpec | None,
    generation: int,
    pods: Iterable[PodObservation],
    deployment: Mapping[str, Any] | None,
    cold_starts: ColdStarts,
    previous: Mapping[str, Any] | None,
    now: str,
    degraded: Degradation | None = None,
    forecast: ForecastStatus | None = None,
    learned_buckets: LearnedBucketsStatus | None = None,
    extra_conditions: Sequence[tuple[str, str, str, str]] = (),
    zero: ZeroState | None = None,
    wall: float | None = None,
    url: str | None = None,
) -> dict[str, Any]:
    """The status subresource's body.  ``extra_conditions``: (type, status, reason, message) of
    conditions beyond the four, written only when their feature is on; ``wall``: the clock (unix
    seconds) the pods' time left is estimated by (None: no estimate); ``url``: status.url."""
    cond = _Stamp(generation, previous_conditions(previous), now)
    live = [p for p in pods if not p.terminating]
    if degraded is not None or spec is None:
        conditions = _degraded_conditions(cond, degraded or Degradation(REASON_INVALID_SPEC,
                                                                        "the spec could not be parsed"))
    else:
        conditions = [
            _ready_condition(cond, spec.pool.min_warm, live, zero),
            _progressing_condition(cond, live, deployment),
            cond(CONDITION_DEGRADED, "False", REASON_AS_EXPECTED, "spec reconciled"),
            _gated_condition(cond, live),
            *(cond(*extra) for extra in extra_conditions),
        ]
    counts = _tier_counts(live)
    progress = pool_progress(live, cold_starts.figures().p50_seconds, wall)
    status = WarmModelStatus(
        observed_generation=generation,
        conditions=conditions,
        replicas=len(live),
        ready_replicas=sum(p.ready for p in live),
        warm_replicas=sum(p.warm for p in live),
        tier_counts=counts,
        tier_summary=counts.summary(),
        cold_start=cold_starts.figures(),
        awake_replicas=sum(p.ready and not p.asleep for p in live),
        sleeping_replicas=sum(p.asleep for p in live),
        held=None if zero is None else zero.held,
        wake=wake_figures(live),
        selector=selector_string(name),
        forecast=forecast,
        learned_buckets=learned_buckets,
        url=url,
        pods=progress.pods or None,
        pods_not_listed=progress.not_listed or None,
    )
    return dump_status(status)


def pool_url(name: str, namespace: str, port: int) -> str:
    """status.url: the pool Service's in-cluster URL.  The domain is left to the cluster's DNS
    search path (every pod's resolv.conf completes "<service>.<namespace>.svc"), so it is right
    whatever the cluster's domain is."""
    return f"http://{service_name(name)}.{namespace}.svc:{port}"


@dataclass(frozen=True)
class PoolEvent:
    """An Event to post on the WarmModel."""

    type: str  # Normal or Warning
    reason: str
    message: str


def ready_transitions(previous: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[PoolEvent]:
    """The Events a status change calls for: Ready turning True, and Ready turning False below
    minWarm (a Degraded spec has its own Event).  Read from the status before and after the
    write, so each transition is announced once, also across an operator restart."""
    before = previous_conditions(previous).get(CONDITION_READY) or {}
    after = previous_conditions(current).get(CONDITION_READY) or {}
    if before.get("status") == after.get("status"):
        return []
    message = str(after.get("message") or "")
    if after.get("status") == "True":
        return [PoolEvent("Normal", EVENT_POOL_READY, f"{after.get('reason')}: {message}")]
    degraded = previous_conditions(current).get(CONDITION_DEGRADED) or {}
    if before.get("status") == "True" and after.get("status") == "False" and degraded.get("status") != "True":
        return [PoolEvent("Warning", EVENT_BELOW_MIN_WARM, f"{after.get('reason')}: {message}")]
    return []
