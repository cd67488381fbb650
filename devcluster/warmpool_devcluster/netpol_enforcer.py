"""NetworkPolicy enforcement on the dev cluster's real node: ingress rules, in iptables.

The node's bridge CNI enforces no NetworkPolicy, and the implementation kind ships
(kube-network-policies) needs the nftables ``queue`` expression, which this machine's kernel lacks.
So this module enforces the policies itself, the way an iptables CNI plugin would.  It watches pods,
namespaces, nodes and NetworkPolicies, and programs one chain of this host's filter table.

Where it acts.  The node's pods sit on a Linux bridge of this host with br_netfilter on, so traffic
from pod to pod passes the host's FORWARD chain, ``-i <bridge> -o <bridge>``.  FORWARD jumps first to
``WARMPOOL-NP-<N>``, and only for packets routed out through the bridge to the node's pod CIDR.  The
guard's own chain comes after it (node_network.py).  In the chain:
- replies (ESTABLISHED, RELATED) return;
- traffic from the node itself (its bridge address, the Nodes' addresses) returns: NetworkPolicy
  never isolates a pod from its node (kubelet probes, host clients);
- a pod that no Ingress policy selects is open (return);
- a pod that one selects takes TCP only from the (source, port) pairs some rule of those policies
  admits (return), and drops everything else;
- an address in the pod CIDR that no pod is known to hold drops.  This closes the moment between a
  pod getting its address and this watch seeing it.

"Admits" is decided by the project's one evaluator of the NetworkPolicy API
(warmpool_operator/activator/reach.py, which the activator applies to its callers): ipBlock/except,
podSelector, namespaceSelector, matchExpressions, named ports and endPort.  The evaluator answers for
one caller and one port.  Here the ports are cut into ranges in which no rule changes its answer, and
the addresses likewise at every ipBlock edge.  Each range is asked once, and each known pod once by
its own address.  An address's answer as "no known pod" holds for any pod there too: the evaluator only
ever admits a pod more than that.

Not enforced:
- Egress policies (the chart ships none).
- IPv6: pods have none; the guard drops all IPv6 on the bridge.
- Protocols other than TCP to an isolated pod are dropped, even where a rule without ports would
  admit them.  The evaluator judges TCP alone, and warmpool's pods take TCP only.
- Connections opened before a change keep going (conntrack), as with most implementations.

Every change re-programs the chain in one ``iptables-restore --noflush`` (atomic for the chain),
debounced.  Stopping removes the jump and the chain.  Run it as ``python -m
warmpool_devcluster.netpol_enforcer --kubeconfig K --pod-cidr 10.244.N.0/24``; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import itertools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmpool_operator.activator.callers import Callers
from warmpool_operator.activator.reach import Caller, Target, admits, isolates_ingress, selector_matches

from warmpool.kube import KubeClient
from warmpool_devcluster.node_network import NetworkError, NodeNetwork, bridge_exists

log = logging.getLogger("warmpool.netpol")

CHAIN_PREFIX = "WARMPOOL-NP-"
#: How long a burst of watch events is let settle before the chain is programmed again.
DEBOUNCE_SECONDS = 0.2
#: How often the jump's place (first in FORWARD) is checked between changes.
RECHECK_SECONDS = 5.0
#: Printed (flushed) on stdout once the first full program is in place: a caller may wait for it.
READY_LINE = "netpol enforcer: enforcing"

Rule = tuple[str, ...]
ALL_SOURCES = "0.0.0.0/0"
FIRST_PORT, LAST_PORT = 1, 65535
ADDRESS_SPACE_END = 2**32  # one past the last IPv4 address


def chain_name(net: NodeNetwork) -> str:
    return f"{CHAIN_PREFIX}{net.octet}"


def jump_rule(net: NodeNetwork) -> Rule:
    """FORWARD's jump to the chain: packets routed out through the bridge to the pod CIDR."""
    return ("-o", net.bridge, "-d", net.pod_cidr, "-j", chain_name(net))


