"""Observe, the pass's first step: which pods are the pool's, and what each last said.

Pods come from the watch-fed cache, and only those of our Deployment (through its
ReplicaSets) count: a pod that merely carries the labels is never scraped nor sent the control
token.  Samples come from the scrape scheduler's rounds (:meth:`ScrapeMemory.feed`), or from an
immediate scrape of a pod without a sample or whose readiness changed since its last one, so a
pod turning warm (or cold) shows in this pass, not at the next round.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from warmpool.contract.http import PATH_METRICS
from warmpool.contract.telemetry import SPAN_SCRAPE
from warmpool_operator.io import metrics
from warmpool_operator.io.scrape_scheduler import ScrapeScheduler
from warmpool_operator.io.tracing import Tracing
from warmpool_operator.io.watch_cache import Cache
from warmpool_operator.io.worker_client import worker_url
from warmpool_operator.model import Obj, Sample, Target
from warmpool_operator.rules import gating
from warmpool_operator.rules.node_answers import NodeAnswers
from warmpool_operator.rules.node_health import ALL_HEALTHY, NodeHealth
from warmpool_operator.rules.observation import PodObservation, pod_failure, pod_ready, pod_state
from warmpool_operator.rules.ownership import deployment_pods
from warmpool_operator.settings import OperatorConfig

log = logging.getLogger("warmpool.operator")


@dataclass(frozen=True)
class Scraped:
    sample: Sample
    #: the pod's Ready condition when the sample was taken: a change means the sample is stale
    ready: bool


@dataclass
class ScrapeMemory:
    """What was last read from each pod of one pool (in memory only)."""

    samples: dict[str, Scraped] = field(default_factory=dict)
    #: pods whose sample arrived since the last pass took them
    fresh: set[str] = field(default_factory=set)
    #: uid -> metrics url and Ready, of the pods the last pass found scrapeable
    urls: dict[str, str] = field(default_factory=dict)
    readiness: dict[str, bool] = field(default_factory=dict)
    #: pods with our labels that are not our Deployment's (warned about once each)
    ignored: set[str] = field(default_factory=set)
    #: uid -> the node of each pod in ``urls``
    nodes: dict[str, str] = field(default_factory=dict)
    #: every pool's scrape outcomes by node (the operator's one, control/shared.py), when kept
    answers: NodeAnswers | None = None

    def feed(self, samples: Mapping[str, Sample]) -> None:
        """Samples from a scrape: kept with the readiness the pod had when it was scraped."""
        for uid, sample in samples.items():
            if uid in self.urls:
                self.samples[uid] = Scraped(sample, self.readiness.get(uid, False))
                self.fresh.add(uid)
                _count_errors(sample)
                if self.answers is not None:
                    self.answers.record(uid, self.nodes.get(uid, ""), sample, self.urls[uid])

    def drop(self, uid: str) -> None:
        """Forget a pod's sample (its state just changed: the next pass scrapes it again)."""
        self.samples.pop(uid, None)


def _count_errors(sample: Sample) -> None:
    if sample.error is not None:
        metrics.SCRAPE_FAILURES.labels(sample.error.split(":")[0]).inc()
    elif sample.used_ratio is None:
        metrics.SCRAPE_FAILURES.labels("no memory figure").inc()


@dataclass(frozen=True)
class PoolPods:
    """What this pass saw of the pool's pods."""

    #: the pods that may be dialled (Running, an IP inside --scrape-network, not terminating)
    refs: list[gating.PodRef]
    #: every pod of our Deployment by uid, terminating ones too
    pods: dict[str, Obj]
    samples: dict[str, Sample]
    readiness: dict[str, bool]
    #: pods with a sample new since the last pass (tiers are decided on new samples only)
    fresh: frozenset[str]


