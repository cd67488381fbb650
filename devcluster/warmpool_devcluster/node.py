"""The dev cluster's real node: containerd + CNI + the kubelet + kube-proxy on this machine.

``cluster up --node-runtime containerd`` calls, in order: :func:`preflight` (root, the host
packages, no other real node), :func:`start_network` (before the API server binds to the
bridge's address), then once the control plane serves :func:`start_runtime`,
:func:`start_agents` and :func:`start_policy_enforcer`; ``cluster down`` calls :func:`stop`, which
removes everything they made.

One real-node cluster runs per machine: kube-proxy's iptables chains and the kubelet's
``kubepods`` cgroups of node 0 are the host's.  A cluster's further nodes (``--nodes N``) run in
namespaces of their own beside node 0 (node_namespaced.py), started by :func:`start_further_nodes`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from warmpool_devcluster import (
    certs,
    host_packages,
    images,
    netpol_enforcer,
    node_cleanup,
    node_containerd,
    node_kubelet,
    node_namespaced,
    node_network,
)
from warmpool_devcluster.processes import alive, free_port, stop_pid

#: The NetworkPolicy enforcer (netpol_enforcer.py): on a real cluster the CNI plugin of each node
#: enforces the policies, and the bridge CNI here enforces none, so the node runs this beside it.
POLICY_ENFORCER = "netpol-enforcer"
#: The node's processes, in start order (stopped in reverse).
PROCESSES = ("containerd", "kubelet", "kube-proxy", POLICY_ENFORCER)
NODE_READY_TIMEOUT_S = 120.0
POLICY_ENFORCER_READY_TIMEOUT_S = 60.0


class NodeError(RuntimeError):
    """The real node could not start; the message names the part and its log."""


@dataclass
class NodeState:
    """What ``down`` needs to undo the node, saved in the cluster's cluster.json."""

    octet: int
    pids: dict[str, int] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    #: Nodes 1 .. N-1, in namespaces of their own.
    extra: list[node_namespaced.NamespacedNode] = field(default_factory=list)

    @property
    def network(self) -> node_network.NodeNetwork:
        return node_network.NodeNetwork(self.octet)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeState:
        return cls(octet=int(data["octet"]),
                   pids={str(k): int(v) for k, v in (data.get("pids") or {}).items()},
                   ports={str(k): int(v) for k, v in (data.get("ports") or {}).items()},
                   extra=[node_namespaced.NamespacedNode.from_json(n) for n in data.get("extra") or []])

    @property
    def octets(self) -> set[int]:
        """The pod-subnet octets of every node of the cluster."""
        return {self.octet, *(n.octet for n in self.extra)}


def node_dir(cluster_root: Path) -> Path:
    """The node's state: containerd's socket and state, the kubelet's root, CNI config and leases."""
    return cluster_root / "node"


def runtime_dirs(cluster_root: Path) -> list[Path]:
    """Each real node's state directory (its containerd's socket), node 0's first: what ``ctr``
    and images.load are pointed at."""
    further = sorted(cluster_root.glob("node-[0-9]*"), key=lambda p: int(p.name.split("-", 1)[1]))
    return [node_dir(cluster_root), *further]


def kubelet_root(cluster_root: Path) -> Path:
    return node_dir(cluster_root) / "kubelet" / "root"


def sysctl_record(cluster_root: Path) -> Path:
    """The host's settings as they were before the node changed any (node_cleanup.SYSCTLS)."""
    return node_dir(cluster_root) / "host-sysctls.json"


def preflight(other_real_nodes: list[str]) -> None:
    if os.geteuid() != 0:
        raise NodeError("a real node needs root (containerd, network namespaces, iptables, cgroups); "
                        "run as root, or start the cluster without --node-runtime")
    missing = host_packages.missing()
    if missing:
        raise NodeError(f"the real node needs Debian packages that are missing: {' '.join(missing)}; "
                        "install them with `make host-packages` (apt-get, as root)")
    if other_real_nodes:
        raise NodeError(f"cluster {other_real_nodes[0]!r} already runs a real node on this machine (one at a "
                        "time: kube-proxy's iptables chains and the kubepods cgroups are the host's); "
                        f"stop it with `warmpool cluster down --name {other_real_nodes[0]}`")


