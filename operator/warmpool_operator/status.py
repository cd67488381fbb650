"""The WarmModel's status, computed from what was observed this tick (pure).

Inputs are the live objects and the workers' own metrics; the previous status is read
only to keep a condition's ``lastTransitionTime`` when its status did not change (that
is what the field means), never to decide anything.  All four conditions are written
from the first visit on, each with a CamelCase reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from warmpool import contract
from warmpool.contract import Tier
from warmpool_operator import sleeping
from warmpool_operator.api import (
    ColdStart,
    Condition,
    ForecastStatus,
    LearnedBucketsStatus,
    TierCounts,
    WakeFigures,
    WarmModelSpec,
    WarmModelStatus,
    dump_status,
)
from warmpool_operator.builders import selector_string
from warmpool_operator.gating import Decision
from warmpool_operator.scaling import extra_from_live as extra_from_live  # the rules live in scaling.py
from warmpool_operator.scaling import extra_pods as extra_pods
from warmpool_operator.scrape import Sample

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
# The Predictive condition's (spec.pool.predictive, #16; written by prediction_status.py).
REASON_PRE_WARMING = "PreWarming"  # True: the forecast asks for more pods than the reactive count
REASON_FORECASTING = "Forecasting"  # forecasting; the reactive count is enough for now
REASON_SHADOW = "ShadowOnly"  # spec.pool.predictive.enabled false: forecast reported, not acted on
REASON_HISTORY_LOADING = "HistoryLoading"
REASON_NO_FORECAST_YET = "NoForecastYet"
#: The workers' request metrics are missing or garbage: reactive scaling only.
REASON_REQUEST_METRICS_UNAVAILABLE = "RequestMetricsUnavailable"
REASON_CAPACITY_NOT_MEASURED = "CapacityNotMeasured"

#: Container waiting reasons that mean "this will not come up by itself soon".
FAILING_WAITING_REASONS = frozenset({
    "CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerError",
    "CreateContainerConfigError", "RunContainerError", "CommandNotRunnable",
})

#: Cold starts remembered per WarmModel for p50/p95.
COLD_START_WINDOW = 100


@dataclass(frozen=True)
class PodObservation:
    uid: str
    name: str
    ready: bool  # the pod's Ready condition (readiness probe on /readyz)
    terminating: bool
    sample: Sample | None
    decision: Decision | None
    #: Why the pod is failing (crash-looping, image not pulled...), None when it is not.
    failure: str | None = None

    @property
    def warm(self) -> bool:
        """Verified warm: Ready *and* the worker's own metrics say warm (ready == 1)."""
        return (
            self.ready
            and not self.terminating
            and self.sample is not None
            and self.sample.ok
            and self.sample.ready
        )

    @property
    def metrics_unavailable(self) -> bool:
        """Nothing trustworthy was read from the worker's /metrics this tick."""
        return self.sample is None or not self.sample.ok

    @property
    def asleep(self) -> bool:
        """The worker's own metrics say its engine sleeps (spec.pool.sleep)."""
        return self.sample is not None and self.sample.ok and (self.sample.sleep_level or 0) > 0

    @property
    def warming(self) -> bool:
        """Ready, and the worker's own metrics say it is not warm yet (read, not guessed)."""
        return self.ready and not self.terminating and not self.metrics_unavailable and not self.warm


