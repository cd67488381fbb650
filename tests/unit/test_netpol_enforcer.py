"""The dev cluster's NetworkPolicy enforcer (devcluster netpol_enforcer.py): the chain it plans
gives, for every source and port, the verdict of the project's evaluator (activator/reach.py), and
iptables takes it atomically and gives it all back on removal (in a network namespace of the test's
own: the host's rules are never touched here)."""

from __future__ import annotations

import ipaddress
import itertools
import shutil
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from warmpool_devcluster.netpol_enforcer import (
    Destinations,
    Rule,
    network_of,
    plan,
    restore_text,
    selecting_policies,
)
from warmpool_devcluster.node_network import NetworkError, NodeNetwork
from warmpool_operator.activator.callers import Callers
from warmpool_operator.activator.reach import Target, admits

pytestmark = pytest.mark.unit

NET = NodeNetwork(11)  # 10.244.11.0/24, the host at .1


def pod(name: str, namespace: str, ip: str, labels: dict[str, str],
        ports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"uid": f"{namespace}/{name}", "name": name, "namespace": namespace, "labels": labels},
            "spec": {"containers": [{"name": "main", "ports": ports or []}]},
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}


def netpol(namespace: str, name: str, selector: dict[str, Any], ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"uid": f"{namespace}/{name}", "name": name, "namespace": namespace},
            "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress}}


WORKER_PORTS = [{"name": "http", "containerPort": 8080}, {"name": "engine", "containerPort": 8000}]
PODS = [
    pod("worker", "team-b", "10.244.11.10", {"app.kubernetes.io/component": "worker"}, WORKER_PORTS),
    pod("client-b", "team-b", "10.244.11.11", {"app": "client"}),
    pod("client-a", "team-a", "10.244.11.12", {"app": "client"}),
    pod("operator", "ops", "10.244.11.13", {"app": "operator", "tier": "control"}),
    pod("prometheus", "monitoring", "10.244.11.14", {"app.kubernetes.io/name": "prometheus"}),
    pod("other", "monitoring", "10.244.11.15", {"app": "other"}),
    pod("open", "team-a", "10.244.11.16", {"app": "db"}, [{"name": "db", "containerPort": 5432}]),
    pod("ranged", "team-a", "10.244.11.17", {"app": "ranged"}),
]
POLICIES = [
    # The chart's worker policy, in the shape it renders.
    netpol("team-b", "workers", {"matchLabels": {"app.kubernetes.io/component": "worker"}}, [
        {"ports": [{"port": "http", "protocol": "TCP"}],
         "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                   "podSelector": {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["control"]}]}},
                  {"podSelector": {}}]},
        {"ports": [{"port": "http", "protocol": "TCP"}],
         "from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]},
    ]),
    # A range of ports, an ipBlock with an except, and a port-only rule, on another pod.
    netpol("team-a", "ranged", {"matchLabels": {"app": "ranged"}}, [
        {"ports": [{"port": 9000, "endPort": 9010}],
         "from": [{"ipBlock": {"cidr": "10.244.11.0/28", "except": ["10.244.11.8/30"]}}]},
        {"ports": [{"port": 7000, "protocol": "TCP"}]},
        {"ports": [{"port": 7001, "protocol": "UDP"}]},
    ]),
    # Selects nothing that exists.
    netpol("team-a", "nothing", {"matchLabels": {"app": "absent"}}, [{}]),
]
NAMESPACES = {"team-a": {}, "team-b": {}, "ops": {}, "monitoring": {"team": "monitoring"}}


def view(pods: list[dict[str, Any]] = PODS, policies: list[dict[str, Any]] = POLICIES) -> tuple[Destinations, Callers]:
    callers, destinations = Callers(), Destinations(NET.pod_cidr)
    for body in pods:
        callers.pod("ADDED", body)
        destinations.pod("ADDED", body)
    for name, labels in NAMESPACES.items():
        callers.namespace("ADDED", {"metadata": {"name": name,
                                                 "labels": {"kubernetes.io/metadata.name": name, **labels}}})
    callers.node("ADDED", {"metadata": {"name": "node"},
                           "status": {"addresses": [{"type": "InternalIP", "address": NET.gateway}]}})
    for body in policies:
        callers.network_policy("ADDED", body)
    return destinations, callers


