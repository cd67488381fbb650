"""What a pool learns, written where new pods read it: the heat map (the layers the workers
touch most, loaded first) and the learned warm-up lengths, both keys of the WarmModel's ConfigMap.

Best effort, both: an optimisation whose write fails is logged and counted, and the pass goes on
to write the status.
"""

from __future__ import annotations

import json
import logging

import aiohttp

from warmpool.contract.files import CONFIGMAP_KEY_HEATMAP, LEARNED_BUCKETS_FORMAT
from warmpool.kube import KubeError
from warmpool_operator.api.types import LearnedBucketsStatus
from warmpool_operator.io import metrics
from warmpool_operator.io.kube import CONFIGMAPS, Kube
from warmpool_operator.io.watch_cache import Cache
from warmpool_operator.model import Target
from warmpool_operator.rules import builders, heat
from warmpool_operator.rules.builders import CONFIGMAP_KEY_LEARNED_BUCKETS
from warmpool_operator.rules.observation import PodObservation

log = logging.getLogger("warmpool.operator")


async def write_heat(kube: Kube, target: Target, state: heat.HeatState, observations: list[PodObservation],
                     interval: float, now: float) -> None:
    """The pool's summed layer heat, when due (rate-limited, and only when the order changed)."""
    samples = [o.sample for o in observations if o.sample is not None]
    payload = heat.due(state, samples, interval, now)
    if payload is None:
        return
    name = builders.configmap_name(target.name)
    try:
        await kube.patch(CONFIGMAPS, target.namespace, name, {"data": {CONFIGMAP_KEY_HEATMAP: payload}})
    except (KubeError, aiohttp.ClientError, TimeoutError) as error:
        # Not marked written, so the next due pass tries again.
        metrics.WRITE_FAILURES.labels(metrics.WRITE_HEAT_MAP).inc()
        log.warning("%s/%s: heat map not written (%s): carrying on", target.namespace, target.name, error)
        return
    heat.written(state, payload, now)
    log.info("%s/%s: heat map updated", target.namespace, target.name)


async def write_learned_buckets(kube: Kube, cache: Cache, target: Target,
                                learned: LearnedBucketsStatus | None) -> None:
    """The learned warm-up lengths (spec.warmup.learnBuckets), or their key removed once it is off."""
    want: str | None = None  # learnBuckets off: the key goes (new pods warm at spec.warmup.buckets)
    if target.spec.warmup.learn_buckets:
        if learned is None or not learned.buckets:
            return  # none learned (yet, or since a restart): what new pods read stays as it is
        want = json.dumps({"format": LEARNED_BUCKETS_FORMAT, "buckets": learned.buckets})
    name = builders.configmap_name(target.name)
    live = cache.child("ConfigMap", target.namespace, name)
    have = ((live or {}).get("data") or {}).get(CONFIGMAP_KEY_LEARNED_BUCKETS)
    if live is None or have == want:
        return
    try:
        await kube.patch(CONFIGMAPS, target.namespace, name, {"data": {CONFIGMAP_KEY_LEARNED_BUCKETS: want}})
    except (KubeError, aiohttp.ClientError, TimeoutError) as error:
        log.warning("%s/%s: learned warm-up lengths not written (%s): carrying on", target.namespace,
                    target.name, error)
        return
    log.info("%s/%s: learned warm-up lengths %s", target.namespace, target.name,
             learned.buckets if learned is not None and want is not None else "removed")
