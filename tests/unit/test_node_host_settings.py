"""The real node's record of the host's kernel settings: written before the node changes any,
never overwritten by a later `up` (after a crash the machine holds the node's values, not the
host's), removed only once every value is back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from warmpool_devcluster import node, node_cleanup, node_network

pytestmark = pytest.mark.unit


def test_the_record_holds_every_setting_the_kubelet_and_the_node_change(tmp_path: Path) -> None:
    record = node.sysctl_record(tmp_path)
    values = node_cleanup.record_sysctls(record)
    assert json.loads(record.read_text()) == values == node_cleanup.read_sysctls()
    # The kubelet's six kernel tunables, IP forwarding (CNI bridge), bridged traffic through iptables.
    assert {"vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
            "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes", "net.ipv4.ip_forward"} <= set(values)


def test_a_record_left_by_a_crashed_node_is_kept_not_overwritten(tmp_path: Path) -> None:
    record = node.sysctl_record(tmp_path)
    record.parent.mkdir(parents=True)
    before_the_crash = {"kernel.panic": "0", "vm.overcommit_memory": "2"}
    record.write_text(json.dumps(before_the_crash))
    assert node_cleanup.record_sysctls(record) == before_the_crash
    assert json.loads(record.read_text()) == before_the_crash


def test_an_unreadable_record_is_named_and_kept(tmp_path: Path) -> None:
    record = tmp_path / "host-sysctls.json"
    record.write_text("{not json")
    problems = node_cleanup.restore_sysctls(record)
    assert len(problems) == 1 and str(record) in problems[0]
    assert record.exists()
    record.write_text(json.dumps({"kernel.panic": 10}))
    assert "not a map of names to values" in node_cleanup.restore_sysctls(record)[0]


def test_restoring_values_already_there_removes_the_record(tmp_path: Path) -> None:
    record = tmp_path / "host-sysctls.json"
    node_cleanup.record_sysctls(record)
    assert node_cleanup.restore_sysctls(record) == []
    assert not record.exists()
    assert node_cleanup.restore_sysctls(record) == []  # nothing recorded: nothing to do


def test_publishing_to_pods_a_port_on_an_address_pods_cannot_reach_does_nothing() -> None:
    assert node_network.publish_to_pods("127.0.0.1", 4318) is False
    node_network.withdraw_from_pods("127.0.0.1", 4318)
    with pytest.raises(node_network.NetworkError, match=r"port 0 .* not a TCP port"):
        node_network.publish_to_pods("127.0.0.1", 0)
