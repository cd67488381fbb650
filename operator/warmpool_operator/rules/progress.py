"""Each worker pod's cold-start progress, for status.pods (pure).

What a pod reports on its own /metrics (phases reached, layers resident, warm-up prefills done
and planned) is read, never guessed; before it reports anything, the kubelet's view of the pod
(Pending, ContainerCreating, CrashLoopBackOff...) stands in.  The time left is estimated from
the pool's own past cold starts: their median, less this pod's time since its process started.
No peer reports one (vLLM's readiness stages are not merged), so the median of what this pool
has done is the honest basis; without one there is no estimate.

The list is bounded (MAX_LISTED_PODS): pods that need a look come first (failing, then
warming), then warm ones; the rest of a large pool is counted, not listed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from warmpool.contract.metrics import PHASES
from warmpool_operator.api.types import MAX_LISTED_PODS, PodProgress
from warmpool_operator.model import Sample
from warmpool_operator.rules.observation import PodObservation

#: The stage of a pod whose engine sleeps (spec.pool.sleep).
STAGE_ASLEEP = "asleep"
#: The cold-start phase a warm pod has reached.
STAGE_READY = PHASES[-1]


@dataclass(frozen=True)
class PoolProgress:
    """status.pods and status.podsNotListed."""

    pods: list[PodProgress]
    not_listed: int


def _stage(pod: PodObservation) -> str:
    sample = pod.sample
    if pod.failure is None and sample is not None and sample.ok:
        if (sample.sleep_level or 0) > 0:
            return STAGE_ASLEEP
        reached = [phase for phase in PHASES if phase in sample.phase_durations]
        if reached:
            return reached[-1]
    return pod.state or "Pending"


def _seconds_left(pod: PodObservation, median_cold_start: float | None, now: float | None) -> int | None:
    """The pool's median cold start less this pod's time since its process started; None when
    there is nothing to go by (no past cold start, no start time, no clock) or nothing left to wait
    for (warm, failing)."""
    sample = pod.sample
    if pod.warm or pod.failure is not None or median_cold_start is None or now is None:
        return None
    if sample is None or not sample.ok or "ready" in sample.phase_durations:
        return None
    started = sample.phase_timestamps.get("process_start")
    if started is None or not math.isfinite(started):
        return None
    return max(0, math.ceil(median_cold_start - max(0.0, now - started)))


def _count(values: Iterable[float]) -> int:
    return int(sum(v for v in values if math.isfinite(v)))


def _prefills(sample: Sample | None) -> tuple[int | None, int | None]:
    """(done, planned) of the worker's last warm-up plan, per bucket summed.  Planned is what the
    plan needs: a bucket whose latency settled early needs only the prefills it ran (the worker's
    needed-prefills gauge; a worker without it: the plan's count).  Done is a counter since the
    process started (a later warm-up adds to it), so a bucket shows at most what it needs."""
    if sample is None or not sample.ok or not sample.planned_prefills:
        return None, None
    needed = {bucket: sample.needed_prefills.get(bucket, count) for bucket, count in sample.planned_prefills.items()}
    done = {bucket: min(sample.prefills.get(bucket, 0.0), count) for bucket, count in needed.items()}
    return _count(done.values()), _count(needed.values())


def pod_progress(pod: PodObservation, median_cold_start: float | None, now: float | None) -> PodProgress:
    """One pod's entry in status.pods."""
    sample = pod.sample if pod.sample is not None and pod.sample.ok else None
    done, planned = _prefills(sample)
    return PodProgress(
        name=pod.name,
        stage=_stage(pod),
        warm=pod.warm,
        layers_resident=None if sample is None else sample.layers_resident,
        layers_total=None if sample is None else sample.layers_total,
        prefills_done=done,
        prefills_planned=planned,
        seconds_left=_seconds_left(pod, median_cold_start, now),
        message=None if pod.failure is None else pod.failure[:1024],
    )


def _order(pod: PodObservation) -> tuple[int, str]:
    """Failing pods first, then those still warming, then warm ones; by name within each."""
    return (0 if pod.failure is not None else 2 if pod.warm else 1), pod.name


def pool_progress(pods: Iterable[PodObservation], median_cold_start: float | None, now: float | None,
                  limit: int = MAX_LISTED_PODS) -> PoolProgress:
    """status.pods for the pool's live pods: at most ``limit`` listed, the rest counted."""
    ordered = sorted(pods, key=_order)
    listed = [pod_progress(pod, median_cold_start, now) for pod in ordered[:limit]]
    return PoolProgress(pods=listed, not_listed=max(0, len(ordered) - limit))
