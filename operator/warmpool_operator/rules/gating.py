"""Memory-gated warm-up: the tier of each pod and each node, with hysteresis (pure).

Per node, pods share one accelerator.  The node's level is the **max** of its pods' used
ratios, not the sum: every probe in the worker's chain but one (NVML, ``mem_get_info``,
``/proc/meminfo``, the cgroup) already reports the *device*- or node-wide figure, so two
pods on one GPU each report the same total and a sum would count it twice.  The max is
right for those and errs on the safe (stricter) side for per-process readings.

A pod's directive is the stricter of its own tier and its node's tier, each decided with
its own history by :func:`warmpool.tiering.decide_tier`, so a level hovering at a threshold
moves neither.  Unknown pods (no trustworthy figure) get no directive and do not pull
their node's level down: they are left out of the max, never read as 0 %.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from warmpool.contract.api import Tier
from warmpool.tiering import Thresholds, decide_tier, stricter
from warmpool_operator.model import Sample


@dataclass(frozen=True)
class PodRef:
    uid: str
    name: str
    node: str
    ip: str


@dataclass
class GateState:
    """Tier history kept in memory between ticks (never read back from our own status)."""

    pod_tiers: dict[str, Tier] = field(default_factory=dict)  # uid -> the pod's own tier
    node_tiers: dict[str, Tier] = field(default_factory=dict)  # node -> the node's tier
    directives: dict[str, Tier] = field(default_factory=dict)  # uid -> tier last decided


@dataclass(frozen=True)
class Decision:
    pod: PodRef
    tier: Tier  # the directive (UNKNOWN: none can be sent)
    pod_tier: Tier
    node_tier: Tier
    previous: Tier | None  # the directive decided on the tick before, if any
    used_ratio: float | None

    @property
    def changed(self) -> bool:
        return self.previous != self.tier


def _seed(sample: Sample | None) -> Tier:
    """History for a pod we have not decided on yet (operator restart): what the worker runs."""
    if sample is None or sample.tier is None:
        return Tier.UNKNOWN
    return sample.tier


def decide(
    pods: list[PodRef], samples: Mapping[str, Sample], state: GateState, thresholds: Thresholds
) -> list[Decision]:
    """Decide every pod's tier for this tick and update ``state`` (pods gone are forgotten)."""
    by_node: dict[str, list[float]] = {}
    for pod in pods:
        sample = samples.get(pod.uid)
        if sample is not None and sample.ok and sample.used_ratio is not None:
            by_node.setdefault(pod.node, []).append(sample.used_ratio)

    node_tiers: dict[str, Tier] = {}
    for node in {pod.node for pod in pods}:
        levels = by_node.get(node)
        previous = state.node_tiers.get(node)
        if previous is None:
            seeds = [_seed(samples.get(p.uid)) for p in pods if p.node == node]
            previous = Tier.UNKNOWN
            for seed in seeds:
                previous = stricter(previous, seed)
        node_tiers[node] = decide_tier(max(levels) if levels else None, previous, thresholds)

    decisions: list[Decision] = []
    pod_tiers: dict[str, Tier] = {}
    directives: dict[str, Tier] = {}
    for pod in pods:
        sample = samples.get(pod.uid)
        ratio = sample.used_ratio if sample is not None and sample.ok else None
        previous_pod = state.pod_tiers.get(pod.uid, _seed(sample))
        pod_tier = decide_tier(ratio, previous_pod, thresholds)
        node_tier = node_tiers[pod.node]
        tier = Tier.UNKNOWN if pod_tier is Tier.UNKNOWN else stricter(pod_tier, node_tier)
        pod_tiers[pod.uid] = pod_tier if pod_tier is not Tier.UNKNOWN else previous_pod
        directives[pod.uid] = tier
        decisions.append(
            Decision(
                pod=pod,
                tier=tier,
                pod_tier=pod_tier,
                node_tier=node_tier,
                previous=state.directives.get(pod.uid),
                used_ratio=ratio,
            )
        )
    # Keep a node's history only while a figure backs it (an all-Unknown node restarts fresh).
    state.node_tiers = {n: t for n, t in node_tiers.items() if t is not Tier.UNKNOWN}
    state.pod_tiers = pod_tiers
    state.directives = directives
    return decisions


#: Deletion-cost points per tier: a pod running a deeper warm-up is worth more.
_TIER_POINTS = {Tier.FULL: 300, Tier.TRUNCATED: 200, Tier.PAUSED: 100, Tier.UNKNOWN: 0}
#: The API server accepts pod-deletion-cost only as an int32.
DELETION_COST_MIN = -(2**31)
DELETION_COST_MAX = 2**31 - 1


def deletion_cost(warm: bool, tier: Tier, sample: Sample | None) -> int:
    """``controller.kubernetes.io/pod-deletion-cost`` by warmth: the ReplicaSet removes the
    lowest cost first, so cold, unknown and half-loaded pods go before warm ones.

    warm (verified from the worker's own metrics) 1000 + tier points 0..300 + percent of
    layers resident 0..100.

    The scraped layer figures are clamped to ``[0, layers_total]`` again here (the parser
    already does), and the result to int32: whatever a worker reports, the annotation is
    one the API server accepts.
    """
    cost = 1000 if warm else 0
    cost += _TIER_POINTS[tier]
    if sample is not None and sample.ok and sample.layers_total is not None and sample.layers_total > 0:
        resident = min(max(sample.layers_resident or 0, 0), sample.layers_total)
        cost += round(100 * resident / sample.layers_total)
    return min(max(cost, DELETION_COST_MIN), DELETION_COST_MAX)
