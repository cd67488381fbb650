"""The pod pipeline of one WarmModel: scrape -> decide -> direct -> annotate -> events.

Pods come from the watch-fed cache (only those of our Deployment, through its ReplicaSets);
samples come from the scrape scheduler's rounds, or from an immediate scrape of a pod whose
readiness changed since its last sample.  Tiers are decided only on new samples (hysteresis
counts scrapes, not passes), and the directives go out with them; annotations and Events
follow the decisions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from warmpool import contract
from warmpool.contract import Tier
from warmpool_operator import builders, gating, heat, metrics, scrape, sleeper, tracing
from warmpool_operator import status as st
from warmpool_operator.builders import Obj, Target
from warmpool_operator.cache import Cache
from warmpool_operator.kube import CONFIGMAPS, PODS, Kube, KubeError, deployment_pods
from warmpool_operator.scheduler import ScrapeScheduler
from warmpool_operator.scrape import Sample
from warmpool_operator.settings import CONFIG

log = logging.getLogger("warmpool.operator")


@dataclass(frozen=True)
class Scraped:
    sample: Sample
    #: the pod's Ready condition when the sample was taken: a change means the sample is stale
    ready: bool


@dataclass
class PodsState:
    """What the pipeline remembers about one WarmModel's pods (in memory only)."""

    gate: gating.GateState = field(default_factory=gating.GateState)
    cold: st.ColdStarts = field(default_factory=st.ColdStarts)
    heat: heat.HeatState = field(default_factory=heat.HeatState)
    samples: dict[str, Scraped] = field(default_factory=dict)
    #: pods whose sample arrived since tiers were last decided
    fresh: set[str] = field(default_factory=set)
    decisions: dict[str, gating.Decision] = field(default_factory=dict)
    #: uid -> metrics url and Ready, of the pods the last pass found scrapeable
    urls: dict[str, str] = field(default_factory=dict)
    readiness: dict[str, bool] = field(default_factory=dict)
    #: pods with our labels that are not our Deployment's (warned about once each)
    ignored: set[str] = field(default_factory=set)
    token: str = ""
    #: uid -> what the watch last showed of a pod that a pass reads (handlers.py compares)
    seen: dict[str, tuple[object, ...]] = field(default_factory=dict)
    #: sleep and wake (#15): activity, levels, the sleeps and wakes under way
    sleep: sleeper.SleepState = field(default_factory=sleeper.SleepState)
    #: awake pods demand prediction asked for at the last pass (#16): sleeping pods wake for it
    awake_wanted: int = 0

    def feed(self, samples: Mapping[str, Sample]) -> None:
        """Samples from a scrape: kept with the readiness the pod had when it was scraped."""
        for uid, sample in samples.items():
            if uid in self.urls:
                self.samples[uid] = Scraped(sample, self.readiness.get(uid, False))
                self.fresh.add(uid)
                _count_errors(sample)


def _count_errors(sample: Sample) -> None:
    if sample.error is not None:
        metrics.SCRAPE_FAILURES.labels(sample.error.split(":")[0]).inc()
    elif sample.used_ratio is None:
        metrics.SCRAPE_FAILURES.labels("no memory figure").inc()


def pod_ready(pod: Mapping[str, Any]) -> bool:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def url(ip: str, port: int, path: str) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{path}"


def our_pods(cache: Cache, target: Target, state: PodsState, deployment_uid: str) -> list[Obj]:
    """The worker pods of our Deployment (through its ReplicaSets), never just any pod that
    carries the selector's labels: only these are scraped and sent the control token."""
    pods = cache.pods_of(target.namespace, target.name)
    replicasets = cache.replicasets_of(target.namespace, target.name)
    ours, others = deployment_pods(pods, replicasets, deployment_uid)
    for pod in others:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid"))
        if uid not in state.ignored:
            state.ignored.add(uid)
            log.warning("pod %s/%s carries %s's labels but is not a pod of its Deployment (or uses the host's "
                        "network): ignored, never scraped", target.namespace, meta.get("name"), target.name)
    state.ignored &= {str((p.get("metadata") or {}).get("uid")) for p in others}
    return ours