def our_pods(cache: Cache, target: Target, memory: ScrapeMemory, deployment_uid: str) -> list[Obj]:
    """The worker pods of our Deployment (through its ReplicaSets), never just any pod that
    carries the selector's labels: only these are scraped and sent the control token."""
    pods = cache.pods_of(target.namespace, target.name)
    replicasets = cache.replicasets_of(target.namespace, target.name)
    ours, others = deployment_pods(pods, replicasets, deployment_uid)
    for pod in others:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid"))
        if uid not in memory.ignored:
            memory.ignored.add(uid)
            log.warning("pod %s/%s carries %s's labels but is not a pod of its Deployment (or uses the host's "
                        "network): ignored, never scraped", target.namespace, meta.get("name"), target.name)
    memory.ignored &= {str((p.get("metadata") or {}).get("uid")) for p in others}
    return ours


def scrapeable(target: Target, pods: list[Obj], config: OperatorConfig) -> tuple[list[gating.PodRef], dict[str, Obj]]:
    """The pods the operator may reach (running, an IP inside --scrape-network), and every pod by uid."""
    refs: list[gating.PodRef] = []
    by_uid: dict[str, Obj] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid"))
        by_uid[uid] = pod
        ip = str((pod.get("status") or {}).get("podIP") or "")
        if meta.get("deletionTimestamp") or not ip or (pod.get("status") or {}).get("phase") != "Running":
            continue
        if not config.allowed(ip):
            log.warning("pod %s/%s: IP %s is outside --scrape-network: not scraped", target.namespace, meta["name"], ip)
            continue
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        refs.append(gating.PodRef(uid=uid, name=str(meta.get("name")), node=node, ip=ip))
    return refs, by_uid


async def observe(memory: ScrapeMemory, pods: list[Obj], target: Target, scheduler: ScrapeScheduler,
                  config: OperatorConfig, tracing: Tracing, nodes: NodeHealth = ALL_HEALTHY) -> PoolPods:
    """The pool's pods and their latest samples; what is stale is scraped now, but for pods on a
    lost node (their node marks them not Ready: scraping them now would only wait out the timeout
    before the pass replaces them)."""
    refs, by_uid = scrapeable(target, pods, config)
    lost = {ref.uid for ref in refs if nodes.pod_lost(ref.node)}
    port = target.spec.pod.port
    if memory.answers is not None:  # a pod gone or terminating is no evidence about its node any more
        memory.answers.forget(set(memory.urls) - {ref.uid for ref in refs})
    memory.urls = {ref.uid: worker_url(ref.ip, port, PATH_METRICS) for ref in refs}
    memory.nodes = {ref.uid: ref.node for ref in refs}
    memory.readiness = {ref.uid: pod_ready(by_uid[ref.uid]) for ref in refs}
    for uid in set(memory.samples) - set(memory.urls):
        del memory.samples[uid]
    stale = {
        uid: link for uid, link in memory.urls.items()
        if uid not in lost and (uid not in memory.samples or memory.samples[uid].ready != memory.readiness[uid])
    }
    if stale:
        with tracing.span(SPAN_SCRAPE, {"warmpool.pods": len(stale)}):
            memory.feed(await scheduler.scrape(stale))
    fresh = frozenset(memory.fresh & set(memory.urls))
    memory.fresh.clear()
    samples = {uid: scraped.sample for uid, scraped in memory.samples.items()}
    return PoolPods(refs=refs, pods=by_uid, samples=samples, readiness=dict(memory.readiness), fresh=fresh)


def observations(pool: PoolPods, decisions: Mapping[str, gating.Decision],
                 nodes: NodeHealth = ALL_HEALTHY) -> list[PodObservation]:
    """Every pod of the pool as status and scaling read it, with this pass's tier decisions and
    what its node's state means for it (rules/node_health.py)."""
    out: list[PodObservation] = []
    for uid, pod in pool.pods.items():
        meta = pod.get("metadata") or {}
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        lost = nodes.pod_lost(node)
        out.append(PodObservation(
            uid=uid,
            name=str(meta.get("name")),
            ready=pod_ready(pod),
            terminating=bool(meta.get("deletionTimestamp")),
            sample=pool.samples.get(uid),
            decision=decisions.get(uid),
            failure=nodes.failure(node) if lost else pod_failure(pod),
            state=pod_state(pod),
            node_lost=lost,
            leaving=nodes.pod_leaving(node),
        ))
    return out
