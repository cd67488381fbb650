"""kopf registration, and nothing else: what wakes which WarmModel's reconciler.

* login, start-up (API client, scrape session, the one scrape scheduler) and clean-up;
* indexes: watch-fed caches of our children, ReplicaSets and worker pods (label-filtered);
  not Secrets: list/watch on Secrets would let the operator read every Secret of a namespace,
  so the control Secret is read by name once per WarmModel and its token kept in memory;
* events: a WarmModel's spec or status changing, a child or worker pod changing or going,
  each pokes the reconciler of that WarmModel only (reconciler.py debounces the pokes); a watch
  seen listing again asks for a resync (resync.py: what it deleted meanwhile got no event);
* create / resume / spec update: a handler that waits for the pass, so kopf reports it.

The work lives elsewhere: children.py (child management), pipeline.py (scrape -> decide ->
direct -> annotate -> events), scaling.py (the scaling rules), reconciler.py (the pass).
Deletion needs no handler: every child carries an owner reference and the garbage collector
removes it; the reconciler is stopped and forgotten.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from warmpool import contract
from warmpool_operator import metrics
from warmpool_operator.cache import MANAGED, Cache, model_key, slim, warmmodel_owner
from warmpool_operator.children import version
from warmpool_operator.kube import Kube
from warmpool_operator.pipeline import pod_ready
from warmpool_operator.reconciler import Permanent, Temporary
from warmpool_operator.registry import Registry
from warmpool_operator.scheduler import ScrapeScheduler
from warmpool_operator.settings import CONFIG, HANDLER_BACKOFF, HANDLER_RETRIES, HANDLER_TIMEOUT, RETRY_DELAY

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
Index = kopf.Index[Any, Any]


# --------------------------------------------------------------------------- lifecycle


@kopf.on.login(retries=3, backoff=2.0)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the service account; elsewhere: the kubeconfig ($KUBECONFIG honoured)."""
    info: kopf.ConnectionInfo | None = kopf.login_with_service_account(**kwargs)
    return info or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup(retries=5, backoff=2.0, timeout=60)
async def connect(memo: kopf.Memo, **_: Any) -> None:
    kube = await Kube.connect()
    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=CONFIG.scrape_timeout),
        connector=aiohttp.TCPConnector(limit=CONFIG.scrape_concurrency * 2, force_close=True),
        trust_env=False,  # never send scrapes through a proxy from the environment
    )
    scheduler = ScrapeScheduler(session, CONFIG.scrape_interval, CONFIG.scrape_timeout, CONFIG.scrape_concurrency)
    memo.registry = Registry(kube=kube, session=session, scheduler=scheduler)
    memo.registry.start_scheduler()
    memo.registry.start_resync(CONFIG.resync_interval)


@kopf.on.cleanup()
async def disconnect(memo: kopf.Memo, **_: Any) -> None:
    registry: Registry | None = getattr(memo, "registry", None)
    if registry is not None:
        await registry.close()
        await registry.session.close()
        await registry.kube.close()


def _registry(memo: kopf.Memo) -> Registry:
    registry: Registry | None = getattr(memo, "registry", None)
    if registry is None:
        raise kopf.TemporaryError("the operator is not connected yet", delay=RETRY_DELAY)
    return registry


def _cache(registry: Registry, kwargs: Mapping[str, Any]) -> Cache:
    children = {
        "Deployment": kwargs["wp_deployments"],
        "Service": kwargs["wp_services"],
        "ConfigMap": kwargs["wp_configmaps"],
        "PodDisruptionBudget": kwargs["wp_pdbs"],
    }
    return Cache(children=children, replicasets=kwargs["wp_replicasets"], pods=kwargs["wp_pods"], gone=registry.gone)


# --------------------------------------------------------------------------- caches


def _by_name(namespace: str | None, name: str | None, body: kopf.Body) -> dict[Any, Any]:
    return {(namespace, name): slim(body)}


