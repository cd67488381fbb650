"""A further real node of a dev cluster, in namespaces of its own (``cluster up --nodes N``).

Node 0 runs as node.py starts it: in the host's namespaces, its pods on the bridge ``wpbr<o>``
whose host address the API server listens on.  Node ``k`` (1 .. N-1) is made the way kind makes
a node, without kind's images:

* **network**: a namespace ``wpn<p>`` (``p``, its own pod-subnet octet).  A veth pair joins it to
  node 0's bridge: the host end ``wpv<p>`` is a port of that bridge, and the node's end ``eth0``
  holds the node's address, ``10.244.<o>.<240+k>`` (node 0's CNI never hands those out).  The
  node's pods live on its own bridge ``wpbr<p>``, in ``10.244.<p>.0/24``.  The host and every other
  node route that subnet to the node's address, as kindnet routes pod CIDRs between kind's nodes.
  All the node and its pods send leaves through node 0's bridge, so node 0's guard
  (node_network.py) keeps it on this machine and lets it reach, on the host, only what was
  published to pods (the API server's port).  The node's own INPUT chain takes new connections
  from the host alone (the API server's calls to the kubelet), not from pods.
* **mounts**: a mount namespace, a slave of the host's, in which ``/var/lib/warmpool`` is the
  node's own directory: node caches are really apart.  Everything else is the host's filesystem
  (so the dev data directory of node_files.py is shared, like an NFS export).
* **cgroups**: the kubelet's ``cgroupRoot`` is ``/warmpool-node-<k>``, so its pods' cgroups never
  mix with node 0's ``/kubepods``.
* **processes**: its own containerd (its own root, a clone of node 0's at ``up``: images already
  there cost neither time nor space; later ones are loaded into each node), kubelet,
  kube-proxy (its iptables rules live in the node's namespace) and NetworkPolicy enforcer.

What differs from separate machines: one kernel (its settings, memory and CPUs are shared; each
kubelet believes it has the whole machine), one filesystem but ``/var/lib/warmpool``, and node 0
is the host itself, so its pods share a layer-2 segment with the other nodes' addresses.

Processes enter the namespaces with ``nsenter`` through a holder process (``sleep``) that owns
the mount namespace: once the last of them ends, the namespace and every mount in it are gone.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from warmpool_devcluster import netpol_enforcer, node_cleanup, node_containerd, node_kubelet, node_network
from warmpool_devcluster.node_network import NetworkError, NodeNetwork
from warmpool_devcluster.processes import alive, free_port, stop_pid

#: The node's own directory is mounted here in its mount namespace (the node agent's cache root).
NODE_CACHE_MOUNTPOINT = Path("/var/lib/warmpool")
NODE_LINK = "eth0"
HOLDER = "namespaces"
#: In start order (stopped in reverse); each process's log is ``node-<k>-<name>.log``.
PROCESSES = ("containerd", "kubelet", "kube-proxy", "netpol-enforcer")

Spawn = Callable[[str, list[str]], int]


@dataclass
class NamespacedNode:
    """One further node: what starts it and what ``down`` needs to undo it."""

    index: int
    octet: int  # its pod subnet's, 10.244.<octet>.0/24
    host_octet: int  # node 0's
    pids: dict[str, int] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    made_mountpoint: bool = False

    @property
    def name(self) -> str:
        return node_kubelet.node_name(self.index)

    @property
    def network(self) -> NodeNetwork:
        return NodeNetwork(self.octet)

    @property
    def host_network(self) -> NodeNetwork:
        return NodeNetwork(self.host_octet)

    @property
    def address(self) -> str:
        """The node's address (the kubelet's, on node 0's bridge)."""
        return self.host_network.node_address(self.index)

    @property
    def netns(self) -> str:
        return f"wpn{self.octet}"

    @property
    def host_link(self) -> str:
        return f"wpv{self.octet}"

    @property
    def cgroup_parent(self) -> str:
        return self.name

    def base(self, cluster_root: Path) -> Path:
        """Its state: containerd's socket, state and root, the kubelet's root, CNI config and leases."""
        return cluster_root / f"node-{self.index}"

    def containerd_root(self, cluster_root: Path) -> Path:
        """Its own containerd root, a clone of node 0's made at ``up`` (node_containerd.clone_root)."""
        return self.base(cluster_root) / "containerd" / "root"

    def cache_dir(self, cluster_root: Path) -> Path:
        """What the node sees as /var/lib/warmpool."""
        return self.base(cluster_root) / "var-lib-warmpool"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NamespacedNode:
        return cls(index=int(data["index"]), octet=int(data["octet"]), host_octet=int(data["host_octet"]),
                   pids={str(k): int(v) for k, v in (data.get("pids") or {}).items()},
                   ports={str(k): int(v) for k, v in (data.get("ports") or {}).items()},
                   made_mountpoint=bool(data.get("made_mountpoint")))


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    return node_network.run(argv, check=check)