def choose_octet(taken: set[int]) -> int:
    """The first 10.244.N.0/24 no other cluster records and no bridge or node namespace on the
    machine uses."""
    for octet in node_network.POD_SUBNET_OCTETS:
        if (octet not in taken and not node_network.bridge_exists(node_network.NodeNetwork(octet).bridge)
                and not node_namespaced.netns_exists(f"wpn{octet}")):
            return octet
    raise NodeError("every pod subnet 10.244.10-249.0/24 is in use")


def start_network(state: NodeState, cluster_root: Path) -> None:
    """Bridge, guard rules, CNI config; first saves (on disk, so a ``down`` after a crash finds
    them) the host settings the node and its kubelet will change."""
    node_cleanup.record_sysctls(sysctl_record(cluster_root))
    net = state.network
    node_network.create_bridge(net)
    node_network.guard_up(net)
    # Bridged pod-to-pod traffic must pass iptables, or a ClusterIP DNATed to a pod on the same
    # bridge never reaches it.
    node_cleanup.set_sysctl("net.bridge.bridge-nf-call-iptables", "1")
    base = node_dir(cluster_root)
    node_network.write_cni_config(net, base / "cni" / "net.d", base / "cni" / "ipam")
    for further in state.extra:
        node_namespaced.create_network(further, state.extra)
        node_namespaced.make_cgroups(further)
        # The images node 0 holds, before its containerd starts (a clone of a root in use could
        # catch its databases half written).
        node_containerd.clone_root(node_containerd.containerd_root(), further.containerd_root(cluster_root))


def plan_further_nodes(state: NodeState, nodes: int, taken: set[int]) -> None:
    """Nodes 1 .. ``nodes``-1, each with a pod subnet of its own (before :func:`start_network`)."""
    max_nodes = 255 - node_network.NODE_ADDRESS_BASE
    if not 1 <= nodes < max_nodes:
        raise NodeError(f"--nodes must be 1 to {max_nodes - 1}, not {nodes}")
    for index in range(1, nodes):
        octet = choose_octet(taken | state.octets)
        state.extra.append(node_namespaced.NamespacedNode(index=index, octet=octet, host_octet=state.octet))


Spawn = Callable[[str, list[str]], int]


def publish_apiserver(state: NodeState, port: int) -> None:
    """Open the API server's port on the bridge address to the pods (through the ``kubernetes``
    Service): the one host service every node's pods need."""
    node_network.publish_to_pods(state.network.gateway, port)


def start_runtime(state: NodeState, cluster_root: Path, spawn: Spawn) -> None:
    """containerd of the cluster's own, with the pause image in it."""
    base = node_dir(cluster_root)
    config = node_containerd.write_config(base, images.pause_tag(), base / "cni" / "net.d")
    state.pids["containerd"] = spawn("containerd", node_containerd.argv(config))
    _wait("containerd", lambda: node_containerd.answers(base), state, cluster_root, 60)
    images.load_pause(base)


def write_node_kubeconfigs(cluster_root: Path, server: str, write: Callable[[Path, str, str], None]) -> None:
    """The kubelet's (system:node:<name>) and kube-proxy's kubeconfigs, from ``write(path, server, stem)``."""
    write(node_dir(cluster_root) / "kubelet.kubeconfig", server, certs.KUBELET_CLIENT)
    write(node_dir(cluster_root) / "kube-proxy.kubeconfig", server, certs.KUBE_PROXY_CLIENT)


def issue_further_node_pki(state: NodeState, pki: Path, cluster_root: Path, server: str,
                           write: Callable[[Path, str, str], None]) -> None:
    """Each further node's kubelet identity (``system:node:<its name>``) and kubeconfig."""
    for further in state.extra:
        client, _ = certs.issue_kubelet_pki(pki, further.name, further.address, f"-{further.index}")
        further.base(cluster_root).mkdir(parents=True, exist_ok=True)
        write(further.base(cluster_root) / "kubelet.kubeconfig", server, client)


