"""The scaling rules: how many worker pods a WarmModel runs (pure functions, no I/O).

``desired_replicas`` is what the Deployment asks for; ``extra_pods`` is how many pods to add
while fewer than minWarm are verified warm; ``extra_from_live`` reads that figure back from a
live Deployment after an operator restart.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from warmpool_operator.api import WarmModelSpec


class PodWarmth(Protocol):
    """What the scaling rules read of a pod (status.PodObservation has it; this module does not
    import status, which imports the rules)."""

    @property
    def terminating(self) -> bool: ...

    @property
    def warm(self) -> bool: ...

    @property
    def warming(self) -> bool: ...


def desired_replicas(spec: WarmModelSpec, extra: int = 0) -> int:
    """Pods to run: the asked-for replicas, at least minWarm, plus ``extra`` pods for ones that
    are Ready but not verified warm; never above maxReplicas."""
    pool = spec.pool
    return max(0, min(pool.max_replicas, max(pool.replicas, pool.min_warm) + max(0, extra)))


def extra_from_live(spec: WarmModelSpec, live_replicas: int) -> int:
    """The extra pods a live Deployment of ``live_replicas`` runs above what the spec asks for,
    within maxReplicas: what an operator that just started keeps until a pass decides otherwise
    (starting from 0 would scale the pool down and back up)."""
    return max(0, min(live_replicas, spec.pool.max_replicas) - desired_replicas(spec))


def extra_pods(pods: Iterable[PodWarmth], min_warm: int) -> int:
    """Pods to add above the asked-for replicas while fewer than ``min_warm`` are verified warm.

    Only pods whose own metrics say "not warm yet" count: a pod whose metrics cannot be read
    is no reason to grow the pool (every new pod would be just as unreadable, and the pool
    would grow to maxReplicas and never be Ready).
    """
    live = [p for p in pods if not p.terminating]
    warm = sum(p.warm for p in live)
    return max(0, min(min_warm - warm, sum(p.warming for p in live)))