def in_netns(node: NamespacedNode, argv: list[str]) -> list[str]:
    """``argv`` run in the node's network namespace (host mounts: for ip, iptables, sysctl)."""
    return ["nsenter", f"--net=/run/netns/{node.netns}", "--", *argv]


def in_node(node: NamespacedNode, argv: list[str]) -> list[str]:
    """``argv`` run in the node's network and mount namespaces (its holder's)."""
    return ["nsenter", f"--target={node.pids[HOLDER]}", "--mount", "--net", "--", *argv]


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def input_guard(node: NamespacedNode) -> list[tuple[str, ...]]:
    return [
        ("-i", "lo", "-j", "RETURN"),
        ("-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"),
        # The host: the API server's calls to the kubelet (logs, exec, port-forward).
        ("-i", NODE_LINK, "-s", node.host_network.gateway, "-j", "RETURN"),
        ("-j", "DROP"),
    ]


def input_chain(node: NamespacedNode) -> str:
    return f"WARMPOOL-NODE-IN-{node.octet}"


def create_network(node: NamespacedNode, others: list[NamespacedNode]) -> None:
    """The namespace, the veth into node 0's bridge, the node's own bridge, routes both ways, the
    node's kernel settings and its INPUT guard."""
    host = node.host_network
    if netns_exists(node.netns) or node_network.bridge_exists(node.host_link):
        raise NetworkError(f"network namespace {node.netns} or link {node.host_link} already exists: "
                           "another cluster's node? `warmpool cluster down` it first")
    _run(["ip", "netns", "add", node.netns])
    _run(["ip", "link", "add", node.host_link, "type", "veth", "peer", "name", NODE_LINK, "netns", node.netns])
    _run(["ip", "link", "set", node.host_link, "master", host.bridge, "up"])
    ip = ["ip", "-n", node.netns]
    for sysctl in ("net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
                   "net.ipv4.ip_forward=1"):
        _run(in_netns(node, ["sysctl", "-q", "-w", sysctl]))
    _run([*ip, "link", "set", "lo", "up"])
    _run([*ip, "addr", "add", f"{node.address}/24", "dev", NODE_LINK])
    _run([*ip, "link", "set", NODE_LINK, "up"])
    _run([*ip, "route", "add", "default", "via", host.gateway])
    bridge = node.network.bridge
    _run([*ip, "link", "add", "name", bridge, "type", "bridge"])
    _run([*ip, "addr", "add", f"{node.network.gateway}/24", "dev", bridge])
    _run([*ip, "link", "set", bridge, "up"])
    # Pod-to-pod traffic on the node's bridge passes its iptables (ClusterIPs, NetworkPolicies);
    # br_netfilter's switch is per network namespace.
    _run(in_netns(node, ["sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1"]))
    _run(["ip", "route", "replace", node.network.pod_cidr, "via", node.address, "dev", host.bridge])
    for other in others:
        if other.index != node.index and netns_exists(other.netns):
            _run([*ip, "route", "replace", other.network.pod_cidr, "via", other.address])
            _run(["ip", "-n", other.netns, "route", "replace", node.network.pod_cidr, "via", node.address])
    chain = input_chain(node)
    iptables = in_netns(node, ["iptables", "-w"])
    _run([*iptables, "-N", chain])
    for rule in input_guard(node):
        _run([*iptables, "-A", chain, *rule])
    _run([*iptables, "-I", "INPUT", "1", "-j", chain])