def network_of(pod_cidr: str) -> NodeNetwork:
    """The node network whose pod CIDR is ``pod_cidr`` (``10.244.<N>.0/24``), or a clear error."""
    try:
        octet = int(pod_cidr.split(".")[2])
    except (IndexError, ValueError):
        raise NetworkError(f"pod CIDR {pod_cidr!r} is not a dev cluster's 10.244.<N>.0/24") from None
    net = NodeNetwork(octet)
    if net.pod_cidr != pod_cidr:
        raise NetworkError(f"pod CIDR {pod_cidr!r} is not a dev cluster's 10.244.<N>.0/24")
    return net


# --------------------------------------------------------------------------- the view


@dataclass(frozen=True)
class PodPort:
    name: str
    number: int
    protocol: str


@dataclass(frozen=True)
class Destination:
    """A pod of the node as a policy target: where it is, its labels, the ports it declares."""

    ip: str
    namespace: str
    labels: Mapping[str, str]
    ports: tuple[PodPort, ...]


class Destinations:
    """The node's pods by address (fed by the pod watch, beside the evaluator's Callers)."""

    def __init__(self, pod_cidr: str) -> None:
        self.network = ipaddress.ip_network(pod_cidr)
        self.by_ip: dict[str, Destination] = {}
        self._ips: dict[str, list[str]] = {}

    def pod(self, event: str, body: Mapping[str, Any]) -> None:
        meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
        uid = str(meta.get("uid") or "")
        for ip in self._ips.pop(uid, []):
            self.by_ip.pop(ip, None)
        if event == "DELETED" or spec.get("hostNetwork") or status.get("phase") in ("Succeeded", "Failed"):
            return
        ips = [str(p.get("ip")) for p in status.get("podIPs") or [] if p.get("ip")]
        if not ips and status.get("podIP"):
            ips = [str(status["podIP"])]
        ips = [ip for ip in ips if self.on_node(ip)]
        ports = tuple(PodPort(str(p.get("name") or ""), int(p["containerPort"]), str(p.get("protocol") or "TCP"))
                      for c in spec.get("containers") or [] for p in c.get("ports") or []
                      if isinstance(p.get("containerPort"), int))
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        for ip in ips:
            self.by_ip[ip] = Destination(ip, str(meta.get("namespace") or ""), labels, ports)
        self._ips[uid] = ips

    def relisted(self) -> None:
        self.by_ip.clear()
        self._ips.clear()

    def on_node(self, ip: str) -> bool:
        try:
            return ipaddress.ip_address(ip) in self.network
        except ValueError:
            return False


# --------------------------------------------------------------------------- the plan


def _tcp(rule_port: Mapping[str, Any]) -> bool:
    return str(rule_port.get("protocol") or "TCP") == "TCP"


def _port_ranges(selecting: list[Mapping[str, Any]], dest: Destination) -> list[tuple[int, int, str]]:
    """TCP ports cut where any rule's answer may change: every numeric port and endPort of the
    selecting rules, and every port the pod declares (a named port is one of those): (first, last,
    the pod's name for the port when the range is that one declared port)."""
    cuts = {FIRST_PORT, LAST_PORT + 1}
    for port in dest.ports:
        if port.protocol == "TCP" and FIRST_PORT <= port.number <= LAST_PORT:
            cuts |= {port.number, port.number + 1}
    for policy in selecting:
        for rule in (policy.get("spec") or {}).get("ingress") or []:
            for rule_port in rule.get("ports") or []:
                number = rule_port.get("port")
                if _tcp(rule_port) and isinstance(number, int) and not isinstance(number, bool):
                    end = rule_port.get("endPort")
                    last = end if isinstance(end, int) and not isinstance(end, bool) else number
                    cuts |= {min(max(number, FIRST_PORT), LAST_PORT + 1), min(max(last + 1, FIRST_PORT), LAST_PORT + 1)}
    names = {p.number: p.name for p in dest.ports if p.protocol == "TCP" and p.name}
    edges = sorted(cuts)
    return [(lo, hi - 1, names.get(lo, "") if hi - 1 == lo else "") for lo, hi in itertools.pairwise(edges)]


