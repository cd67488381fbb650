"""Tiers, the pass's second step: decide each pod's tier on new samples, send the directives,
announce the changes, and annotate the pods (their tier and deletion cost).

Tiers are decided only on new samples (hysteresis counts scrapes, not passes), and the
directives go out with them: re-sent with every round of samples, they expire in the worker
after their TTL, so a dead operator never pins a pool to a stale tier.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from warmpool.contract.api import Tier
from warmpool.contract.http import PATH_CONTROL_TIER
from warmpool.contract.pods import ANNOTATION_POD_DELETION_COST, ANNOTATION_TIER
from warmpool.contract.telemetry import SPAN_DECIDE
from warmpool.kube import KubeError
from warmpool_operator.control.observe import PoolPods
from warmpool_operator.io import metrics
from warmpool_operator.io.kube import PODS, Kube
from warmpool_operator.io.tracing import Tracing
from warmpool_operator.io.worker_client import WorkerClient, token_refused, worker_url
from warmpool_operator.model import Target
from warmpool_operator.rules import gating
from warmpool_operator.rules.observation import PodObservation

log = logging.getLogger("warmpool.operator")


@dataclass
class TierMemory:
    """The pool's tier history (in memory only; never read back from our own status)."""

    gate: gating.GateState = field(default_factory=gating.GateState)
    #: uid -> the decision last taken (it stands until a new sample comes)
    decisions: dict[str, gating.Decision] = field(default_factory=dict)
    #: a worker refused this pass's control token (401/403): the Secret was rotated, or the
    #: operator's copy is stale; the reconciler reads it again
    token_refused: bool = False


def _seed_gate(gate: gating.GateState, refs: list[gating.PodRef], pods: Mapping[str, Any]) -> None:
    """After an operator restart, each pod's last directive comes back from its tier annotation
    (what this operator wrote), so hysteresis holds and no tier "changes" to what it already was."""
    for ref in refs:
        if ref.uid in gate.directives:
            continue
        note = ((pods[ref.uid].get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_TIER)
        try:
            tier = Tier(str(note))
        except ValueError:
            continue
        gate.directives[ref.uid] = tier
        if tier is not Tier.UNKNOWN:
            gate.pod_tiers.setdefault(ref.uid, tier)


async def decide_and_direct(memory: TierMemory, pool: PoolPods, target: Target, owner: Mapping[str, Any],
                           token: str, workers: WorkerClient, ttl: float,
                           tracing: Tracing) -> dict[str, gating.Decision]:
    """Decide each pod's tier, POST it to the pod's worker (/control/tier) and post a TierChanged
    Event where it changed: new decisions where new samples came, else the last ones (already
    sent and announced)."""
    if not pool.fresh and all(ref.uid in memory.decisions for ref in pool.refs):
        # Nothing new was read: the last decisions stand (announced and sent already).
        memory.decisions = {uid: d for uid, d in memory.decisions.items() if uid in pool.readiness}
        return dict(memory.decisions)
    with tracing.span(SPAN_DECIDE, {"warmpool.pods": len(pool.refs)}):
        _seed_gate(memory.gate, pool.refs, pool.pods)
        decided = gating.decide(pool.refs, pool.samples, memory.gate, target.spec.gating.thresholds())
        memory.decisions = {d.pod.uid: d for d in decided}
        memory.token_refused = await _direct(workers, target, token, ttl, decided, tracing)
    for made in decided:
        metrics.TIER_DECISIONS.labels("pod", made.tier.value).inc()
        metrics.TIER_DECISIONS.labels("node", made.node_tier.value).inc()
        if made.changed:
            _tier_event(owner, pool.pods[made.pod.uid], made)
    return dict(memory.decisions)


async def _direct(workers: WorkerClient, target: Target, token: str, ttl: float,
                  decisions: list[gating.Decision], tracing: Tracing) -> bool:
    """Send each decided tier to its worker (an Unknown tier sends nothing); True when a worker
    refused the token."""
    port = target.spec.pod.port
    sendable = [
        (d.pod.uid, worker_url(d.pod.ip, port, PATH_CONTROL_TIER), d.tier)
        for d in decisions
        if d.tier is not Tier.UNKNOWN
    ]
    if not sendable:
        return False
    names = {d.pod.uid: d.pod.name for d in decisions}
    refused = False
    for uid, error in (await workers.send_tiers(sendable, token, ttl, traceparent=tracing.traceparent())).items():
        if error is not None:
            log.info("pod %s: tier directive not delivered: %s", names[uid], error)
            refused = refused or token_refused(error)
    return refused


def _tier_event(owner: Mapping[str, Any], pod: Mapping[str, Any], decision: gating.Decision) -> None:
    level = "unknown" if decision.used_ratio is None else f"{decision.used_ratio * 100:.0f}% used"
    before = decision.previous.value if decision.previous is not None else "none"
    message = (
        f"pod {decision.pod.name} on {decision.pod.node or '?'}: tier {before} -> {decision.tier.value} "
        f"(memory {level}; pod {decision.pod_tier.value}, node {decision.node_tier.value})"
    )
    kind = "Warning" if decision.tier in (Tier.PAUSED, Tier.UNKNOWN) else "Normal"
    pod_ref = {"apiVersion": "v1", "kind": "Pod", "metadata": pod.get("metadata") or {}}
    kopf.event([owner, pod_ref], type=kind, reason="TierChanged", message=message)  # type: ignore[list-item]
    log.info("%s", message)


async def annotate(kube: Kube, target: Target, pool: PoolPods, observed: list[PodObservation]) -> None:
    """Each live pod's tier and deletion cost as annotations (the ReplicaSet removes the lowest
    cost first, so cold and unknown pods go before warm ones)."""
    for obs in observed:
        if obs.terminating:
            continue
        tier = obs.decision.tier if obs.decision is not None else Tier.UNKNOWN
        await _annotate(kube, target, pool.pods[obs.uid], tier, gating.deletion_cost(obs.warm, tier, obs.sample))


async def _annotate(kube: Kube, target: Target, pod: Mapping[str, Any], tier: Tier, cost: int) -> None:
    """Best effort: a refused or failed patch of one pod is logged and counted, and the pass goes
    on (the other pods, the scale decision and the status matter more than one annotation)."""
    meta = pod.get("metadata") or {}
    have = meta.get("annotations") or {}
    want = {ANNOTATION_TIER: tier.value, ANNOTATION_POD_DELETION_COST: str(cost)}
    if all(have.get(k) == v for k, v in want.items()):
        return
    try:
        await kube.patch(PODS, target.namespace, str(meta.get("name")), {"metadata": {"annotations": want}})
    except KubeError as error:
        if error.status == 404:  # a pod that just went away needs no annotation
            return
        metrics.WRITE_FAILURES.labels(metrics.WRITE_POD_ANNOTATION).inc()
        log.warning("pod %s/%s: annotation not written (%s): carrying on", target.namespace, meta.get("name"), error)
    except (aiohttp.ClientError, TimeoutError) as error:
        metrics.WRITE_FAILURES.labels(metrics.WRITE_POD_ANNOTATION).inc()
        log.warning("pod %s/%s: annotation not written (%s: %s): carrying on", target.namespace, meta.get("name"),
                    type(error).__name__, error)