def start_agents(state: NodeState, cluster_root: Path, binaries: dict[str, Path], spawn: Spawn) -> None:
    """The kubelet and kube-proxy (their kubeconfigs written by :func:`write_node_kubeconfigs`)."""
    base = node_dir(cluster_root)
    net = state.network
    state.ports.update({"kubelet-healthz": free_port(), "kube-proxy-metrics": free_port(),
                        "kube-proxy-healthz": free_port()})
    config = node_kubelet.write_kubelet_files(base, cluster_root / "pki", net.gateway, state.ports["kubelet-healthz"],
                                              node_containerd.socket_path(base))
    kubelet_root(cluster_root).mkdir(parents=True, exist_ok=True)
    state.pids["kubelet"] = spawn("kubelet", node_kubelet.kubelet_argv(
        binaries["kubelet"], config, base / "kubelet.kubeconfig", kubelet_root(cluster_root), net.gateway))
    state.pids["kube-proxy"] = spawn("kube-proxy", node_kubelet.kube_proxy_argv(
        binaries["kube-proxy"], base / "kube-proxy.kubeconfig", net.pod_cidr, state.ports["kube-proxy-metrics"],
        state.ports["kube-proxy-healthz"]))


def start_policy_enforcer(state: NodeState, cluster_root: Path, admin_kubeconfig: Path, spawn: Spawn) -> None:
    """The NetworkPolicy enforcer, watching the whole cluster with the admin's credentials; returns
    once its chain is programmed, so every pod started after ``up`` meets the policies."""
    state.pids[POLICY_ENFORCER] = spawn(POLICY_ENFORCER, [
        sys.executable, "-m", "warmpool_devcluster.netpol_enforcer", "--kubeconfig", str(admin_kubeconfig),
        "--pod-cidr", state.network.pod_cidr])
    _wait("the NetworkPolicy enforcer's first rules", lambda: bool(netpol_enforcer.present(state.network)),
          state, cluster_root, POLICY_ENFORCER_READY_TIMEOUT_S)


def stop_policy_enforcer(state: NodeState, log: Callable[[str], None]) -> None:
    """Stop the enforcer (SIGTERM: it removes its rules), then remove any rule a killed one left."""
    pid = state.pids.pop(POLICY_ENFORCER, None)
    if pid is not None and alive(pid):
        log(f"stopping {POLICY_ENFORCER} (pid {pid})")
        stop_pid(pid)
    netpol_enforcer.remove(state.network)


def wait_ready(state: NodeState, cluster_root: Path, node_ready: Callable[[], bool]) -> None:
    _wait(f"node {node_kubelet.NODE_NAME} Ready", node_ready, state, cluster_root, NODE_READY_TIMEOUT_S)


def start_further_nodes(state: NodeState, cluster_root: Path, binaries: dict[str, Path], spawn: Spawn,
                        admin_kubeconfig: Path, node_ready: Callable[[str], bool],
                        save: Callable[[], None]) -> None:
    """Nodes 1 .. N-1 (their network made by :func:`start_network`, their certificates and
    kubeconfigs by :func:`write_node_kubeconfigs`): each started, then all waited for Ready."""
    for further in state.extra:
        prefix = f"node-{further.index}-"

        def wait(what: str, check: Callable[[], bool], timeout: float = 60, further: Any = further,
                 prefix: str = prefix) -> None:
            _wait(what, check, further, cluster_root, timeout, prefix)

        node_namespaced.start_holder(further, cluster_root, spawn, wait)
        save()
        base = node_namespaced.start_runtime(further, cluster_root, images.pause_tag(), spawn)
        save()
        wait(f"node {further.index}'s containerd", functools.partial(node_containerd.answers, base))
        images.load_pause(base)
        node_namespaced.start_agents(further, cluster_root, binaries, spawn, {
            "kubelet": base / "kubelet.kubeconfig", "kube-proxy": node_dir(cluster_root) / "kube-proxy.kubeconfig"},
            f"{certs.KUBELET_SERVING}-{further.index}")
        save()
    for further in state.extra:
        _wait(f"node {further.name} Ready", functools.partial(node_ready, further.name), further, cluster_root,
              NODE_READY_TIMEOUT_S, f"node-{further.index}-")
        node_namespaced.start_policy_enforcer(further, admin_kubeconfig, spawn)
        save()
        _wait(f"node {further.index}'s NetworkPolicy enforcer",
              functools.partial(node_namespaced.policy_enforcer_ready, further), further, cluster_root,
              POLICY_ENFORCER_READY_TIMEOUT_S, f"node-{further.index}-")