def _address_ranges(selecting: list[Mapping[str, Any]]) -> list[tuple[int, int]]:
    """IPv4 address ranges cut at every edge of every ipBlock (cidr and except) of the selecting rules."""
    cuts = {0, ADDRESS_SPACE_END}
    for policy in selecting:
        for rule in (policy.get("spec") or {}).get("ingress") or []:
            for peer in rule.get("from") or []:
                block = peer.get("ipBlock") or {}
                for cidr in [block.get("cidr"), *(block.get("except") or [])] if block else []:
                    try:
                        network = ipaddress.ip_network(str(cidr), strict=False)
                    except ValueError:
                        continue
                    if network.version == 4:
                        cuts |= {int(network.network_address), int(network.broadcast_address) + 1}
    edges = sorted(cuts)
    return [(lo, hi - 1) for lo, hi in itertools.pairwise(edges)]


def _cidrs(ranges: Iterable[tuple[int, int]]) -> list[str]:
    """Adjacent ranges joined, as CIDRs."""
    joined: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if joined and joined[-1][1] + 1 == lo:
            joined[-1][1] = hi
        else:
            joined.append([lo, hi])
    return [str(n) for lo, hi in joined
            for n in ipaddress.summarize_address_range(ipaddress.IPv4Address(lo), ipaddress.IPv4Address(hi))]


def _admitted_sources(selecting: list[Mapping[str, Any]], target: Target, addresses: list[tuple[int, int]],
                      pods: Mapping[str, Caller]) -> frozenset[str]:
    """The sources (CIDRs) the policies admit to ``target``'s port: address ranges judged as
    no known pod, and each known pod outside them by its own address."""
    open_ranges = [r for r in addresses if admits(selecting, target, Caller(str(ipaddress.IPv4Address(r[0]))))]
    if len(open_ranges) == len(addresses):
        return frozenset({ALL_SOURCES})
    sources = set(_cidrs(open_ranges))
    for ip, caller in pods.items():
        value = int(ipaddress.IPv4Address(ip))
        if not any(lo <= value <= hi for lo, hi in open_ranges) and admits(selecting, target, caller):
            sources.add(f"{ip}/32")
    return frozenset(sources)


def _comment(dest: Destination) -> Rule:
    return ("-m", "comment", "--comment", f"{dest.namespace}:{dest.ip}")


def _isolated_pod_rules(dest: Destination, selecting: list[Mapping[str, Any]],
                        pods: Mapping[str, Caller]) -> list[Rule]:
    addresses = _address_ranges(selecting)
    spans: list[tuple[int, int, frozenset[str]]] = []
    for lo, hi, name in _port_ranges(selecting, dest):
        sources = _admitted_sources(selecting, Target(dest.namespace, dest.labels, lo, name), addresses, pods)
        if spans and spans[-1][2] == sources and spans[-1][1] + 1 == lo:
            spans[-1] = (spans[-1][0], hi, sources)
        else:
            spans.append((lo, hi, sources))
    rules: list[Rule] = []
    for lo, hi, sources in spans:
        dport = str(lo) if lo == hi else f"{lo}:{hi}"
        for source in sorted(sources):
            by_source = () if source == ALL_SOURCES else ("-s", source)
            rules.append(("-d", f"{dest.ip}/32", *by_source, "-p", "tcp", "--dport", dport, *_comment(dest),
                          "-j", "RETURN"))
    rules.append(("-d", f"{dest.ip}/32", *_comment(dest), "-j", "DROP"))
    return rules


def selecting_policies(policies: Iterable[Mapping[str, Any]], labels: Mapping[str, str]) -> list[Mapping[str, Any]]:
    """The Ingress policies whose podSelector picks a pod with ``labels``."""
    return [p for p in policies
            if isolates_ingress(p) and selector_matches((p.get("spec") or {}).get("podSelector"), labels)]


