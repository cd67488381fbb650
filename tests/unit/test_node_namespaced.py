"""A further real node's plan (node_namespaced.py): its names, addresses and subnet never collide
with node 0's or another node's, its state survives cluster.json, and a count out of range is
refused by name.  Starting one is proved on the machine in tests/node_lifecycle."""

from __future__ import annotations

import json

import pytest
from warmpool_devcluster import node, node_namespaced, node_network
from warmpool_devcluster.node_namespaced import NamespacedNode

pytestmark = pytest.mark.unit


def test_each_further_node_gets_its_own_subnet_name_and_an_address_node_0_never_hands_out() -> None:
    state = node.NodeState(octet=200)
    node.plan_further_nodes(state, 3, taken={201})
    first, second = state.extra
    assert (first.index, second.index) == (1, 2)
    assert {first.octet, second.octet}.isdisjoint({200, 201}) and first.octet != second.octet
    assert (first.name, first.address) == ("warmpool-node-1", "10.244.200.241")
    assert second.address == "10.244.200.242"
    assert first.network.pod_cidr == f"10.244.{first.octet}.0/24"
    # node 0's CNI hands out pod addresses only below the further nodes' ones
    assert node_network.NodeNetwork(200).last_pod_address == "10.244.200.239"
    assert len(first.host_link) <= 15 and len(first.network.bridge) <= 15  # Linux's limit on link names
    assert state.octets == {200, first.octet, second.octet}


def test_the_plan_round_trips_through_the_clusters_state_file() -> None:
    state = node.NodeState(octet=200, pids={"kubelet": 5})
    node.plan_further_nodes(state, 2, taken=set())
    state.extra[0].pids["kubelet"] = 7
    state.extra[0].made_mountpoint = True
    again = node.NodeState.from_json(json.loads(json.dumps(state.to_json())))
    assert again == state
    assert node.NodeState.from_json({"octet": 12}).extra == []  # a state written before --nodes


@pytest.mark.parametrize("count", [0, 15])
def test_a_node_count_out_of_range_is_refused_naming_the_range(count: int) -> None:
    with pytest.raises(node.NodeError, match=f"--nodes must be 1 to 14, not {count}"):
        node.plan_further_nodes(node.NodeState(octet=200), count, taken=set())


def test_a_further_node_takes_new_connections_from_the_host_alone() -> None:
    further = NamespacedNode(index=1, octet=201, host_octet=200)
    rules = node_namespaced.input_guard(further)
    assert ("-i", "eth0", "-s", "10.244.200.1", "-j", "RETURN") in rules
    assert rules[-1] == ("-j", "DROP")
