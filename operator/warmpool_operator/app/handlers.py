"""kopf registration, and nothing else: what wakes which WarmModel's reconciler.

* kopf's own settings (one ``@kopf.on.startup``), login, start-up (API client, worker client,
  the one scrape scheduler, the registry) and clean-up; the operator's settings and tracing come
  in kopf's ``memo`` from the command line (app/cli.py);
* indexes: watch-fed caches of our children, ReplicaSets and worker pods (label-filtered); our
  worker NetworkPolicies only when the operator makes them (``watch_worker_policies``);
  not Secrets: list/watch on Secrets would let the operator read every Secret of a namespace,
  so the control Secret is read by name once per WarmModel and its token kept in memory;
* events: a WarmModel's spec, status or held-requests annotations (the activator's) changing, a
  child or worker pod changing or going, each pokes the reconciler of that WarmModel only
  (control/reconciler.py debounces the pokes); the activator's EndpointSlices (their own watch,
  control/registry.py) changing pokes every scale-to-zero pool;
  a watch seen listing again asks for a resync (control/resync.py: what it deleted meanwhile got
  no event);
* create / resume / spec update: a handler that waits for the pass, so kopf reports it.

The work lives in control/ (the pass) and rules/ (the decisions).  Deletion needs no handler:
every child carries an owner reference and the garbage collector removes it; the reconciler is
stopped and forgotten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from warmpool.contract.api import API_GROUP, API_VERSION, OPERATOR_FINALIZER, PLURAL
from warmpool.contract.pods import MANAGED_BY
from warmpool.contract.zero import HELD_ANNOTATION_PREFIX
from warmpool_operator.app.kopf_state import MemoryDiffBaseStorage, QuietProgressStorage
from warmpool_operator.control.reconciler import Permanent, Temporary
from warmpool_operator.control.registry import Registry
from warmpool_operator.io import control_key, metrics
from warmpool_operator.io.kube import Kube
from warmpool_operator.io.scrape_scheduler import ScrapeScheduler
from warmpool_operator.io.watch_cache import (
    MANAGED,
    POD_SPEC_READ,
    REPLICASET_SPEC_READ,
    Cache,
    model_key,
    slim,
    slim_worker,
    warmmodel_owner,
)
from warmpool_operator.io.worker_client import WorkerClient
from warmpool_operator.settings import OperatorConfig

#: Prefix of kopf's own annotations on WarmModels (progress storage: a handler retried).
KOPF_ANNOTATION_PREFIX = API_GROUP


GROUP, VERSION = API_GROUP, API_VERSION
Index = kopf.Index[Any, Any]

#: Explicit retry policy of every handler (kopf's default is to retry forever, every 60 s).
HANDLER_RETRIES = 20
HANDLER_BACKOFF = 5.0
HANDLER_TIMEOUT = 300.0


# --------------------------------------------------------------------------- lifecycle


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """kopf's settings, from the operator's (``memo.config``, put there by the command line)."""
    config: OperatorConfig = memo.config
    # A strict schema prunes kopf's status.kopf: progress and diff-base go to annotations.
    # A handler that succeeds at once writes nothing of kopf's onto the WarmModel (app/kopf_state.py):
    # progress only while a handler is retried, the last-handled essence in memory.
    settings.persistence.progress_storage = QuietProgressStorage(prefix=KOPF_ANNOTATION_PREFIX)
    memo.diffbase = settings.persistence.diffbase_storage = MemoryDiffBaseStorage()
    settings.persistence.finalizer = OPERATOR_FINALIZER
    # Watches: the server closes a watch after server_timeout, the client gives up a little
    # later; a silent (stalled) one is dialled again after inactivity_timeout.
    settings.watching.server_timeout = config.watch_server_timeout
    settings.watching.client_timeout = config.watch_server_timeout + 30
    settings.watching.inactivity_timeout = config.watch_inactivity_timeout
    settings.watching.connect_timeout = 10
    settings.watching.reconnect_backoff = 1.0
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 10
    # Events: ours (tier transitions, pre-warm, sleep, errors: kopf.event, any type) and kopf's own
    # warnings and errors (a handler failed, retried).  Not kopf's INFO ("Handler ... succeeded",
    # "Creation is processed"): two writes per WarmModel per change that say what status already
    # does, 2,000 Events for 1,000 WarmModels made at once.
    settings.posting.enabled = True
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = MANAGED_BY
    # Queueing ("batching" of events per object): bursts are handled once, idle object
    # workers go away, and a stuck watch-stream error backs off instead of spinning.
    # No cap on object workers: an idle worker lingers idle_timeout after its last event and
    # holds its slot, so a cap of 64 with 60 s let through about one new WarmModel per second
    # (250 created at once took 213 s on a loaded 2-core machine).  Idle workers end after 5 s.
    settings.queueing.worker_limit = None
    settings.queueing.idle_timeout = 5
    settings.queueing.exit_timeout = 10
    settings.queueing.error_delays = (1, 3, 10, 30, 60)
    settings.networking.error_backoffs = (1, 2, 5, 10, 20)
    # Handlers without their own policy: retry after a bounded backoff (each handler also
    # sets retries=/backoff=/timeout= explicitly).
    settings.execution.default_backoff = HANDLER_BACKOFF
    settings.execution.max_workers = 8
    # One replica acts (app/leader.py's Lease, taken before kopf starts): no kopf peering objects.
    settings.peering.standalone = True


@kopf.on.login(retries=3, backoff=2.0)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the service account; elsewhere: the kubeconfig ($KUBECONFIG honoured).

    In a pod the API server is the address the kubelet puts in KUBERNETES_SERVICE_HOST/_PORT, as
    client-go's in-cluster config takes it: kopf's own default names kubernetes.default.svc, which
    needs cluster DNS, and a cluster without DNS (or a pod whose DNS is down) could not log in.
    """
    info: kopf.ConnectionInfo | None = kopf.login_with_service_account(**kwargs)
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if info is not None and host and port:
        address = f"[{host}]" if ":" in host else host
        info = dataclasses.replace(info, server=f"https://{address}:{port}")
    return info or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup(retries=5, backoff=2.0, timeout=60)