def plan(net: NodeNetwork, destinations: Destinations, callers: Callers) -> list[Rule]:
    """The chain's rules, in order, for the cluster as the watches see it."""
    rules: list[Rule] = [("-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN")]
    hosts = {net.gateway} | {a for a in callers.node_addresses if _ipv4(a)}
    rules += [("-s", f"{host}/32", "-j", "RETURN") for host in sorted(hosts, key=ipaddress.IPv4Address)]
    # Sources: every pod of the cluster (on a cluster of several real nodes, another node's pods
    # reach this node's through the bridges; nothing else reaches the chain: the guard drops what
    # comes in from elsewhere).
    pods = {ip: callers.caller(ip) for ip in callers.pods if ip not in hosts}
    for ip in sorted(destinations.by_ip, key=ipaddress.IPv4Address):
        dest = destinations.by_ip[ip]
        selecting = selecting_policies(callers.policies.get(dest.namespace, {}).values(), dest.labels)
        if selecting:
            rules += _isolated_pod_rules(dest, selecting, pods)
        else:
            rules.append(("-d", f"{ip}/32", *_comment(dest), "-j", "RETURN"))
    rules.append(("-m", "comment", "--comment", "no known pod", "-j", "DROP"))
    return rules


def _ipv4(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).version == 4
    except ValueError:
        return False


def restore_text(chain: str, rules: Iterable[Rule]) -> str:
    """``iptables-restore --noflush`` input that replaces the chain's rules, and nothing else."""
    lines = ["*filter", f":{chain} - [0:0]"]
    lines += [" ".join(["-A", chain, *(_quoted(arg) for arg in rule)]) for rule in rules]
    return "\n".join([*lines, "COMMIT", ""])


def _quoted(arg: str) -> str:
    return f'"{arg}"' if any(ch.isspace() for ch in arg) else arg


