"""Scale, the pass's fifth step: how many pods the Deployment asks for this pass.

The reactive count (spec.pool.replicas, at least minWarm, plus the pods added while fewer than
minWarm are verified warm) raised to what this pass's forecast asks for, where prediction acts;
a lower ask lowers the pool only once the higher one has not been asked for during a hold
(rules/scaling.py has the rules).  An Event says when prediction raises the pool.

What a restart would forget is read back from the live Deployment: its replicas say how many
extra pods it runs, and the pods a forecast asked for stay held while the new operator's own
forecast gets going, instead of going and coming back.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from warmpool_operator.api.types import WarmModelSpec
from warmpool_operator.control.forecasting import Predicted
from warmpool_operator.model import Obj
from warmpool_operator.rules import scaling
from warmpool_operator.rules.observation import PodObservation

log = logging.getLogger("warmpool.operator")

#: The Event a pass emits when demand prediction raises the pool above the reactive count.
REASON_PRE_WARM = "PreWarm"


@dataclass
class ScaleMemory:
    """What the pool's scaling remembers between passes (in memory only)."""

    #: pods added above the asked-for replicas because Ready pods are not verified warm; None
    #: until read back from the live Deployment (an operator restart must not scale the pool down)
    extra: int | None = None
    #: the predicted count held against a quick scale-down, and when it was last asked for (monotonic)
    hold: tuple[int, float] | None = None
    #: the pods demand prediction last raised the Deployment to (None: it did not), for its Event
    pre_warmed: int | None = None


def restore(memory: ScaleMemory, spec: WarmModelSpec, live: Obj | None, now: float) -> None:
    """On the first pass, read back what the live Deployment runs."""
    if memory.extra is not None:
        return
    live_replicas = int(((live or {}).get("spec") or {}).get("replicas") or 0)
    memory.extra = scaling.extra_from_live(spec, live_replicas)
    if spec.pool.predictive is not None and spec.pool.predictive.enabled:
        memory.hold = (min(live_replicas, spec.pool.max_replicas), now)


def react(memory: ScaleMemory, spec: WarmModelSpec, observations: list[PodObservation], key: tuple[str, str]) -> None:
    """The reactive extra pods from this pass's observations."""
    extra = scaling.extra_pods(observations, spec.pool.min_warm)
    if extra != memory.extra:
        warm = sum(o.warm for o in observations if not o.terminating)
        # Why the pool grows or shrinks: a node lost or cordoned is the news an SRE looks for.
        lost = sum(o.node_lost for o in observations if o.replaced)
        leaving = sum(o.leaving and not o.node_lost for o in observations if o.replaced)
        log.info("%s/%s: %d warm of minWarm %d; extra pods %s -> %d (replacing %d on lost nodes, %d on cordoned "
                 "nodes)", *key, warm, spec.pool.min_warm, memory.extra, extra, lost, leaving)
        memory.extra = extra


def replicas(memory: ScaleMemory, spec: WarmModelSpec, predicted: Predicted, owner: Mapping[str, Any],
             now: float, at_zero: bool = False) -> int:
    """The Deployment's replicas this pass (and the PreWarm Event when prediction raises them)."""
    held: int | None = None
    if predicted.hold_s is not None:
        memory.hold = scaling.held(memory.hold, predicted.wanted, now, predicted.hold_s)
        held = memory.hold[0] if memory.hold is not None else None
    count = scaling.with_prediction(spec, memory.extra or 0, held, at_zero)
    _announce(memory, spec, count, held, predicted, owner, at_zero)
    return count


def _announce(memory: ScaleMemory, spec: WarmModelSpec, count: int, held: int | None, predicted: Predicted,
              owner: Mapping[str, Any], at_zero: bool) -> None:
    """An Event when prediction raises the pool above the reactive count (once per new count)."""
    reactive = scaling.desired_replicas(spec, memory.extra or 0, at_zero)
    raised = count if held is not None and count > reactive else None
    if raised is not None and raised != memory.pre_warmed:
        message = (f"demand forecast: {reactive} -> {count} pods ahead of the load "
                   f"({predicted.forecast.reason if predicted.forecast is not None else ''})")[:1024]
        kopf.event(owner, type="Normal", reason=REASON_PRE_WARM, message=message)  # type: ignore[arg-type]
        meta = owner.get("metadata") or {}
        log.info("%s/%s: %s", meta.get("namespace"), meta.get("name"), message)
    memory.pre_warmed = raised
