"""The activator's reading of NetworkPolicies (activator/reach.py): a caller passes only where the
pool's namespace's policies would let it open the pool's worker port directly."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from warmpool_operator.activator.callers import Callers
from warmpool_operator.activator.reach import Caller, Target, admits, selector_matches
from warmpool_operator.rules.builders import pod_labels

from warmpool.contract.http import DEFAULT_WORKER_PORT, WORKER_PORT_NAME

pytestmark = pytest.mark.unit

POOL = Target("team-b", pod_labels("m"), DEFAULT_WORKER_PORT, WORKER_PORT_NAME)
SAME = Caller("10.0.0.2", "team-b", {"app": "gateway"}, {"team": "b"})
OTHER = Caller("10.0.0.3", "team-a", {"app": "gateway"}, {"team": "a"})
STRANGER = Caller("192.0.2.9")


def policy(ingress: list[dict[str, Any]] | None, selector: dict[str, Any] | None = None,
           types: list[str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"podSelector": {} if selector is None else selector}
    if ingress is not None:
        spec["ingress"] = ingress
    if types is not None:
        spec["policyTypes"] = types
    return {"spec": spec}


def test_no_policy_selecting_the_pods_admits_everyone_as_kubernetes_does() -> None:
    assert admits([], POOL, OTHER) and admits([], POOL, STRANGER)
    other_pods = policy([], selector={"matchLabels": {"app": "db"}})
    assert admits([other_pods], POOL, OTHER)
    egress_only = policy(None, types=["Egress"])
    assert admits([egress_only], POOL, OTHER)


def test_a_selecting_policy_admits_only_its_peers_on_its_ports() -> None:
    own_namespace = policy([{"from": [{"podSelector": {}}], "ports": [{"port": WORKER_PORT_NAME}]}])
    assert admits([own_namespace], POOL, SAME)
    assert not admits([own_namespace], POOL, OTHER)
    assert not admits([own_namespace], POOL, STRANGER)
    deny_all = policy([])
    assert not admits([deny_all], POOL, SAME)
    other_port = policy([{"from": [{"podSelector": {}}], "ports": [{"port": 9090}]}])
    assert not admits([other_port], POOL, SAME)
    port_range = policy([{"ports": [{"port": 8000, "endPort": 8100}]}])
    assert admits([port_range], POOL, OTHER)
    udp = policy([{"ports": [{"port": DEFAULT_WORKER_PORT, "protocol": "UDP"}]}])
    assert not admits([udp], POOL, OTHER)
    # Policies add up: one that admits is enough.
    assert admits([deny_all, own_namespace], POOL, SAME)


def test_namespace_and_pod_selectors_and_ip_blocks() -> None:
    team_a = policy([{"from": [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]}])
    assert admits([team_a], POOL, OTHER) and not admits([team_a], POOL, SAME)
    team_a_gateways = policy([{"from": [{"namespaceSelector": {"matchLabels": {"team": "a"}},
                                          "podSelector": {"matchLabels": {"app": "db"}}}]}])
    assert not admits([team_a_gateways], POOL, OTHER)
    block = policy([{"from": [{"ipBlock": {"cidr": "192.0.2.0/24", "except": ["192.0.2.9/32"]}}]}])
    assert not admits([block], POOL, STRANGER)
    assert admits([block], POOL, Caller("192.0.2.10"))
    # A caller that is no pod we know matches no pod or namespace selector, even {}.
    everyone_in_cluster = policy([{"from": [{"namespaceSelector": {}}]}])
    assert admits([everyone_in_cluster], POOL, OTHER) and not admits([everyone_in_cluster], POOL, STRANGER)


def test_the_node_is_always_admitted_and_unknown_selector_operators_match_nothing() -> None:
    assert admits([policy([])], POOL, Caller("10.244.0.1", is_node=True))
    assert selector_matches({"matchExpressions": [{"key": "app", "operator": "In", "values": ["gateway"]}]},
                            {"app": "gateway"})
    assert selector_matches({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["x"]}]}, {})
    assert not selector_matches({"matchExpressions": [{"key": "app", "operator": "Exists"}]}, {})
    assert selector_matches({"matchExpressions": [{"key": "app", "operator": "DoesNotExist"}]}, {})
    assert not selector_matches({"matchExpressions": [{"key": "app", "operator": "Gt", "values": ["1"]}]},
                                {"app": "2"})


def test_callers_are_told_apart_by_the_pods_and_nodes_the_watches_bring() -> None:
    callers = Callers()
    callers.namespace("ADDED", {"metadata": {"name": "team-b", "labels": {"team": "b"}}})
    callers.pod("ADDED", {"metadata": {"uid": "1", "namespace": "team-b", "labels": {"app": "gateway"}},
                          "status": {"podIP": "10.0.0.2", "podIPs": [{"ip": "10.0.0.2"}]}})
    # A hostNetwork pod has its node's address: it tells nothing about who calls from there.
    callers.pod("ADDED", {"metadata": {"uid": "2", "namespace": "team-b", "labels": {}},
                          "spec": {"hostNetwork": True}, "status": {"podIP": "10.244.0.1"}})
    callers.node("ADDED", {"metadata": {"name": "n"}, "status": {"addresses": [
        {"type": "InternalIP", "address": "10.244.0.1"}, {"type": "Hostname", "address": "n"}]}})
    assert callers.caller("10.0.0.2") == Caller("10.0.0.2", "team-b", {"app": "gateway"}, {"team": "b"})
    assert callers.caller("10.244.0.1").is_node and callers.namespace_of("10.244.0.1") is None
    callers.pod("DELETED", {"metadata": {"uid": "1", "namespace": "team-b"}})
    assert callers.caller("10.0.0.2") == Caller("10.0.0.2")
    callers.network_policy("ADDED", {"metadata": {"uid": "p", "namespace": "team-b"}, **policy([])})
    assert not callers.may_reach("10.0.0.2", POOL) and callers.may_reach("10.244.0.1", POOL)
    callers.network_policy("DELETED", {"metadata": {"uid": "p", "namespace": "team-b"}})
    assert callers.may_reach("10.0.0.2", POOL)


async def test_a_pod_that_calls_before_its_address_arrives_is_waited_for_briefly() -> None:
    callers = Callers()
    pod = {"metadata": {"uid": "new", "namespace": "team-b", "labels": {}}, "status": {"podIP": "10.0.0.9"}}
    waiting = asyncio.create_task(callers.settle("10.0.0.9", wait_s=30))
    await asyncio.sleep(0)
    assert not waiting.done()
    callers.pod("ADDED", pod)  # the watch brings the new pod's address
    await asyncio.wait_for(waiting, 5)
    assert callers.namespace_of("10.0.0.9") == "team-b"
    # A stranger is waited for no longer than the bound, then judged as no pod.
    started = asyncio.get_running_loop().time()
    await callers.settle("192.0.2.1", wait_s=0.2)
    assert asyncio.get_running_loop().time() - started < 5 and callers.caller("192.0.2.1") == Caller("192.0.2.1")
    # Loopback is only ever the activator's own pod: as a node, at once.
    await asyncio.wait_for(callers.settle("127.0.0.1"), 1)
    assert callers.caller("127.0.0.1").is_node


def test_one_namespaces_relist_keeps_every_other_namespaces_policies_and_slices() -> None:
    """The activator runs one policy watch and one slice watch per watched namespace (the chart's
    release namespace and the pools'): each list started over every namespace's objects, so the last
    namespace listed left the pools' namespaces with no policy (every caller admitted) and no pods.
    Found on the real node by e2e/test_e2e_network_policies.py."""
    from warmpool_operator.activator.pools import Pools

    callers = Callers()
    for ip, namespace in ((OTHER.ip, "team-a"), (SAME.ip, "team-b")):
        callers.pod("ADDED", {"metadata": {"uid": ip, "namespace": namespace, "labels": {"app": "gateway"}},
                              "status": {"podIP": ip}})
    callers.network_policy("ADDED", {"metadata": {"namespace": "team-b", "uid": "p"},
                                     **policy([{"from": [{"podSelector": {}}]}])})
    assert not callers.may_reach(OTHER.ip, POOL)
    callers.relisted_network_policies("team-a")  # team A's watch lists: team B's policy stays
    assert not callers.may_reach(OTHER.ip, POOL) and callers.may_reach(SAME.ip, POOL)
    callers.relisted_network_policies("team-b")
    assert callers.may_reach(OTHER.ip, POOL), "team B's own list starts its policies over"

    pools = Pools()
    warmmodel = {"metadata": {"namespace": "team-b", "name": "m", "uid": "u-m"},
                 "spec": {"model": {"hostPath": {"path": "/m"}}, "pool": {}}}
    pools.warmmodel("ADDED", warmmodel)
    pools.endpoint_slice("ADDED", {"metadata": {"namespace": "team-b", "name": "m-pods",
                                                "ownerReferences": [{"uid": "u-m"}]},
                                   "ports": [{"port": 8080}], "endpoints": [{"addresses": ["10.0.0.7"]}]})
    assert pools.pool(("team-b", "m")).pods == ["http://10.0.0.7:8080"]
    pools.relisted_endpoint_slices("team-a")
    assert pools.pool(("team-b", "m")).pods == ["http://10.0.0.7:8080"]
    # The pods are worked out again from the slices kept whenever team B's WarmModel changes: team
    # A's list must have kept team B's slice itself, not only the pods last worked out from it.
    pools.warmmodel("MODIFIED", warmmodel)
    assert pools.pool(("team-b", "m")).pods == ["http://10.0.0.7:8080"], "team A's list forgot team B's slices"
    pools.relisted_endpoint_slices("team-b")
    assert pools.pool(("team-b", "m")).pods == []