async def connect(memo: kopf.Memo, **_: Any) -> None:
    config: OperatorConfig = memo.config
    kube = await Kube.connect(config.api_concurrency)
    try:
        key = await control_key.load_or_create(kube, config.control_key_namespace, config.control_key_secret)
    except control_key.ControlKeyError as error:
        await kube.close()
        raise kopf.PermanentError(str(error)) from None
    except BaseException:
        await kube.close()
        raise
    workers = WorkerClient.open(config.scrape_timeout, config.scrape_concurrency)
    scheduler = ScrapeScheduler(workers, config.scrape_interval, config.scrape_concurrency)
    memo.registry = Registry(kube=kube, workers=workers, scheduler=scheduler, config=config, tracing=memo.tracing,
                             control_key=key)
    memo.registry.start_scheduler()
    memo.registry.start_resync()
    memo.registry.start_activator_watch()
    memo.registry.start_node_watch()


@kopf.on.cleanup()
async def disconnect(memo: kopf.Memo, **_: Any) -> None:
    registry: Registry | None = getattr(memo, "registry", None)
    if registry is not None:
        await registry.close()
        await registry.workers.close()
        await registry.kube.close()


def _registry(memo: kopf.Memo) -> Registry:
    registry: Registry | None = getattr(memo, "registry", None)
    if registry is None:
        raise kopf.TemporaryError("the operator is not connected yet", delay=memo.config.retry_delay)
    return registry


