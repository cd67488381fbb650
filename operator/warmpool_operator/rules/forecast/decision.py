"""How many warm serving pods to have one lead time from now (pure).

- **Lead time**: capacity asked for now is serving only after a wake (a sleeping pod) or a
  full cold start (a new pod), so the forecast that matters is for the steps from
  ``now + lead`` to ``now + lead + step``.  Both are the *measured* p95s; with neither
  measured yet, ``horizonSeconds`` stands in, and the reason says so.
- **Desired** = ⌈forecast p90 ÷ per-pod capacity⌉, capacity in requests per second as the
  workers' own throughput measured it.  No measured capacity, no sizing: a configured guess
  would size the pool on a number nobody checked.  But a forecast of at least one request
  still asks for one pod, the least any request needs (a pool at zero after an operator
  restart has served nothing it could measure, and would otherwise never be pre-warmed).
- **Bounds**: never more than ``maxExtraReplicas`` above what the reactive path (HPA/KEDA,
  or ``spec.pool.replicas``) asks, always within ``[minWarm, maxReplicas]``.  With an
  autoscaler present the result is a *floor* for it (its minimum replicas: it takes the
  higher of the floor and its own count, so prediction only ever adds and the two never
  fight); without one it is the pod count, never below the reactive count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from warmpool_operator.api.types import DEFAULT_PREDICTIVE_HORIZON_SECONDS, DEFAULT_PREDICTIVE_MAX_EXTRA_REPLICAS


@dataclass(frozen=True)
class PredictiveSpec:
    """``spec.pool.predictive``."""

    enabled: bool = False
    #: the lead time to plan for until cold start / wake are measured
    horizon_seconds: int = DEFAULT_PREDICTIVE_HORIZON_SECONDS
    max_extra_replicas: int = DEFAULT_PREDICTIVE_MAX_EXTRA_REPLICAS

    def __post_init__(self) -> None:
        if self.horizon_seconds < 1 or self.max_extra_replicas < 0:
            raise ValueError(f"horizonSeconds must be >= 1 and maxExtraReplicas >= 0, got {self}")


class LeadSource(StrEnum):
    WAKE = "wake_p95"
    COLD_START = "cold_start_p95"
    HORIZON = "horizon_seconds"


@dataclass(frozen=True)
class LeadTime:
    seconds: float
    source: LeadSource


class Horizon(Protocol):
    """What the lead time reads of a predictive spec (this module's, or the API's spec.pool.predictive)."""

    @property
    def horizon_seconds(self) -> int: ...


def lead_time(spec: Horizon, cold_start_p95_s: float | None, wake_p95_s: float | None,
              sleeping_pods: int) -> LeadTime:
    """The wake p95 when a sleeping pod can be woken, else the cold-start p95, else horizonSeconds."""
    if sleeping_pods > 0 and wake_p95_s is not None and _measured(wake_p95_s):
        return LeadTime(wake_p95_s, LeadSource.WAKE)
    if cold_start_p95_s is not None and _measured(cold_start_p95_s):
        return LeadTime(cold_start_p95_s, LeadSource.COLD_START)
    return LeadTime(float(spec.horizon_seconds), LeadSource.HORIZON)


def horizons(lead_s: float, step_s: int) -> tuple[int, ...]:
    """Steps (1 = the step after the last observed) covering ``[now + lead, now + lead + step)``.

    ``now`` is the end of the last observed step, so step ``h`` spans
    ``[now + (h - 1) * step, now + h * step)``.
    """
    if lead_s < 0 or step_s < 1:
        raise ValueError(f"need lead >= 0 and step >= 1, got lead={lead_s} step={step_s}")
    first = int(lead_s // step_s) + 1
    last = math.ceil((lead_s + step_s) / step_s)
    return tuple(range(first, max(first, last) + 1))


#: With no measured capacity, a forecast of at least this many requests in a step still asks for one pod.
MIN_REQUESTS_FOR_ONE_POD = 1.0


class Target(StrEnum):
    FLOOR = "floor"  # an autoscaler owns replicas: raise its minimum
    REPLICAS = "replicas"  # the operator owns replicas


@dataclass(frozen=True)
class DecisionInputs:
    forecast_p90: float | None  # requests per step, the highest over the lead-time horizons
    step_s: int
    capacity_rps: float | None  # measured requests per second one warm pod serves
    #: What the pool needs without prediction: the autoscaler's own recommendation for the current
    #: rate (before any floor this module set), or spec.pool.replicas as the user wrote it.
    #: Never a count prediction produced, or maxExtraReplicas would compound step after step.
    reactive_replicas: int
    min_warm: int
    max_replicas: int
    max_extra_replicas: int
    autoscaler_present: bool


@dataclass(frozen=True)
class Decision:
    replicas: int  # FLOOR: the autoscaler's minimum (minWarm when no action); REPLICAS: the pod count
    predicted: int | None  # ⌈p90 ÷ capacity⌉ before bounds; None when no prediction could be made
    acted: bool  # True when prediction asks for more than the reactive path
    target: Target
    reason: str


def decide(inputs: DecisionInputs) -> Decision:
    """Desired warm pods from the forecast and the measured capacity, within every bound."""
    target = Target.FLOOR if inputs.autoscaler_present else Target.REPLICAS
    reactive = _clamp(inputs.reactive_replicas, inputs.min_warm, inputs.max_replicas)
    # Doing nothing: an autoscaler's floor stays at minWarm; replicas stay at the reactive count.
    unchanged = inputs.min_warm if target is Target.FLOOR else reactive
    if inputs.forecast_p90 is None or not math.isfinite(inputs.forecast_p90) or inputs.forecast_p90 < 0:
        return Decision(unchanged, None, False, target, "no usable forecast: no predictive action")
    capacity = inputs.capacity_rps
    rate = inputs.forecast_p90 / inputs.step_s
    measured = capacity is not None and _measured(capacity)
    if not measured and inputs.forecast_p90 < MIN_REQUESTS_FOR_ONE_POD:
        return Decision(unchanged, None, False, target, "per-pod capacity not measured yet: no predictive action")
    # The epsilon keeps a float division that lands a hair above a whole number from adding a pod.
    predicted = max(0, math.ceil(rate / capacity - 1e-9)) if capacity is not None and measured else 1
    capped = min(predicted, reactive + inputs.max_extra_replicas)
    # A floor is the predicted count alone (the autoscaler takes the max with its own; a floor of
    # max(reactive, ...) would ratchet: the autoscaler could never scale below what it has now).
    wanted = capped if target is Target.FLOOR else max(reactive, capped)
    replicas = _clamp(wanted, inputs.min_warm, inputs.max_replicas)
    acted = replicas > reactive
    if not measured:
        reason = (f"forecast p90 {rate:.3g} req/s, per-pod capacity not measured yet: one pod, the least a "
                  f"request needs" + ("" if acted else f", not more than the reactive {reactive}"))
    elif acted:
        reason = (f"forecast p90 {rate:.3g} req/s ÷ {capacity:.3g} req/s per pod = {predicted} pods"
                  + (f" (held to reactive {reactive} + maxExtraReplicas {inputs.max_extra_replicas})"
                     if capped < predicted else "")
                  + (f" (held to maxReplicas {inputs.max_replicas})" if replicas < capped else ""))
    else:
        reason = f"forecast needs {predicted} pods, not more than the reactive {reactive}"
    return Decision(replicas, predicted, acted, target, reason)


def _measured(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))