def make_cgroups(node: NamespacedNode) -> None:
    """The kubelet's cgroupRoot in every hierarchy (the kubelet refuses a root that is missing)."""
    for hierarchy in node_cleanup.cgroup_hierarchies():
        group = hierarchy / node.cgroup_parent
        group.mkdir(exist_ok=True)
        # A new cpuset v1 group has no CPUs or memory nodes until given its parent's.
        for setting in ("cpuset.cpus", "cpuset.mems"):
            if (group / setting).exists() and not (group / setting).read_text().strip():
                (group / setting).write_text((hierarchy / setting).read_text())


def start_holder(node: NamespacedNode, cluster_root: Path, spawn: Spawn,
                 wait: Callable[[str, Callable[[], bool]], None]) -> None:
    """The process that owns the node's mount namespace, with the node's own /var/lib/warmpool."""
    cache = node.cache_dir(cluster_root)
    cache.mkdir(parents=True, exist_ok=True)
    if not NODE_CACHE_MOUNTPOINT.exists():
        NODE_CACHE_MOUNTPOINT.mkdir(parents=True)
        node.made_mountpoint = True
    script = f"mount --bind {cache} {NODE_CACHE_MOUNTPOINT} && exec sleep infinity"
    node.pids[HOLDER] = spawn(f"node-{node.index}-{HOLDER}", in_netns(node, [
        "unshare", "--mount", "--propagation", "slave", "--", "sh", "-c", script]))
    wait(f"node {node.index}'s mount namespace", lambda: _holds_mount(node.pids[HOLDER]))


def _holds_mount(pid: int) -> bool:
    try:
        info = Path(f"/proc/{pid}/mountinfo").read_text()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    return comm == "sleep" and any(line.split()[4] == str(NODE_CACHE_MOUNTPOINT) for line in info.splitlines())


def start_runtime(node: NamespacedNode, cluster_root: Path, sandbox_image: str, spawn: Spawn) -> Path:
    """The node's containerd, with its own root; its state directory (for ``ctr``) is returned."""
    base = node.base(cluster_root)
    conf_dir = base / "cni" / "net.d"
    node_network.write_cni_config(node.network, conf_dir, base / "cni" / "ipam")
    config = node_containerd.write_config(base, sandbox_image, conf_dir, root=node.containerd_root(cluster_root))
    node.pids["containerd"] = spawn(f"node-{node.index}-containerd", in_node(node, node_containerd.argv(config)))
    return base


def start_agents(node: NamespacedNode, cluster_root: Path, binaries: dict[str, Path], spawn: Spawn,
                 kubeconfigs: dict[str, Path], serving_cert: str) -> None:
    """The kubelet (``kubeconfigs["kubelet"]``, its own identity) and kube-proxy."""
    base = node.base(cluster_root)
    node.ports.update({"kubelet-healthz": free_port(), "kube-proxy-metrics": free_port(),
                       "kube-proxy-healthz": free_port()})
    config = node_kubelet.write_kubelet_files(base, cluster_root / "pki", node.address, node.ports["kubelet-healthz"],
                                              node_containerd.socket_path(base), serving_cert,
                                              f"/{node.cgroup_parent}")
    root_dir = base / "kubelet" / "root"
    root_dir.mkdir(parents=True, exist_ok=True)
    node.pids["kubelet"] = spawn(f"node-{node.index}-kubelet", in_node(node, node_kubelet.kubelet_argv(
        binaries["kubelet"], config, kubeconfigs["kubelet"], root_dir, node.address, node.name)))
    node.pids["kube-proxy"] = spawn(f"node-{node.index}-kube-proxy", in_node(node, node_kubelet.kube_proxy_argv(
        binaries["kube-proxy"], kubeconfigs["kube-proxy"], node.network.pod_cidr, node.ports["kube-proxy-metrics"],
        node.ports["kube-proxy-healthz"], node.name)))


