"""What a pass observed of a WarmModel's worker pods (pure): each pod's observation, the
pool's cold starts and wake figures, and what the watch shows of a pod that a pass reads."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from warmpool_operator.api.types import ColdStart, WakeFigures
from warmpool_operator.model import Sample
from warmpool_operator.rules import sleep_wake
from warmpool_operator.rules.gating import Decision

#: Container waiting reasons that mean "this will not come up by itself soon".
FAILING_WAITING_REASONS = frozenset({
    "CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerError",
    "CreateContainerConfigError", "RunContainerError", "CommandNotRunnable",
})

#: Most characters of a container's termination message carried into a pod's failure.
TERMINATION_TEXT_CHARS = 512

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
    #: The pod's own state as the kubelet reports it (a container's waiting reason, else the pod's
    #: phase): what its cold start shows before the worker reports anything.
    state: str = ""
    #: Its node is lost (NotReady, Unknown, or tainted unreachable / not-ready: rules/node_health.py):
    #: not warm, whatever it last said, and replaced at once.
    node_lost: bool = False
    #: Its node is cordoned (a drain): still serving, and replaced elsewhere before it is evicted.
    leaving: bool = False

    @property
    def warm(self) -> bool:
        """Verified warm: Ready *and* the worker's own metrics say warm (ready == 1), on a node
        that is not lost."""
        return (
            self.ready
            and not self.terminating
            and not self.node_lost
            and self.sample is not None
            and self.sample.ok
            and self.sample.ready
        )

    @property
    def replaced(self) -> bool:
        """A pod the pool starts another one for: on a lost node, or on a cordoned one."""
        return not self.terminating and (self.node_lost or self.leaving)

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
        return (self.ready and not self.terminating and not self.node_lost and not self.metrics_unavailable
                and not self.warm)


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
    a container waiting for a failing reason, or one that exited non-zero (just now, or before
    its restart)."""
    status = pod.get("status") or {}
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        if container.get("ready"):
            continue
        state = container.get("state") or {}
        waiting = state.get("waiting") or {}
        # A container that has just exited has failed already: its restart is no news.
        ended = state.get("terminated") or {}
        last = ended or (container.get("lastState") or {}).get("terminated") or {}
        restarts = int(container.get("restartCount") or 0)
        exit_code = last.get("exitCode")
        if waiting.get("reason") in FAILING_WAITING_REASONS or (
                (restarts > 0 or ended) and exit_code not in (None, 0)):
            reason = waiting.get("reason") or last.get("reason") or "Restarting"
            detail = f"exit code {exit_code}, " if exit_code is not None else ""
            # The container's own last words (its termination message) say more than the kubelet's
            # "back-off restarting failed container": they come first.
            message = _termination_text(str(last.get("message") or "")) or _termination_text(
                str(waiting.get("message") or ""))
            tail = f": {message}" if message else ""
            return f"container {container.get('name')} {reason} ({detail}{restarts} restarts){tail}"
    return None


def _termination_text(message: str) -> str:
    """A termination message in one bounded line: the worker's own (one line) from its head, which
    names what failed; a log tail (the kubelet's fallback, many lines) from its last lines."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) <= 1:
        return "".join(lines)[:TERMINATION_TEXT_CHARS]
    return " | ".join(lines[-3:])[-TERMINATION_TEXT_CHARS:]


def pod_state(pod: Mapping[str, Any]) -> str:
    """The pod's state in one word, as the kubelet reports it: a container's waiting reason
    (ContainerCreating, CrashLoopBackOff...), else its phase; a Running pod whose worker has
    said nothing yet is Starting."""
    status = pod.get("status") or {}
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (container.get("state") or {}).get("waiting")
        if isinstance(waiting, Mapping):
            return str(waiting.get("reason") or "Waiting")[:64]
    phase = str(status.get("phase") or "Pending")[:64]
    return "Starting" if phase == "Running" else phase


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's Ready condition (its readiness probe is the worker's /readyz: Ready means warm)."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def pod_fingerprint(pod: Mapping[str, Any], deleted: bool) -> tuple[object, ...]:
    """What a pass reads of a worker pod (or its ReplicaSet), as the watch shows it: readiness,
    phase, IP, termination, container states and restarts, the ReplicaSet's counts.  An event
    that leaves it unchanged (an annotation of ours) needs no pass."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    containers = tuple(
        (str(c.get("name")), tuple(sorted((c.get("state") or {}).keys())), int(c.get("restartCount") or 0))
        for c in status.get("containerStatuses") or []
    )
    return (deleted, status.get("phase"), status.get("podIP"), bool(meta.get("deletionTimestamp")),
            pod_ready(pod), containers, status.get("replicas"), status.get("readyReplicas"))


def wake_figures(pods: Iterable[PodObservation]) -> WakeFigures | None:
    """Wake p50/p95 over the wakes the live pods' histograms hold; None before any wake."""
    merged = sleep_wake.merge_buckets(p.sample.wake_buckets for p in pods if p.sample is not None and p.sample.ok)
    p50, p95 = sleep_wake.quantile(merged, 0.5), sleep_wake.quantile(merged, 0.95)
    if p50 is None or p95 is None:
        return None
    return WakeFigures(p50_seconds=round(p50, 4), p95_seconds=round(p95, 4))

