"""The scaling rules: how many worker pods a WarmModel runs (pure functions, no I/O).

``desired_replicas`` is what the Deployment asks for; ``extra_pods`` is how many pods to add
while fewer than minWarm are verified warm; ``extra_from_live`` reads that figure back from a
live Deployment after an operator restart.  With ``spec.pool.predictive``,
``predictive_decision`` turns a forecast into pods (rules/forecast/decision.py's rule) and
``with_prediction`` raises the Deployment's count to it, never lowering what the reactive rules ask.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from warmpool_operator.api.types import WarmModelSpec
from warmpool_operator.rules.forecast.decision import Decision, DecisionInputs, decide


class PodWarmth(Protocol):
    """What the scaling rules read of a pod (status.PodObservation has it; this module does not
    import status, which imports the rules)."""

    @property
    def terminating(self) -> bool: ...

    @property
    def warm(self) -> bool: ...

    @property
    def warming(self) -> bool: ...

    @property
    def replaced(self) -> bool: ...


def desired_replicas(spec: WarmModelSpec, extra: int = 0, at_zero: bool = False) -> int:
    """Pods to run: the asked-for replicas, at least minWarm, plus ``extra`` pods for ones that
    are Ready but not verified warm; never above maxReplicas.  A scale-to-zero pool runs none while
    at zero, and at least one otherwise (it is out of zero because a request wants a pod)."""
    pool = spec.pool
    if pool.scale_to_zero is not None and at_zero:
        return 0
    floor = 1 if pool.scale_to_zero is not None else 0
    return max(floor, min(pool.max_replicas, max(pool.replicas, pool.min_warm) + max(0, extra)))


def extra_from_live(spec: WarmModelSpec, live_replicas: int) -> int:
    """The extra pods a live Deployment of ``live_replicas`` runs above what the spec asks for,
    within maxReplicas: what an operator that just started keeps until a pass decides otherwise
    (starting from 0 would scale the pool down and back up)."""
    return max(0, min(live_replicas, spec.pool.max_replicas) - desired_replicas(spec))


def extra_pods(pods: Iterable[PodWarmth], min_warm: int) -> int:
    """Pods to add above the asked-for replicas: one for each pod on a lost or cordoned node
    (rules/node_health.py), which the Deployment still counts while it is going; and, while fewer
    than ``min_warm`` of the others are verified warm, one for each of them that is Ready but not.

    Only pods whose own metrics say "not warm yet" count there: a pod whose metrics cannot be read
    is no reason to grow the pool (every new pod would be just as unreadable, and the pool
    would grow to maxReplicas and never be Ready).  A replaced pod stops counting once it is
    gone (evicted: terminating) or its node is back: the pool then scales down, coldest first
    (the pod-deletion-cost the tiers step writes).
    """
    live = [p for p in pods if not p.terminating]
    staying = [p for p in live if not p.replaced]
    warm = sum(p.warm for p in staying)
    return max(0, min(min_warm - warm, sum(p.warming for p in staying))) + sum(p.replaced for p in live)


def autoscaled(body: Mapping[str, Any]) -> bool:
    """Whether an autoscaler (HPA, or KEDA through its HPA) writes the WarmModel's replicas: a
    field manager other than kubectl holds a write through the scale subresource.  Prediction
    then only raises the floor under its count; the operator never writes spec.pool.replicas."""
    for entry in (body.get("metadata") or {}).get("managedFields") or []:
        if not isinstance(entry, Mapping) or entry.get("subresource") != "scale":
            continue
        if not str(entry.get("manager") or "").startswith("kubectl"):
            return True
    return False


def predictive_decision(spec: WarmModelSpec, forecast_p90: float | None, step_s: int, capacity_rps: float | None,
                        autoscaler_present: bool, at_zero: bool = False) -> Decision:
    """Pods the forecast asks for, within [minWarm, maxReplicas] and maxExtraReplicas above the
    reactive count (spec.pool.replicas, which an autoscaler keeps at its own recommendation; none
    for a pool at zero, so a forecast that raises it is an action, and says so)."""
    pool = spec.pool
    predictive = pool.predictive
    max_extra = predictive.max_extra_replicas if predictive is not None else 0
    return decide(DecisionInputs(
        forecast_p90=forecast_p90, step_s=step_s, capacity_rps=capacity_rps,
        reactive_replicas=0 if at_zero and pool.scale_to_zero is not None else max(pool.replicas, pool.min_warm),
        min_warm=pool.min_warm,
        max_replicas=pool.max_replicas, max_extra_replicas=max_extra, autoscaler_present=autoscaler_present,
    ))


def with_prediction(spec: WarmModelSpec, extra: int, predicted: int | None, at_zero: bool = False) -> int:
    """The Deployment's replicas: :func:`desired_replicas`, raised to ``predicted`` (the decision's
    count: the pods, or an autoscaler's floor) within maxReplicas.  None (no predictive action,
    or prediction off): exactly the reactive count.  At zero, a forecast burst raises the pool too."""
    base = desired_replicas(spec, extra, at_zero)
    if predicted is None:
        return base
    return max(base, min(spec.pool.max_replicas, predicted))


def awake_wanted(spec: WarmModelSpec, decision: Decision) -> int:
    """Awake pods the forecast asks for (sleeping pods wake to reach it before any new pod is
    started): the predicted count within maxExtraReplicas above the reactive count and maxReplicas."""
    if decision.predicted is None:
        return 0
    pool = spec.pool
    max_extra = pool.predictive.max_extra_replicas if pool.predictive is not None else 0
    return max(0, min(decision.predicted, pool.max_replicas, max(pool.replicas, pool.min_warm) + max_extra))


def held(previous: tuple[int, float] | None, wanted: int | None, now: float, hold_s: float) -> tuple[int, float] | None:
    """Scale-down hold of the predicted count: a higher count takes effect at once; a lower one (or
    none) only once the higher has not been asked for during ``hold_s`` seconds, so a forecast that
    wobbles around a pod boundary does not start and stop pods step after step.

    ``previous``: (count held, when it was last asked for); returns the new one, or None."""
    if wanted is not None and (previous is None or wanted >= previous[0]):
        return wanted, now
    if previous is not None and now - previous[1] < hold_s:
        return previous
    return None if wanted is None else (wanted, now)