def _wait(what: str, check: Callable[[], bool], state: NodeState | node_namespaced.NamespacedNode,
          cluster_root: Path, timeout: float, log_prefix: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        for name, pid in state.pids.items():
            if not alive(pid):
                log = cluster_root / "logs" / f"{log_prefix}{name}.log"
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
                raise NodeError(f"{name} exited while waiting for {what}; log {log}:\n{tail}")
        time.sleep(0.25)
    raise NodeError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {cluster_root / 'logs'}")


def stop(state: NodeState, cluster_root: Path, kube_proxy: Path | None, log: Callable[[str], None]) -> list[str]:
    """Stop the node (its further nodes first) and remove what it made; what could not be removed
    is returned (and logged)."""
    problems = [p for further in reversed(state.extra) for p in node_namespaced.stop(further, cluster_root, log)]
    base = node_dir(cluster_root)
    stop_policy_enforcer(state, log)
    for name in ("kube-proxy", "kubelet"):
        pid = state.pids.get(name)
        if pid is not None and alive(pid):
            log(f"stopping {name} (pid {pid})")
            stop_pid(pid)
    if kube_proxy is not None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run(node_kubelet.kube_proxy_cleanup_argv(kube_proxy), capture_output=True, timeout=120)
    killed = node_cleanup.kill_pod_processes()
    if killed:
        log(f"ended {killed} pod processes")
    pid = state.pids.get("containerd")
    if pid is not None and alive(pid):
        log(f"stopping containerd (pid {pid})")
        stop_pid(pid)
    node_cleanup.kill_shims(node_containerd.socket_path(base))
    problems += [f"still mounted: {point}" for point in node_cleanup.unmount_under([base])]
    problems += [f"cgroup still there: {group}" for group in node_cleanup.remove_cgroups()]
    node_cleanup.remove_kubelet_chains()
    net = state.network
    node_network.guard_down(net)
    with contextlib.suppress(node_network.NetworkError):
        node_network.delete_bridge(net)
    if node_network.bridge_exists(net.bridge):
        problems.append(f"bridge {net.bridge} still there")
    problems += node_cleanup.restore_sysctls(sysctl_record(cluster_root))
    if not problems:
        # containerd's state and the kubelet's root hold nothing worth keeping once unmounted;
        # leftovers would confuse the next start (stale sandboxes, IPAM leases).
        shutil.rmtree(base, ignore_errors=True)
    for problem in problems:
        log(problem)
    return problems


def leftovers(state: NodeState, cluster_root: Path) -> dict[str, list[str]]:
    """What a stopped node left on the machine (all lists empty after a clean ``down``)."""
    base = node_dir(cluster_root)
    shims = [p.name for p in Path("/proc").iterdir() if p.name.isdigit()
             and str(node_containerd.socket_path(base)).encode() in _cmdline_bytes(int(p.name))]
    further = [node_namespaced.leftovers(n, cluster_root) for n in state.extra]
    return {
        "processes": [str(pid) for pid in state.pids.values() if alive(pid)] + shims
        + [p for left in further for p in left["processes"]],
        "network": [p for left in further for p in left["network"]],
        "mounts": node_cleanup.mounts_under([base]),
        "cgroups": [str(g) for g in node_cleanup.kubepods_cgroups()] + [p for left in further for p in left["cgroups"]],
        "bridge": [state.network.bridge] if node_network.bridge_exists(state.network.bridge) else [],
        "iptables": (node_cleanup.leftover_kube_chains() + node_network.guard_present(state.network)
                     + netpol_enforcer.present(state.network)),
        # a record left means some of the host's settings were not restored
        "sysctls": [str(sysctl_record(cluster_root))] if sysctl_record(cluster_root).exists() else [],
    }


def _cmdline_bytes(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