def _seed_gate(gate: gating.GateState, refs: list[gating.PodRef], pods: Mapping[str, Obj]) -> None:
    """After an operator restart, each pod's last directive comes back from its tier annotation
    (what this operator wrote), so hysteresis holds and no tier "changes" to what it already was."""
    for ref in refs:
        if ref.uid in gate.directives:
            continue
        note = ((pods[ref.uid].get("metadata") or {}).get("annotations") or {}).get(contract.ANNOTATION_TIER)
        try:
            tier = Tier(str(note))
        except ValueError:
            continue
        gate.directives[ref.uid] = tier
        if tier is not Tier.UNKNOWN:
            gate.pod_tiers.setdefault(ref.uid, tier)


def _scrapeable(target: Target, pods: list[Obj]) -> tuple[list[gating.PodRef], dict[str, Obj]]:
    refs: list[gating.PodRef] = []
    by_uid: dict[str, Obj] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid"))
        by_uid[uid] = pod
        ip = str((pod.get("status") or {}).get("podIP") or "")
        if meta.get("deletionTimestamp") or not ip or (pod.get("status") or {}).get("phase") != "Running":
            continue
        if not CONFIG.allowed(ip):
            log.warning("pod %s/%s: IP %s is outside --scrape-network: not scraped", target.namespace, meta["name"], ip)
            continue
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        refs.append(gating.PodRef(uid=uid, name=str(meta.get("name")), node=node, ip=ip))
    return refs, by_uid


async def observe(
    kube: Kube,
    cache: Cache,
    scheduler: ScrapeScheduler,
    body: Mapping[str, Any],
    target: Target,
    state: PodsState,
    deployment_uid: str,
    board: sleeper.PressureBoard | None = None,
    poke: Callable[[], None] | None = None,
) -> list[st.PodObservation]:
    """Scrape what is stale, decide tiers on new samples, send directives, annotate pods, put
    idle pods to sleep and wake the needed ones; the observations for status."""
    refs, by_uid = _scrapeable(target, our_pods(cache, target, state, deployment_uid))
    port = target.spec.pod.port
    state.urls = {ref.uid: url(ref.ip, port, contract.PATH_METRICS) for ref in refs}
    state.readiness = {ref.uid: pod_ready(by_uid[ref.uid]) for ref in refs}
    for uid in set(state.samples) - set(state.urls):
        del state.samples[uid]
    state.fresh &= set(state.urls)
    # A pod without a sample, or whose Ready condition moved since its sample: scraped now, so
    # a pod turning warm (or cold) shows in this pass, not at the next round.
    stale = {
        uid: link for uid, link in state.urls.items()
        if uid not in state.samples or state.samples[uid].ready != state.readiness[uid]
    }
    if stale:
        with tracing.span(contract.SPAN_SCRAPE, {"warmpool.pods": len(stale)}):
            state.feed(await scheduler.scrape(stale))
    samples = {uid: scraped.sample for uid, scraped in state.samples.items()}

    if state.fresh or any(ref.uid not in state.decisions for ref in refs):
        with tracing.span(contract.SPAN_DECIDE, {"warmpool.pods": len(refs)}):
            _seed_gate(state.gate, refs, by_uid)
            decided = gating.decide(refs, samples, state.gate, target.spec.gating.thresholds())
            state.decisions = {d.pod.uid: d for d in decided}
            await _direct(scheduler.session, target, state, decided)
        for made in decided:
            metrics.TIER_DECISIONS.labels("pod", made.tier.value).inc()
            metrics.TIER_DECISIONS.labels("node", made.node_tier.value).inc()
            if made.changed:
                _tier_event(body, by_uid[made.pod.uid], made)
        state.fresh.clear()
    else:  # nothing new was read: the last decisions stand (announced and sent already)
        state.decisions = {uid: d for uid, d in state.decisions.items() if uid in state.urls}

    observations: list[st.PodObservation] = []
    for uid, pod in by_uid.items():
        meta = pod.get("metadata") or {}
        decision = state.decisions.get(uid)
        sample = samples.get(uid)
        obs = st.PodObservation(
            uid=uid,
            name=str(meta.get("name")),
            ready=pod_ready(pod),
            terminating=bool(meta.get("deletionTimestamp")),
            sample=sample,
            decision=decision,
            failure=st.pod_failure(pod),
        )
        observations.append(obs)
        state.cold.record(uid, sample)
        if obs.terminating:
            continue
        tier = decision.tier if decision is not None else Tier.UNKNOWN
        await _annotate(kube, target, pod, tier, gating.deletion_cost(obs.warm, tier, sample))

    def refresh(uid: str) -> None:
        state.samples.pop(uid, None)
        if poke is not None:
            poke()

    ctx = sleeper.Context(kube, scheduler.session, body, target, state.token, refresh)
    await sleeper.act(ctx, state.sleep, board if board is not None else sleeper.PressureBoard(), refs, by_uid,
                      samples, state.decisions, state.readiness, awake_wanted=state.awake_wanted)
    return observations