@dataclass
class ColdStarts:
    """Recent cold starts (pod uid -> (ready timestamp, seconds)), bounded."""

    seen: dict[str, tuple[float, float]] = field(default_factory=dict)

    def record(self, uid: str, sample: Sample | None) -> None:
        if sample is None or not sample.ok or uid in self.seen:
            return
        seconds = sample.phase_durations.get("ready")
        at = sample.phase_timestamps.get("ready")
        if seconds is None or at is None or not math.isfinite(seconds) or seconds < 0:
            return
        self.seen[uid] = (at, seconds)
        if len(self.seen) > COLD_START_WINDOW:
            oldest = min(self.seen, key=lambda k: self.seen[k][0])
            del self.seen[oldest]

    def figures(self) -> ColdStart:
        if not self.seen:
            return ColdStart()
        values = sorted(seconds for _, seconds in self.seen.values())
        last = max(self.seen.values())[1]
        return ColdStart(
            last_seconds=round(last, 3),
            p50_seconds=round(percentile(values, 50), 3),
            p95_seconds=round(percentile(values, 95), 3),
        )


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values (non-empty)."""
    rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


def pod_failure(pod: Mapping[str, Any]) -> str | None:
    """A short account of why a pod that is not Ready is failing, from its container statuses:
    a container waiting for a failing reason, or one that exited non-zero and was restarted."""
    status = pod.get("status") or {}
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        if container.get("ready"):
            continue
        waiting = (container.get("state") or {}).get("waiting") or {}
        last = (container.get("lastState") or {}).get("terminated") or {}
        restarts = int(container.get("restartCount") or 0)
        exit_code = last.get("exitCode")
        if waiting.get("reason") in FAILING_WAITING_REASONS or (restarts > 0 and exit_code not in (None, 0)):
            reason = waiting.get("reason") or last.get("reason") or "Restarting"
            detail = f"exit code {exit_code}, " if exit_code is not None else ""
            message = str(waiting.get("message") or last.get("message") or "").strip().splitlines()
            tail = f": {message[-1][:200]}" if message else ""
            return f"container {container.get('name')} {reason} ({detail}{restarts} restarts){tail}"
    return None


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
) -> dict[str, Any]:
    """``extra_conditions``: (type, status, reason, message) of conditions beyond the four, written
    only when their feature is on (the Predictive condition of spec.pool.predictive)."""
    prev = previous_conditions(previous)
    pods = [p for p in pods if not p.terminating]
    wake = wake_figures(pods)
    counts = TierCounts()
    for pod in pods:
        tier = pod.decision.tier if pod.decision is not None else Tier.UNKNOWN
        setattr(counts, tier.value, getattr(counts, tier.value) + 1)
    warm = sum(p.warm for p in pods)
    ready = sum(p.ready for p in pods)

    def cond(type_: str, status: str, reason: str, message: str) -> Condition:
        return _condition(type_, status, reason, message, generation, prev, now)

    conditions: list[Condition] = []
    if degraded is not None or spec is None:
        why = degraded or Degradation(REASON_INVALID_SPEC, "the spec could not be parsed")
        conditions = [
            cond(contract.CONDITION_READY, "False", why.reason, f"not reconciled: {why.message}"),
            cond(contract.CONDITION_PROGRESSING, "False", why.reason, "waiting for the spec to be fixed"),
            cond(contract.CONDITION_DEGRADED, "True", why.reason, why.message),
            cond(contract.CONDITION_WARMUP_GATED, "Unknown", why.reason, "no pods are managed"),
        ]
    else:
        min_warm = spec.pool.min_warm
        if min_warm == 0:
            conditions.append(
                cond(contract.CONDITION_READY, "True", REASON_NO_WARM_MINIMUM, f"minWarm is 0; {warm} pods warm")
            )
        elif warm >= min_warm:
            conditions.append(
                cond(
                    contract.CONDITION_READY,
                    "True",
                    REASON_MIN_WARM_REACHED,
                    f"{warm} of {len(pods)} pods verified warm (minWarm {min_warm})",
                )
            )
        else:
            # Ready by the kubelet, yet unreadable: what keeps the pool from being verified warm.
            unreadable = sorted(p.name for p in pods if p.ready and p.metrics_unavailable)
            if unreadable:
                conditions.append(
                    cond(
                        contract.CONDITION_READY,
                        "False",
                        REASON_METRICS_UNAVAILABLE,
                        f"{warm} of {len(pods)} pods verified warm, {ready} Ready; minWarm is {min_warm}; "
                        f"metrics unavailable from: {', '.join(unreadable)}",
                    )
                )
            else:
                conditions.append(
                    cond(
                        contract.CONDITION_READY,
                        "False",
                        REASON_BELOW_MIN_WARM,
                        f"{warm} of {len(pods)} pods verified warm, {ready} Ready; minWarm is {min_warm}",
                    )
                )

        dep_spec = (deployment or {}).get("spec") or {}
        dep_status = (deployment or {}).get("status") or {}
        want = int(dep_spec.get("replicas") or 0)
        updated = int(dep_status.get("updatedReplicas") or 0)
        total = int(dep_status.get("replicas") or 0)
        dep_gen_seen = int(dep_status.get("observedGeneration") or 0) >= int(
            ((deployment or {}).get("metadata") or {}).get("generation") or 0
        )
        failing = sorted(f"{p.name}: {p.failure}" for p in pods if p.failure and not p.ready)
        rolling = deployment is not None and (not dep_gen_seen or updated < want or total > want)
        if failing:
            # A pod that crash-loops will not come up by itself: say so instead of "rolling out".
            conditions.append(
                cond(
                    contract.CONDITION_PROGRESSING,
                    "False",
                    REASON_ROLLOUT_STALLED if rolling else REASON_PODS_FAILING,
                    ("rollout stalled: " if rolling else "")
                    + f"{len(failing)} pod(s) failing ({'; '.join(failing)}); {warm} warm pod(s) keep serving",
                )
            )
        elif deployment is None:
            conditions.append(cond(contract.CONDITION_PROGRESSING, "True", REASON_RECONCILING, "creating children"))
        elif rolling:
            conditions.append(
                cond(
                    contract.CONDITION_PROGRESSING,
                    "True",
                    REASON_ROLLING_OUT,
                    f"{updated} of {want} pods updated, {total} exist",
                )
            )
        elif len(pods) != want:
            conditions.append(
                cond(contract.CONDITION_PROGRESSING, "True", REASON_SCALING, f"{len(pods)} pods, want {want}")
            )
        elif warm < len(pods):
            conditions.append(
                cond(
                    contract.CONDITION_PROGRESSING,
                    "True",
                    REASON_WARMING_UP,
                    f"{len(pods) - warm} of {len(pods)} pods not yet verified warm",
                )
            )
        else:
            conditions.append(cond(contract.CONDITION_PROGRESSING, "False", REASON_STABLE, "all pods warm"))

        conditions.append(cond(contract.CONDITION_DEGRADED, "False", REASON_AS_EXPECTED, "spec reconciled"))

        unknown = [p.name for p in pods if p.decision is None or p.decision.tier is Tier.UNKNOWN]
        gated = [p for p in pods if p.decision is not None and p.decision.tier in (Tier.TRUNCATED, Tier.PAUSED)]
        if gated:
            detail = ", ".join(f"{p.name}={p.decision.tier.value}" for p in gated if p.decision is not None)
            extra = f"; metrics unavailable: {', '.join(sorted(unknown))}" if unknown else ""
            conditions.append(
                cond(contract.CONDITION_WARMUP_GATED, "True", REASON_MEMORY_PRESSURE, f"{detail}{extra}")
            )
        elif unknown:
            conditions.append(
                cond(
                    contract.CONDITION_WARMUP_GATED,
                    "Unknown",
                    REASON_METRICS_UNAVAILABLE,
                    f"no trustworthy memory figure from: {', '.join(sorted(unknown))}",
                )
            )
        elif not pods:
            conditions.append(cond(contract.CONDITION_WARMUP_GATED, "False", REASON_NO_PODS, "no worker pods"))
        else:
            conditions.append(
                cond(contract.CONDITION_WARMUP_GATED, "False", REASON_FULL_WARMUP, "every pod runs the full warm-up")
            )
        conditions += [cond(*extra) for extra in extra_conditions]

    status = WarmModelStatus(
        observed_generation=generation,
        conditions=conditions,
        replicas=len(pods),
        ready_replicas=ready,
        warm_replicas=warm,
        tier_counts=counts,
        tier_summary=counts.summary(),
        cold_start=cold_starts.figures(),
        awake_replicas=sum(p.ready and not p.asleep for p in pods),
        sleeping_replicas=sum(p.asleep for p in pods),
        wake=wake,
        selector=selector_string(name),
        forecast=forecast,
        learned_buckets=learned_buckets,
    )
    return dump_status(status)


def wake_figures(pods: Iterable[PodObservation]) -> WakeFigures | None:
    """Wake p50/p95 over the wakes the live pods' histograms hold; None before any wake."""
    merged = sleeping.merge_buckets(p.sample.wake_buckets for p in pods if p.sample is not None and p.sample.ok)
    p50, p95 = sleeping.quantile(merged, 0.5), sleeping.quantile(merged, 0.95)
    if p50 is None or p95 is None:
        return None
    return WakeFigures(p50_seconds=round(p50, 4), p95_seconds=round(p95, 4))