@kopf.index("apps", "v1", "deployments", labels=MANAGED)
def wp_deployments(namespace: str | None, name: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return _by_name(namespace, name, body)


@kopf.index("", "v1", "services", labels=MANAGED)
def wp_services(namespace: str | None, name: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return _by_name(namespace, name, body)


@kopf.index("", "v1", "configmaps", labels=MANAGED)
def wp_configmaps(namespace: str | None, name: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return _by_name(namespace, name, body)


@kopf.index("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
def wp_pdbs(namespace: str | None, name: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return _by_name(namespace, name, body)


@kopf.index("apps", "v1", "replicasets", labels=MANAGED)
def wp_replicasets(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any] | None:
    key = model_key(namespace, labels)
    return None if key is None else {key: slim(body)}


@kopf.index("", "v1", "pods", labels=MANAGED)
def wp_pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any] | None:
    key = model_key(namespace, labels)
    return None if key is None else {key: slim(body)}


# --------------------------------------------------------------------------- events


@kopf.on.event(GROUP, VERSION, PLURAL)
async def warmmodel_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    """A new generation, or a status we did not write (someone else's is corrected, never believed)."""
    registry = _registry(memo)
    meta = body.get("metadata") or {}
    registry.saw(type, str(meta.get("uid")))
    if type == "DELETED":
        await registry.forget(str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid")))
        return
    before = registry.get(str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid")))
    seen = (before.body.get("metadata", {}).get("generation"), before.body.get("status")) if before else None
    rec = registry.ensure(body, _cache(registry, kwargs))
    if seen != (meta.get("generation"), body.get("status")):
        rec.poke()


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("", "v1", "configmaps", labels=MANAGED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
async def child_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A child deleted or edited: its WarmModel's pass restores it.  The echo of our own write
    (the version we settled on) and a Deployment's unchanged status wake nothing."""
    registry = _registry(memo)
    registry.saw(type, str((body.get("metadata") or {}).get("uid")))
    owner = warmmodel_owner(body)
    rec = registry.get(*owner) if owner is not None else None
    if rec is None:
        return
    key = f"{body.get('kind')}/{(body.get('metadata') or {}).get('name')}"
    settled = rec.state.settled.versions.get(key)
    if type == "DELETED" or body.get("kind") == "Deployment" or settled is None or settled[1] != version(body):
        rec.poke()


@kopf.on.event("apps", "v1", "replicasets", labels=MANAGED)
@kopf.on.event("", "v1", "pods", labels=MANAGED)
async def worker_changed(
    type: str | None, body: kopf.Body, namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any
) -> None:
    """A worker pod (or its ReplicaSet) came, went, or changed in what a pass reads: readiness,
    phase, IP, termination, container states.  Annotation-only changes (ours) wake nothing."""
    registry = _registry(memo)
    meta = body.get("metadata") or {}
    registry.saw(type, str(meta.get("uid")))
    key = model_key(namespace, labels)
    rec = registry.get(*key) if key is not None else None
    if rec is None:
        return
    status = body.get("status") or {}
    containers = tuple(
        (str(c.get("name")), tuple(sorted((c.get("state") or {}).keys())), int(c.get("restartCount") or 0))
        for c in status.get("containerStatuses") or []
    )
    print_ = (type == "DELETED", status.get("phase"), status.get("podIP"), bool(meta.get("deletionTimestamp")),
              pod_ready(body), containers, status.get("replicas"), status.get("readyReplicas"))
    uid = str(meta.get("uid"))
    if rec.state.pods.seen.get(uid) != print_:
        rec.state.pods.seen[uid] = print_
        if type == "DELETED":
            rec.state.pods.seen.pop(uid, None)
        rec.poke()


# --------------------------------------------------------------------------- handlers kopf reports


@kopf.on.resume(GROUP, VERSION, PLURAL, retries=HANDLER_RETRIES, backoff=HANDLER_BACKOFF, timeout=HANDLER_TIMEOUT)
@kopf.on.create(GROUP, VERSION, PLURAL, retries=HANDLER_RETRIES, backoff=HANDLER_BACKOFF, timeout=HANDLER_TIMEOUT)
@kopf.on.update(
    GROUP, VERSION, PLURAL, field="spec", retries=HANDLER_RETRIES, backoff=HANDLER_BACKOFF, timeout=HANDLER_TIMEOUT
)
async def reconcile(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    """Wait for a pass over the WarmModel as it is now; its outcome is the handler's."""
    registry = _registry(memo)
    rec = registry.ensure(body, _cache(registry, kwargs))
    try:
        await rec.pass_now()
    except Permanent as error:
        raise kopf.PermanentError(f"{error.degradation.reason}: {error}") from None
    except Temporary as error:
        raise kopf.TemporaryError(str(error), delay=RETRY_DELAY) from None


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, retries=1)
async def forget(meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """Children go with the owner references; only our memory of the object is dropped."""
    await _registry(memo).forget(str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid")))
    for gauge in (metrics.WARM_PODS, metrics.MIN_WARM_PODS):
        with contextlib.suppress(KeyError):
            gauge.remove(str(meta.get("namespace")), str(meta.get("name")))