async def _direct(
    session: aiohttp.ClientSession, target: Target, state: PodsState, decisions: list[gating.Decision]
) -> None:
    """Send each decided tier to its worker.  Re-sent with every round of samples: they expire
    in the worker after the TTL, so a dead operator never pins a pool to a stale tier."""
    port = target.spec.pod.port
    sendable = [
        (d.pod.uid, url(d.pod.ip, port, contract.PATH_CONTROL_TIER), d.tier)
        for d in decisions
        if d.tier is not Tier.UNKNOWN
    ]
    if not sendable:
        return
    results = await scrape.send_all(
        session, sendable, state.token, CONFIG.ttl(), CONFIG.scrape_timeout, CONFIG.scrape_concurrency,
        traceparent=tracing.traceparent(),
    )
    for uid, error in results.items():
        if error is not None:
            log.info("pod %s: tier directive not delivered: %s", state.decisions[uid].pod.name, error)


async def _annotate(kube: Kube, target: Target, pod: Mapping[str, Any], tier: Tier, cost: int) -> None:
    """Best effort: a refused or failed patch of one pod is logged and counted, and the pass goes
    on (the other pods, the scale decision and the status matter more than one annotation)."""
    meta = pod.get("metadata") or {}
    have = meta.get("annotations") or {}
    want = {contract.ANNOTATION_TIER: tier.value, contract.ANNOTATION_POD_DELETION_COST: str(cost)}
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


def _tier_event(body: Mapping[str, Any], pod: Mapping[str, Any], decision: gating.Decision) -> None:
    level = "unknown" if decision.used_ratio is None else f"{decision.used_ratio * 100:.0f}% used"
    before = decision.previous.value if decision.previous is not None else "none"
    message = (
        f"pod {decision.pod.name} on {decision.pod.node or '?'}: tier {before} -> {decision.tier.value} "
        f"(memory {level}; pod {decision.pod_tier.value}, node {decision.node_tier.value})"
    )
    kind = "Warning" if decision.tier in (Tier.PAUSED, Tier.UNKNOWN) else "Normal"
    pod_ref = {"apiVersion": "v1", "kind": "Pod", "metadata": pod.get("metadata") or {}}
    kopf.event([body, pod_ref], type=kind, reason="TierChanged", message=message)  # type: ignore[list-item]
    log.info("%s", message)


async def learn_heat(kube: Kube, target: Target, state: PodsState, observations: list[st.PodObservation]) -> None:
    """Best effort: the heat map is an optimisation; status must still be written."""
    samples = [o.sample for o in observations if o.sample is not None]
    payload = heat.due(state.heat, samples, CONFIG.heat_write_interval)
    if payload is None:
        return
    name = builders.configmap_name(target.name)
    try:
        await kube.patch(CONFIGMAPS, target.namespace, name, {"data": {contract.CONFIGMAP_KEY_HEATMAP: payload}})
    except (KubeError, aiohttp.ClientError, TimeoutError) as error:
        # Not marked written, so the next due pass tries again.
        metrics.WRITE_FAILURES.labels(metrics.WRITE_HEAT_MAP).inc()
        log.warning("%s/%s: heat map not written (%s): carrying on", target.namespace, target.name, error)
        return
    heat.written(state.heat, payload)
    log.info("%s/%s: heat map updated", target.namespace, target.name)
