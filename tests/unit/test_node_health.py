"""Node loss and drains, the pure side (issue 44): which nodes are lost or cordoned
(rules/node_health.py), what that makes of a pod (rules/observation.py, control/observe.py), and how
many pods the pool runs for it (rules/scaling.py)."""

from __future__ import annotations

from typing import Any

import pytest
from warmpool_operator.api.types import parse_spec
from warmpool_operator.control import observe
from warmpool_operator.control.nodes import pools_on
from warmpool_operator.io import worker_metrics as scrape
from warmpool_operator.io.watch_cache import Cache
from warmpool_operator.model import Sample
from warmpool_operator.rules import scaling
from warmpool_operator.rules.node_health import ALL_HEALTHY, NodeBoard, NodeHealth, node_cordoned, node_lost
from warmpool_operator.rules.observation import PodObservation

from warmpool.contract.metrics import METRIC_READY
from warmpool.contract.pods import LABEL_MODEL

pytestmark = pytest.mark.unit


def node(name: str, ready: str | None = "True", *, taints: tuple[str, ...] = (), unschedulable: bool = False,
         heartbeat: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    """A Node as the kubelet and the node lifecycle controller leave it."""
    spec: dict[str, Any] = {"taints": [{"key": key, "effect": "NoSchedule"} for key in taints]}
    if unschedulable:
        spec["unschedulable"] = True
    conditions = [] if ready is None else [{"type": "Ready", "status": ready, "lastHeartbeatTime": heartbeat}]
    return {"metadata": {"name": name}, "spec": spec, "status": {"conditions": conditions}}


def test_a_node_is_lost_when_not_ready_unknown_or_tainted_unreachable() -> None:
    assert not node_lost(node("a"))
    assert node_lost(node("a", "False")) and node_lost(node("a", "Unknown"))
    # The controller's taints say it even while Ready has not been updated yet.
    assert node_lost(node("a", taints=("node.kubernetes.io/unreachable",)))
    assert node_lost(node("a", taints=("node.kubernetes.io/not-ready",)))
    assert not node_lost(node("a", taints=("node.kubernetes.io/unschedulable", "gpu")))
    assert not node_lost(node("a", None))  # just registered: no Ready condition yet
    assert node_cordoned(node("a", unschedulable=True)) and not node_cordoned(node("a"))


def test_the_board_keeps_each_nodes_state_and_only_a_change_is_news() -> None:
    board = NodeBoard()
    assert not board.update("ADDED", node("a"))  # healthy, as every unseen node is
    assert board.update("MODIFIED", node("a", "Unknown"))
    assert not board.update("MODIFIED", node("a", "Unknown", heartbeat="2026-01-01T00:00:10Z"))
    assert board.update("MODIFIED", node("b", unschedulable=True))
    assert board.health() == NodeHealth(lost=frozenset({"a"}), cordoned=frozenset({"b"}))
    # A lost node that is cordoned too (a drain of a dead node) is lost: its pods serve nothing.
    assert not board.update("MODIFIED", node("a", "False", unschedulable=True))
    assert board.health().cordoned == {"b"}
    assert board.update("MODIFIED", node("a")) and board.health().lost == frozenset()
    assert board.update("DELETED", node("b", unschedulable=True)) and board.health() == ALL_HEALTHY
    board.update("MODIFIED", node("c", "False"))
    assert board.clear() == {"c"} and board.health() == ALL_HEALTHY
    # Nodes that may not be read: every node healthy, whatever was seen.
    board.update("MODIFIED", node("d", "False"))
    board.readable = False
    assert board.health() == ALL_HEALTHY


def _sample(ready: bool) -> Sample:
    return scrape.parse_metrics(f"{METRIC_READY} {1 if ready else 0}\n")


def _pod(name: str, node_name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": name, "namespace": "ns", "labels": {LABEL_MODEL: "m"}},
            "spec": {"nodeName": node_name},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


def test_a_pod_on_a_lost_node_is_not_warm_and_one_on_a_cordoned_node_is_leaving_but_warm() -> None:
    pods = {"a": _pod("a", "lost"), "b": _pod("b", "cordoned"), "c": _pod("c", "fine")}
    pool = observe.PoolPods(refs=[], pods=pods, samples={uid: _sample(True) for uid in pods},
                            readiness={uid: True for uid in pods}, fresh=frozenset())
    health = NodeHealth(lost=frozenset({"lost"}), cordoned=frozenset({"cordoned"}))
    by_name = {o.name: o for o in observe.observations(pool, {}, health)}
    assert not by_name["a"].warm and by_name["a"].node_lost and by_name["a"].replaced
    assert by_name["a"].failure is not None and "node lost is not Ready or unreachable" in by_name["a"].failure
    assert by_name["b"].warm and by_name["b"].leaving and by_name["b"].replaced
    assert by_name["c"].warm and not by_name["c"].replaced
    # The old code's view (every node healthy): all three warm.
    assert all(o.warm and not o.replaced for o in observe.observations(pool, {}))


def _obs(name: str, *, warm: bool = True, lost: bool = False, leaving: bool = False,
         terminating: bool = False) -> PodObservation:
    """A pod Ready and warm, or (``warm`` False) one still cold-starting: not Ready yet."""
    return PodObservation(uid=name, name=name, ready=warm, terminating=terminating, sample=_sample(warm),
                          decision=None, node_lost=lost, leaving=leaving)


def test_each_pod_on_a_lost_or_cordoned_node_gets_a_replacement_until_it_goes() -> None:
    spec = parse_spec({"model": {"hostPath": {"path": "/m"}}, "pool": {"replicas": 2, "minWarm": 2, "maxReplicas": 5}})
    # Both warm pods' node dies: two more pods at once, not after the 300 s eviction.
    lost = [_obs("a", lost=True), _obs("b", lost=True)]
    assert scaling.extra_pods(lost, 2) == 2 and scaling.desired_replicas(spec, 2) == 4
    # The replacements start, then are warm: the lost pods still count until the node is back or
    # they are evicted, so the pool does not drop them while their node may yet return.
    assert scaling.extra_pods([*lost, _obs("c", warm=False), _obs("d", warm=False)], 2) == 2
    assert scaling.extra_pods([*lost, _obs("c"), _obs("d")], 2) == 2
    assert scaling.extra_pods([_obs("a"), _obs("b"), _obs("c"), _obs("d")], 2) == 0  # back: surplus goes
    evicted = [_obs("a", lost=True, terminating=True), _obs("b", lost=True, terminating=True)]
    assert scaling.extra_pods([*evicted, _obs("c"), _obs("d")], 2) == 0
    # A drain: the cordoned node's pods still serve, and are replaced first.
    assert scaling.extra_pods([_obs("a", leaving=True), _obs("b")], 2) == 1
    # A lost pod never counts as a warm one that keeps Ready-but-unverified pods from adding theirs.
    unverified = PodObservation(uid="b", name="b", ready=True, terminating=False, sample=_sample(False), decision=None)
    assert scaling.extra_pods([_obs("a", lost=True), unverified], 2) == 2
    # Within maxReplicas, as every extra pod.
    assert scaling.desired_replicas(spec, 9) == 5


def test_a_changed_node_wakes_only_the_pools_with_pods_on_it() -> None:
    pods = {("ns", "m"): [_pod("a", "n1")], ("ns", "other"): [{**_pod("b", "n2"), "metadata": {
        "name": "b", "uid": "b", "namespace": "ns", "labels": {LABEL_MODEL: "other"}}}]}
    cache = Cache(children={}, replicasets={}, pods=pods)  # type: ignore[arg-type]
    assert pools_on(cache, {"n1"}) == {("ns", "m")}
    assert pools_on(cache, {"n3"}) == set() and pools_on(None, {"n1"}) == set()
