"""Cluster-wide mode's worker NetworkPolicy, which the operator makes per WarmModel (the chart cannot
know the namespaces): over the in-memory API server and against a real one (the control_cluster
fixture), the watches played by the test.  Made only with ``--worker-policy-ingress``, owned by the
WarmModel, brought back when edited or deleted, and never written when the name is someone else's;
a user's own policies are left alone.  The chart's side (the flag, the RBAC, the rules it renders)
is tests/integration/test_helm_chart.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kopf
import pytest
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.api.types import parse_spec
from warmpool_operator.app import handlers
from warmpool_operator.control import children, resync
from warmpool_operator.control.registry import Registry
from warmpool_operator.io.scrape_scheduler import ScrapeScheduler
from warmpool_operator.io.tracing import Tracing
from warmpool_operator.model import Obj, Target
from warmpool_operator.rules import builders
from warmpool_operator.settings import OperatorConfig

from tests.support.control_doubles import Clock, ControlCluster, FakeWorkers, capture_events
from warmpool.contract.api import API_GROUP_VERSION, KIND

KEY = b"k" * 32
#: Ingress rules as the chart renders them (--worker-policy-ingress): the operator's pods, and the
#: pods of the pool's own namespace (workerClients' default).
INGRESS: tuple[dict[str, Any], ...] = (
    {"ports": [{"port": "http", "protocol": "TCP"}],
     "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "warmpool-system"}},
               "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}}},
              {"podSelector": {}}]},
)
POLICY = builders.network_policy_name("m")
SPEC = {"model": {"hostPath": {"path": "/models/m"}}, "pool": {"replicas": 1}}


def target(cluster: ControlCluster) -> Target:
    return Target("m", cluster.namespace, parse_spec(SPEC))


async def supporting(cluster: ControlCluster, wm: Obj, settled: children.Settled,
                     ingress: tuple[dict[str, Any], ...] | None = INGRESS) -> children.Supporting:
    return await children.ensure_supporting(cluster.kube, cluster.cache, target(cluster), wm, settled, KEY, "",
                                            ingress)


async def test_the_pools_worker_policy_is_made_only_when_asked_and_owned_by_its_warmmodel(
        control_cluster: ControlCluster) -> None:
    cluster = control_cluster
    wm = await cluster.warmmodel("m", SPEC)
    await supporting(cluster, wm, children.Settled(), ingress=None)
    assert await cluster.kube.get_obj("networkpolicies", cluster.namespace, POLICY) is None
    assert not cluster.kube.writes("networkpolicies")

    made = await supporting(cluster, wm, children.Settled())
    assert not made.conflicts
    policy = await cluster.kube.get_obj("networkpolicies", cluster.namespace, POLICY)
    assert policy is not None
    (ref,) = policy["metadata"]["ownerReferences"]
    assert (ref["uid"], ref["kind"], ref["controller"]) == (wm["metadata"]["uid"], "WarmModel", True)
    # The pool's pods by its selector labels (never the awake label a sleeping pod loses).
    assert policy["spec"]["podSelector"] == {"matchLabels": builders.selector_labels("m")}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == list(INGRESS)
    # Watched like the other children: left alone while it matches.
    await cluster.watch()
    assert cluster.cache.child("NetworkPolicy", cluster.namespace, POLICY) is not None
    settled = children.Settled()
    await supporting(cluster, wm, settled)
    before = len(cluster.kube.writes("networkpolicies"))
    await supporting(cluster, wm, settled)
    assert len(cluster.kube.writes("networkpolicies")) == before


async def test_an_edited_or_deleted_worker_policy_is_brought_back(control_cluster: ControlCluster) -> None:
    cluster, ns = control_cluster, control_cluster.namespace
    wm, settled = await cluster.warmmodel("m", SPEC), children.Settled()
    await supporting(cluster, wm, settled)

    async def edit(spec: dict[str, Any]) -> None:
        live = await cluster.kube.get_obj("networkpolicies", ns, POLICY)
        assert live is not None
        await cluster.kube.put("networkpolicies", {**live, "spec": {**live["spec"], **spec}})
        await cluster.watch()
        await supporting(cluster, wm, settled)
        fixed = await cluster.kube.get_obj("networkpolicies", ns, POLICY)
        assert fixed is not None
        assert fixed["spec"]["ingress"] == list(INGRESS)
        assert fixed["spec"]["podSelector"] == {"matchLabels": builders.selector_labels("m")}

    await edit({"ingress": [{}]})  # opened to every caller on every port
    await edit({"podSelector": {"matchLabels": {**builders.selector_labels("m"), "nothing": "matches"}}})
    await cluster.kube.delete_obj("networkpolicies", ns, POLICY)
    # The watch missed the delete (a relist): the resync finds it gone.
    gone = await resync.deleted_children(cluster.kube, cluster.cache)
    assert [(d.kind, d.name) for d in gone] == [("NetworkPolicy", POLICY)]
    await cluster.watch()
    await supporting(cluster, wm, settled)
    assert await cluster.kube.get_obj("networkpolicies", ns, POLICY) is not None


async def test_a_users_own_network_policies_are_left_alone(control_cluster: ControlCluster) -> None:
    cluster, ns = control_cluster, control_cluster.namespace
    wm = await cluster.warmmodel("m", SPEC)
    def their_policy(name: str, ingress: list[Obj]) -> Obj:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": name, "namespace": ns, "labels": {"team": "a"}},
                "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": ingress}}

    theirs = their_policy(POLICY, [{}])
    other = their_policy("m", [])  # a team's own policy for the pool's pods, by the pool's name
    for policy in (theirs, other):
        await cluster.kube.put("networkpolicies", policy)
    stored = {name: await cluster.kube.get_obj("networkpolicies", ns, name) for name in (POLICY, "m")}
    await cluster.watch()
    made = await supporting(cluster, wm, children.Settled())
    assert [str(c) for c in made.conflicts] == [
        f"NetworkPolicy {ns}/{POLICY} exists and is not owned by this WarmModel"]
    assert not [c for c in cluster.kube.writes("networkpolicies") if c.method != "POST"]
    for name, before in stored.items():
        assert await cluster.kube.get_obj("networkpolicies", ns, name) == before


async def call(handler: Any, **kwargs: Any) -> None:
    """A handler called as kopf calls it, by keyword."""
    await handler(**kwargs)


@pytest.fixture()
async def registry(control_cluster: ControlCluster) -> AsyncIterator[Registry]:
    capture_events()
    workers = FakeWorkers(Clock())
    config = OperatorConfig(scrape_interval=1.0, retry_delay=0.5, worker_policy_ingress=INGRESS)
    made = Registry(kube=control_cluster.kube, workers=workers, scheduler=ScrapeScheduler(workers, 1.0, 4),
                    config=config, tracing=Tracing())
    yield made
    await made.close()


async def test_a_pass_with_the_flag_makes_the_policy_and_its_watch_events_wake_the_pass(
        control_cluster: ControlCluster, registry: Registry) -> None:
    cluster = control_cluster
    memo = kopf.Memo(config=registry.config, tracing=Tracing(), registry=registry)
    c = cluster.children
    indexes = {"wp_deployments": c["Deployment"], "wp_services": c["Service"], "wp_configmaps": c["ConfigMap"],
               "wp_pdbs": c["PodDisruptionBudget"], "wp_endpointslices": c["EndpointSlice"],
               "wp_networkpolicies": c["NetworkPolicy"], "wp_replicasets": cluster.replicasets,
               "wp_pods": cluster.pods}
    body = await cluster.warmmodel("m", SPEC)
    await call(handlers.reconcile, body=body, memo=memo, **indexes)
    policy = await cluster.kube.get_obj("networkpolicies", cluster.namespace, POLICY)
    assert policy is not None and policy["spec"]["ingress"] == list(INGRESS)
    rec = registry.get(cluster.namespace, "m")
    assert rec is not None
    pokes: list[None] = []
    rec.poke = lambda: pokes.append(None)  # type: ignore[method-assign]
    await cluster.watch()
    await call(handlers.child_changed, type="DELETED", body=policy, memo=memo)
    assert len(pokes) == 1


#: Bound of each wait on the operator process (it starts and makes a pool's children in seconds).
WAIT_S = 60.0


@pytest.mark.integration
def test_the_operator_process_with_the_flag_watches_its_policies_and_restores_them(
        api_server: ClusterHandle, tmp_path: Path) -> None:
    """`warmpool operator --worker-policy-ingress` against a real API server: kopf registers the
    NetworkPolicy index and watch at start (app/handlers.py: watch_worker_policies), so a policy
    deleted or opened by hand comes back from its watch event, with no resync (an hour away)."""
    namespace = f"policies-{uuid.uuid4().hex[:6]}"
    api_server.kubectl("create", "namespace", namespace)
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmpool", "operator", "--namespace", namespace,
             "--worker-policy-ingress", json.dumps(list(INGRESS)), "--resync-interval", "3600",
             "--scrape-network", "127.0.0.0/8", "--bind", "127.0.0.1", "--metrics-port", "0",
             "--liveness-port", "0", "--control-key-namespace", namespace],
            env={**os.environ, "KUBECONFIG": str(api_server.kubeconfig), "PYTHONUNBUFFERED": "1"},
            stdout=out, stderr=subprocess.STDOUT)

    def policy() -> Obj | None:
        got = api_server.kubectl("get", "networkpolicy", "-n", namespace, POLICY, "-o", "json", check=False)
        return json.loads(got.stdout) if got.returncode == 0 else None

    def until(what: str, done: Callable[[Obj | None], bool]) -> Obj:
        deadline = time.monotonic() + WAIT_S
        while not done(found := policy()):
            assert proc.poll() is None, f"the operator exited:\n{log.read_text(errors='replace')}"
            assert time.monotonic() < deadline, f"{what} within {WAIT_S:g}s:\n{log.read_text(errors='replace')}"
            time.sleep(0.3)
        assert found is not None
        return found

    try:
        api_server.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(
            {"apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": "m"}, "spec": SPEC}))
        first = until("no worker policy made", lambda p: p is not None)
        assert first["spec"]["ingress"] == list(INGRESS)
        api_server.kubectl("delete", "networkpolicy", "-n", namespace, POLICY)
        until("the deleted policy not made again",
              lambda p: p is not None and p["metadata"]["uid"] != first["metadata"]["uid"])
        api_server.kubectl("patch", "networkpolicy", "-n", namespace, POLICY, "--type=merge",
                           "-p", json.dumps({"spec": {"ingress": [{}]}}))
        until("the opened policy not restored", lambda p: p is not None and p["spec"]["ingress"] == list(INGRESS))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