def start_policy_enforcer(node: NamespacedNode, admin_kubeconfig: Path, spawn: Spawn) -> None:
    node.pids["netpol-enforcer"] = spawn(f"node-{node.index}-netpol-enforcer", in_node(node, [
        sys.executable, "-m", "warmpool_devcluster.netpol_enforcer", "--kubeconfig", str(admin_kubeconfig),
        "--pod-cidr", node.network.pod_cidr]))


def policy_enforcer_ready(node: NamespacedNode) -> bool:
    chain = netpol_enforcer.chain_name(node.network)
    return _run(in_netns(node, ["iptables", "-w", "-S", chain]), check=False).returncode == 0


def stop(node: NamespacedNode, cluster_root: Path, log: Callable[[str], None]) -> list[str]:
    """Stop the node and remove all it made; what could not be removed is returned (and logged)."""
    base = node.base(cluster_root)
    for name in reversed(PROCESSES[1:]):
        _stop(node, name, log)
    killed = node_cleanup.kill_pod_processes(parent=node.cgroup_parent)
    if killed:
        log(f"ended {killed} pod processes of node {node.index}")
    _stop(node, "containerd", log)
    node_cleanup.kill_shims(node_containerd.socket_path(base))
    _stop(node, HOLDER, log)
    problems = [f"cgroup still there: {group}" for group in node_cleanup.remove_cgroups(parent=node.cgroup_parent)]
    with contextlib.suppress(NetworkError):
        _run(["ip", "route", "del", node.network.pod_cidr], check=False)
        if node_network.bridge_exists(node.host_link):
            _run(["ip", "link", "delete", node.host_link])
        if netns_exists(node.netns):
            _run(["ip", "netns", "delete", node.netns])
    if node.made_mountpoint:
        with contextlib.suppress(OSError):
            NODE_CACHE_MOUNTPOINT.rmdir()  # only if empty: never another's files
    problems += [f"{kind} still there: {', '.join(what)}"
                 for kind, what in leftovers(node, cluster_root).items() if what]
    if not problems:
        shutil.rmtree(base, ignore_errors=True)
    for problem in problems:
        log(problem)
    return problems


def _stop(node: NamespacedNode, name: str, log: Callable[[str], None]) -> None:
    pid = node.pids.get(name)
    if pid is not None and alive(pid):
        log(f"stopping node {node.index}'s {name} (pid {pid})")
        stop_pid(pid)


def leftovers(node: NamespacedNode, cluster_root: Path) -> dict[str, list[str]]:
    """What a stopped node left on the machine (all lists empty after a clean ``down``)."""
    socket = str(node_containerd.socket_path(node.base(cluster_root))).encode()
    shims = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and socket in _cmdline_bytes(int(p.name))]
    return {
        "processes": [str(pid) for pid in node.pids.values() if alive(pid)] + shims,
        "cgroups": [str(g) for g in node_cleanup.kubepods_cgroups(parent=node.cgroup_parent)]
        + [str(h / node.cgroup_parent) for h in node_cleanup.cgroup_hierarchies() if (h / node.cgroup_parent).exists()],
        "network": [name for name, there in ((f"netns {node.netns}", netns_exists(node.netns)),
                                             (f"link {node.host_link}", node_network.bridge_exists(node.host_link)))
                    if there],
    }


def _cmdline_bytes(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
