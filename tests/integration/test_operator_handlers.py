"""kopf's handlers (app/handlers.py), called as kopf calls them, over the in-memory API server and
against a real one (the control_cluster fixture), the watches and pods played by the test: which
watch events wake which WarmModel's pass, and what kopf is told of a pass's outcome."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import kopf
import pytest
from warmpool_operator.app import handlers
from warmpool_operator.control.reconciler import Reconciler
from warmpool_operator.control.registry import Registry
from warmpool_operator.io.scrape_scheduler import ScrapeScheduler
from warmpool_operator.io.tracing import Tracing
from warmpool_operator.model import Obj
from warmpool_operator.settings import OperatorConfig

from tests.support.control_doubles import Clock, ControlCluster, FakeWorkers, capture_events
from warmpool.contract.api import PLURAL
from warmpool.contract.pods import LABEL_MODEL
from warmpool.kube import KubeError

CONFIG = OperatorConfig(scrape_interval=1.0, retry_delay=0.5)


@dataclass
class Operator:
    cluster: ControlCluster
    registry: Registry
    memo: kopf.Memo

    def indexes(self) -> dict[str, Any]:
        """What kopf passes every handler: the indexes, by the names handlers.py registers."""
        c = self.cluster
        return {"wp_deployments": c.children["Deployment"], "wp_services": c.children["Service"],
                "wp_configmaps": c.children["ConfigMap"], "wp_pdbs": c.children["PodDisruptionBudget"],
                "wp_endpointslices": c.children["EndpointSlice"], "wp_replicasets": c.replicasets, "wp_pods": c.pods}

    async def created(self, spec: dict[str, Any]) -> tuple[Obj, Reconciler]:
        """A WarmModel as the watch lists it, its reconciler, and its first pass over."""
        body = await self.cluster.warmmodel("m", spec)
        await call(handlers.reconcile, body=body, memo=self.memo, **self.indexes())
        await self.cluster.watch()
        rec = self.registry.get(self.cluster.namespace, "m")
        assert rec is not None
        return body, rec


@pytest.fixture()
async def operator(control_cluster: ControlCluster) -> AsyncIterator[Operator]:
    capture_events()
    cluster = control_cluster
    workers = FakeWorkers(Clock())
    registry = Registry(kube=cluster.kube, workers=workers, scheduler=ScrapeScheduler(workers, 1.0, 4),
                        config=CONFIG, tracing=Tracing())
    yield Operator(cluster, registry, kopf.Memo(config=CONFIG, tracing=Tracing(), registry=registry))
    await registry.close()


class Pokes:
    """Counts the passes asked of a reconciler (its poke, replaced)."""

    def __init__(self, rec: Reconciler) -> None:
        self.count = 0
        rec.poke = self  # type: ignore[method-assign]

    def __call__(self) -> None:
        self.count += 1


async def call(handler: Any, **kwargs: Any) -> None:
    """Call a handler as kopf does, by keyword (kopf types a decorated handler as its callback
    protocol, whose every keyword a test would otherwise have to pass)."""
    await handler(**kwargs)


SPEC = {"model": {"hostPath": {"path": "/models/m"}}, "pool": {"replicas": 1}}


async def test_the_echo_of_our_own_writes_wakes_nothing(operator: Operator) -> None:
    _, rec = await operator.created(SPEC)
    pokes = Pokes(rec)
    for plural in ("services", "poddisruptionbudgets"):
        child = await operator.cluster.kube.get_obj(plural, operator.cluster.namespace, "m")
        assert child is not None
        await call(handlers.child_changed, type="MODIFIED", body=child, memo=operator.memo)
    assert pokes.count == 0
    # The WarmModel's own status echo (what the pass wrote) wakes nothing either.
    echoed = await operator.cluster.kube.get_obj(PLURAL, operator.cluster.namespace, "m")
    await call(handlers.warmmodel_changed, type="MODIFIED", body=echoed or {}, memo=operator.memo,
                                     **operator.indexes())
    assert pokes.count == 0


async def test_a_child_deleted_or_edited_or_a_status_not_ours_wakes_its_pass(operator: Operator) -> None:
    _, rec = await operator.created(SPEC)
    pokes = Pokes(rec)
    service = await operator.cluster.kube.get_obj("services", operator.cluster.namespace, "m")
    assert service is not None
    await call(handlers.child_changed, type="DELETED", body=service, memo=operator.memo)
    edited = {**service, "metadata": {**service["metadata"], "generation": 2}}  # its spec edited
    await call(handlers.child_changed, type="MODIFIED", body=edited, memo=operator.memo)
    assert pokes.count == 2
    wm = await operator.cluster.kube.get_obj(PLURAL, operator.cluster.namespace, "m") or {}
    forged = {**wm, "status": {**wm.get("status", {}), "warmReplicas": 7}}
    await call(handlers.warmmodel_changed, type="MODIFIED", body=forged, memo=operator.memo,
                                     **operator.indexes())
    assert pokes.count == 3


async def test_a_worker_pod_wakes_its_pass_only_when_what_a_pass_reads_moves(operator: Operator) -> None:
    _, rec = await operator.created(SPEC)
    pokes = Pokes(rec)
    (pod,) = await operator.cluster.run_pods("m", ["10.0.0.1"])

    async def event(kind: str | None, obj: Obj) -> None:
        meta = obj["metadata"]
        await call(handlers.worker_changed, type=kind, body=obj, namespace=meta["namespace"],
                                      labels=meta["labels"], memo=operator.memo)

    await event(None, pod)
    await event("MODIFIED", {**pod, "metadata": {**pod["metadata"], "annotations": {"x": "y"}}})
    assert pokes.count == 1
    await event("MODIFIED", {**pod, "status": {**pod["status"], "podIP": "10.0.0.9"}})
    await event("DELETED", pod)
    assert pokes.count == 3
    stranger = {**pod, "metadata": {**pod["metadata"], "labels": {**pod["metadata"]["labels"],
                                                                 LABEL_MODEL: "other"}}}
    await event("MODIFIED", stranger)  # another WarmModel's (none here): nothing
    assert pokes.count == 3


async def test_a_pass_that_fails_for_good_is_a_permanent_error_a_passing_one_temporary(operator: Operator) -> None:
    with pytest.raises(kopf.PermanentError, match="HostPathNotAllowed"):
        await operator.created({"model": {"hostPath": {"path": "/etc"}}})
    operator.cluster.kube.faults[("POST", "secrets")] = handlers_kube_error()
    body = await operator.cluster.warmmodel("n", SPEC)
    with pytest.raises(kopf.TemporaryError) as raised:
        await call(handlers.reconcile, body=body, memo=operator.memo, **operator.indexes())
    assert raised.value.delay == CONFIG.retry_delay


def handlers_kube_error() -> KubeError:
    return KubeError(503, "ServiceUnavailable", "etcd is slow")


async def test_before_start_up_a_handler_is_asked_to_retry_and_a_deleted_warmmodel_is_forgotten(
        operator: Operator) -> None:
    with pytest.raises(kopf.TemporaryError):
        await call(handlers.reconcile, body={}, memo=kopf.Memo(config=CONFIG), **operator.indexes())
    body, rec = await operator.created(SPEC)
    await call(handlers.forget, meta=body["metadata"], memo=operator.memo)
    assert operator.registry.get(operator.cluster.namespace, "m") is None
    await asyncio.sleep(0)
    assert rec._task is not None and rec._task.done()