# --------------------------------------------------------------------------- iptables


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["iptables", "-w", "-t", "filter", *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise NetworkError(f"`iptables {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def program(net: NodeNetwork, rules: Iterable[Rule]) -> None:
    """Replace the chain's rules in one commit, and make sure FORWARD jumps to it first."""
    chain = chain_name(net)
    if _iptables("-S", chain, check=False).returncode != 0:
        _iptables("-N", chain)
    proc = subprocess.run(["iptables-restore", "-w", "5", "--noflush"], input=restore_text(chain, rules),
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise NetworkError(f"iptables-restore of {chain} failed ({proc.returncode}): {proc.stderr.strip()}")
    _jump_first(net)


def _jump_first(net: NodeNetwork) -> None:
    """FORWARD's first rule is the jump (the guard's bridge-to-bridge ACCEPT must not come before it)."""
    first = _iptables("-S", "FORWARD", "1", check=False).stdout.split()
    if first[-2:] != ["-j", chain_name(net)]:
        while _iptables("-D", "FORWARD", *jump_rule(net), check=False).returncode == 0:
            pass
        _iptables("-I", "FORWARD", "1", *jump_rule(net))


def remove(net: NodeNetwork) -> None:
    """Every rule of the enforcer gone: the jump, then the chain (nothing to do when none is there)."""
    while _iptables("-D", "FORWARD", *jump_rule(net), check=False).returncode == 0:
        pass
    _iptables("-F", chain_name(net), check=False)
    _iptables("-X", chain_name(net), check=False)


def present(net: NodeNetwork) -> list[str]:
    """What of the enforcer is on this host now (empty once removed)."""
    found = [line for line in _iptables("-S", "FORWARD").stdout.splitlines() if chain_name(net) in line]
    listed = _iptables("-S", chain_name(net), check=False)
    return found + (listed.stdout.splitlines() if listed.returncode == 0 else [])


# --------------------------------------------------------------------------- the loop

#: The collections watched, cluster-wide.
COLLECTIONS = ("/api/v1/pods", "/api/v1/namespaces", "/api/v1/nodes",
               "/apis/networking.k8s.io/v1/networkpolicies")


class Enforcer:
    """Watches the cluster and keeps the chain in step with it, until ``stopping`` is set."""

    def __init__(self, net: NodeNetwork, client: KubeClient) -> None:
        self.net = net
        self.client = client
        self.callers = Callers()
        self.destinations = Destinations(net.pod_cidr)
        self.changed = asyncio.Event()

    def _handlers(self) -> dict[str, tuple[Callable[[str, Mapping[str, Any]], None], Callable[[], None]]]:
        def pod(event: str, body: Mapping[str, Any]) -> None:
            self.callers.pod(event, body)
            self.destinations.pod(event, body)

        def relisted_pods() -> None:
            self.callers.relisted_pods()
            self.destinations.relisted()

        return {"/api/v1/pods": (pod, relisted_pods),
                "/api/v1/namespaces": (self.callers.namespace, lambda: None),
                "/api/v1/nodes": (self.callers.node, self.callers.relisted_nodes),
                "/apis/networking.k8s.io/v1/networkpolicies": (self.callers.network_policy,
                                                               self.callers.relisted_network_policies)}

    def _noting(self, handler: Callable[..., None]) -> Callable[..., None]:
        def noted(*args: Any) -> None:
            handler(*args)
            self.changed.set()
        return noted

    async def run(self, stopping: asyncio.Event, on_ready: Callable[[], None] = lambda: None) -> None:
        from warmpool_operator.io.list_watch import list_watch

        synced = [asyncio.Event() for _ in COLLECTIONS]
        handlers = self._handlers()
        watches = [asyncio.create_task(list_watch(self.client, path, None, self._noting(handlers[path][0]),
                                                  self._noting(handlers[path][1]), event))
                   for path, event in zip(COLLECTIONS, synced, strict=True)]
        try:
            await _first_of(stopping, asyncio.gather(*(e.wait() for e in synced)))
            if stopping.is_set():
                return
            self._program()
            on_ready()
            while not stopping.is_set():
                await _first_of(stopping, self.changed.wait(), at_most_s=RECHECK_SECONDS)
                if self.changed.is_set():
                    await asyncio.sleep(DEBOUNCE_SECONDS)
                    self._program()
                else:
                    _jump_first(self.net)
        finally:
            for task in watches:
                task.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
            remove(self.net)

    def _program(self) -> None:
        self.changed.clear()
        rules = plan(self.net, self.destinations, self.callers)
        program(self.net, rules)
        log.info("programmed %s: %d rules for %d pods", chain_name(self.net), len(rules),
                 len(self.destinations.by_ip))


async def _first_of(stopping: asyncio.Event, awaitable: Any, at_most_s: float | None = None) -> None:
    """Wait for ``awaitable`` or ``stopping``, whichever comes first (or ``at_most_s``)."""
    tasks = [asyncio.ensure_future(awaitable), asyncio.ensure_future(stopping.wait())]
    try:
        await asyncio.wait(tasks, timeout=at_most_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# --------------------------------------------------------------------------- the command


async def _serve(net: NodeNetwork, kubeconfig: Path, stop_with_parent: bool) -> None:
    from kubernetes_asyncio import config

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    parent = os.getppid()

    async def watch_parent() -> None:
        # Whoever started us (a test) died without stopping us: our rules must not outlive it.
        while not stopping.is_set():
            if os.getppid() != parent:
                log.warning("the parent process %d is gone: stopping", parent)
                stopping.set()
            await asyncio.sleep(1.0)

    watcher = asyncio.create_task(watch_parent()) if stop_with_parent else None
    client = KubeClient(await config.new_client_from_config(config_file=str(kubeconfig)))
    try:
        await Enforcer(net, client).run(stopping, lambda: print(READY_LINE, flush=True))
    finally:
        if watcher is not None:
            watcher.cancel()
        await client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m warmpool_devcluster.netpol_enforcer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", type=Path, help="the dev cluster's kubeconfig (not needed with --remove)")
    parser.add_argument("--pod-cidr", required=True, help="the real node's pod CIDR, 10.244.<N>.0/24")
    parser.add_argument("--remove", action="store_true", help="remove the rules a killed enforcer left, and exit")
    parser.add_argument("--stop-with-parent", action="store_true",
                        help="stop (and remove the rules) when the process that started this one ends")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        net = network_of(args.pod_cidr)
        if args.remove:
            remove(net)
            return 0
        if args.kubeconfig is None or not args.kubeconfig.is_file():
            print(f"netpol enforcer: --kubeconfig {args.kubeconfig} is not a file", file=sys.stderr)
            return 2
        if not bridge_exists(net.bridge):
            print(f"netpol enforcer: no bridge {net.bridge} for pod CIDR {args.pod_cidr}: is the cluster up?",
                  file=sys.stderr)
            return 2
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(net, args.kubeconfig, args.stop_with_parent))
    except NetworkError as error:
        print(f"netpol enforcer: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