def _cache(registry: Registry, kwargs: Mapping[str, Any]) -> Cache:
    children = {
        "Deployment": kwargs["wp_deployments"],
        "Service": kwargs["wp_services"],
        "ConfigMap": kwargs["wp_configmaps"],
        "PodDisruptionBudget": kwargs["wp_pdbs"],
        "EndpointSlice": kwargs["wp_endpointslices"],
        # Indexed only with --worker-policy-ingress (watch_worker_policies): else none to hold.
        "NetworkPolicy": kwargs.get("wp_networkpolicies", {}),
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


@kopf.index("discovery.k8s.io", "v1", "endpointslices", labels=MANAGED)
def wp_endpointslices(namespace: str | None, name: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return _by_name(namespace, name, body)


def wp_networkpolicies(namespace: str | None, name: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return _by_name(namespace, name, body)


def watch_worker_policies() -> None:
    """Index and watch our worker NetworkPolicies, as the other children: only when the operator
    makes them (--worker-policy-ingress), so an operator that does not needs no RBAC on them."""
    kopf.index("networking.k8s.io", "v1", "networkpolicies", labels=MANAGED)(wp_networkpolicies)
    kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=MANAGED)(child_changed)


@kopf.index("apps", "v1", "replicasets", labels=MANAGED)
def wp_replicasets(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any] | None:
    key = model_key(namespace, labels)
    return None if key is None else {key: slim_worker(body, REPLICASET_SPEC_READ)}


@kopf.index("", "v1", "pods", labels=MANAGED)
def wp_pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any] | None:
    key = model_key(namespace, labels)
    return None if key is None else {key: slim_worker(body, POD_SPEC_READ)}


# --------------------------------------------------------------------------- events


def held_annotations(body: Mapping[str, Any]) -> dict[str, str]:
    """The activator replicas' held-requests annotations of a WarmModel."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    return {k: str(v) for k, v in annotations.items() if k.startswith(HELD_ANNOTATION_PREFIX)}


@kopf.on.event(GROUP, VERSION, PLURAL)
async def warmmodel_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    """A new generation, or a status we did not write (someone else's is corrected, never believed)."""
    registry = _registry(memo)
    meta = body.get("metadata") or {}
    registry.saw(type, str(meta.get("uid")))
    if type == "DELETED":
        await registry.forget(str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid")))
        diffbase: MemoryDiffBaseStorage | None = getattr(memo, "diffbase", None)
        if diffbase is not None:
            diffbase.forget(str(meta.get("uid")))
        return
    before = registry.get(str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid")))
    seen = (before.body.get("metadata", {}).get("generation"), before.body.get("status"),
            held_annotations(before.body)) if before else None
    # Listed (type None: the watch's initial list, or a list again after it broke): a backlog that
    # news overtakes (control/pass_queue.py).
    rec = registry.ensure(body, _cache(registry, kwargs), listed=type is None)
    # The activator's held-requests annotations are news too: a request waits for this pass.
    if seen != (meta.get("generation"), body.get("status"), held_annotations(body)):
        if type is None:
            rec.poke_routine()
        else:
            rec.poke()


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("", "v1", "configmaps", labels=MANAGED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
@kopf.on.event("discovery.k8s.io", "v1", "endpointslices", labels=MANAGED)
async def child_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A child deleted or edited: its WarmModel's pass restores it.  The echo of our own write
    (the version we settled on) and a Deployment's unchanged status wake nothing."""
    registry = _registry(memo)
    registry.saw(type, str((body.get("metadata") or {}).get("uid")))
    owner = warmmodel_owner(body)
    rec = registry.get(*owner) if owner is not None else None
    if rec is None:
        return
    if type == "DELETED" or body.get("kind") == "Deployment" or not rec.is_echo(body):
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
    if rec.saw_pod(type, body):
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
        raise kopf.TemporaryError(str(error), delay=registry.config.retry_delay) from None


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, retries=1)
async def forget(meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """Children go with the owner references; only our memory of the object is dropped."""
    await _registry(memo).forget(str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid")))
    for gauge in (metrics.WARM_PODS, metrics.MIN_WARM_PODS):
        with contextlib.suppress(KeyError):
            gauge.remove(str(meta.get("namespace")), str(meta.get("name")))