def verdict(rules: list[Rule], source: str, destination: str, port: int, state: str = "NEW") -> str:
    """What the chain does to a TCP packet: the target of the first rule that matches it."""
    def matches(rule: Rule) -> bool:
        args = dict(itertools.pairwise(rule))
        for flag, value in (("-s", source), ("-d", destination)):
            if flag in rule and ipaddress.ip_address(value) not in ipaddress.ip_network(args[flag]):
                return False
        if "--dport" in rule:
            first, _, last = args["--dport"].partition(":")
            if not int(first) <= port <= int(last or first):
                return False
        if "-p" in rule and args["-p"] != "tcp":
            return False
        return "--ctstate" not in rule or state in args["--ctstate"].split(",")

    return next(rule[-1] for rule in rules if matches(rule))


def test_the_chain_gives_the_evaluators_verdict_for_every_source_and_port() -> None:
    destinations, callers = view()
    rules = plan(NET, destinations, callers)
    sources = [p["status"]["podIP"] for p in PODS] + ["10.244.11.200"]  # .200: a pod not yet seen
    ports = [1, 80, 5432, 7000, 7001, 8000, 8079, 8080, 8081, 8999, 9000, 9005, 9010, 9011, 65535]
    checked = 0
    for dest in destinations.by_ip.values():
        policies = selecting_policies(callers.policies.get(dest.namespace, {}).values(), dest.labels)
        names = {p.number: p.name for p in dest.ports}
        for source in sources:
            if source == dest.ip:
                continue  # a pod to itself never leaves its own namespace
            for port in ports:
                expected = admits(policies, Target(dest.namespace, dest.labels, port, names.get(port, "")),
                                  callers.caller(source))
                got = verdict(rules, source, dest.ip, port)
                assert got == ("RETURN" if expected else "DROP"), (source, dest.ip, port, got)
                checked += 1
    assert checked > 500


def test_what_the_charts_policy_lets_in_and_keeps_out() -> None:
    rules = plan(NET, *view())
    worker = "10.244.11.10"
    assert verdict(rules, "10.244.11.13", worker, 8080) == "RETURN"  # the operator
    assert verdict(rules, "10.244.11.11", worker, 8080) == "RETURN"  # its own namespace
    assert verdict(rules, "10.244.11.14", worker, 8080) == "RETURN"  # Prometheus
    assert verdict(rules, "10.244.11.15", worker, 8080) == "DROP"  # Prometheus' namespace, not Prometheus
    assert verdict(rules, "10.244.11.12", worker, 8080) == "DROP"  # another namespace
    assert verdict(rules, "10.244.11.11", worker, 8000) == "DROP"  # the engine's port, to anyone
    assert verdict(rules, "10.244.11.12", worker, 8080, state="ESTABLISHED") == "RETURN"  # replies
    assert verdict(rules, NET.gateway, worker, 8000) == "RETURN"  # the node itself: kubelet probes
    assert verdict(rules, "10.244.11.12", "10.244.11.16", 5432) == "RETURN"  # no policy: open
    assert verdict(rules, "10.244.11.12", "10.244.11.99", 80) == "DROP"  # no pod known there yet


def test_ip_blocks_with_excepts_and_port_ranges() -> None:
    rules = plan(NET, *view())
    ranged = "10.244.11.17"
    assert verdict(rules, "10.244.11.12", ranged, 9005) == "RETURN"  # in the block
    assert verdict(rules, "10.244.11.10", ranged, 9005) == "DROP"  # in the except
    assert verdict(rules, "10.244.11.16", ranged, 9011) == "DROP"  # past endPort
    assert verdict(rules, "10.244.11.200", ranged, 7000) == "RETURN"  # a port-only rule: anyone
    assert verdict(rules, "10.244.11.200", ranged, 7001) == "DROP"  # UDP rules admit no TCP


def test_a_change_of_labels_or_policies_changes_the_plan() -> None:
    destinations, callers = view()
    before = plan(NET, destinations, callers)
    client_a = next(p for p in PODS if p["metadata"]["name"] == "client-a")
    callers.namespace("MODIFIED", {"metadata": {"name": "team-a", "labels": {"kubernetes.io/metadata.name": "team-a",
                                                                              "team": "monitoring"}}})
    assert verdict(before, "10.244.11.12", "10.244.11.10", 8080) == "DROP"
    callers.pod("MODIFIED", {**client_a, "metadata": {**client_a["metadata"],
                                                      "labels": {"app.kubernetes.io/name": "prometheus"}}})
    assert verdict(plan(NET, destinations, callers), "10.244.11.12", "10.244.11.10", 8080) == "RETURN"
    callers.network_policy("DELETED", POLICIES[0])
    assert verdict(plan(NET, destinations, callers), "10.244.11.12", "10.244.11.10", 8000) == "RETURN"


def test_a_finished_or_deleted_pod_leaves_the_view() -> None:
    destinations = Destinations(NET.pod_cidr)
    body = PODS[0]
    destinations.pod("ADDED", body)
    assert "10.244.11.10" in destinations.by_ip
    destinations.pod("MODIFIED", {**body, "status": {**body["status"], "phase": "Succeeded"}})
    assert not destinations.by_ip
    destinations.pod("ADDED", body)
    destinations.pod("DELETED", body)
    assert not destinations.by_ip
    elsewhere = pod("kwok", "team-a", "127.0.0.1", {})
    destinations.pod("ADDED", elsewhere)  # a fake node's pod: not on this node's bridge
    assert not destinations.by_ip


def test_restore_text_replaces_the_chain_alone() -> None:
    text = restore_text("WARMPOOL-NP-11", [("-m", "comment", "--comment", "no known pod", "-j", "DROP")])
    assert text == ('*filter\n:WARMPOOL-NP-11 - [0:0]\n'
                    '-A WARMPOOL-NP-11 -m comment --comment "no known pod" -j DROP\nCOMMIT\n')


def test_a_pod_cidr_not_of_a_dev_cluster_is_refused() -> None:
    assert network_of("10.244.11.0/24") == NET
    for bad in ("10.0.0.0/8", "10.244.x.0/24", "10.244.11.0/16", "nonsense"):
        with pytest.raises(NetworkError, match=r"10\.244\.<N>\.0/24"):
            network_of(bad)


ROUND_TRIP = textwrap.dedent("""
    import subprocess
    from warmpool_devcluster import netpol_enforcer as e
    from warmpool_devcluster.node_network import NodeNetwork
    net = NodeNetwork(11)
    def forward():
        return subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout.splitlines()
    e.program(net, [("-s", "10.244.11.2/32", "-j", "RETURN"), ("-j", "DROP")])
    e.program(net, [("-m", "comment", "--comment", "no known pod", "-j", "DROP")])  # replaces, not adds
    assert e.present(net) == ["-A FORWARD -d 10.244.11.0/24 -o wpbr11 -j WARMPOOL-NP-11", "-N WARMPOOL-NP-11",
                              '-A WARMPOOL-NP-11 -m comment --comment "no known pod" -j DROP'], e.present(net)
    # Something inserted first in FORWARD later (the guard set up again): the jump goes back first.
    subprocess.run(["iptables", "-I", "FORWARD", "1", "-i", "wpbr11", "-o", "wpbr11", "-j", "ACCEPT"], check=True)
    e.program(net, [("-j", "DROP")])
    assert forward()[1].endswith("-j WARMPOOL-NP-11") and len(forward()) == 3, forward()
    e.remove(net)
    assert e.present(net) == [], e.present(net)
    assert forward() == ["-P FORWARD ACCEPT", "-A FORWARD -i wpbr11 -o wpbr11 -j ACCEPT"], forward()
    print("ROUND TRIP OK")
""")


def test_iptables_takes_the_chain_atomically_and_gives_every_rule_back() -> None:
    unshare = shutil.which("unshare")
    if unshare is None or shutil.which("iptables-restore") is None:
        pytest.skip("needs unshare and iptables (a network namespace of the test's own)")
    proc = subprocess.run([unshare, "--net", sys.executable, "-c", ROUND_TRIP], capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0 and "Operation not permitted" in proc.stderr:
        pytest.skip("no permission for a network namespace of the test's own")
    assert proc.returncode == 0 and "ROUND TRIP OK" in proc.stdout, proc.stdout + proc.stderr
