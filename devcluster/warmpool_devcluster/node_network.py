"""The real node's network: a bridge of the cluster's own, its CNI config, and the guard rules.

Pods live on one Linux bridge per cluster (``wpbr<N>``, subnet ``10.244.<N>.0/24``, the host at
``.1``).  The host side of the bridge is also where the API server and the kubelet listen, so pods
reach both without anything listening on the machine's other interfaces.

The guard keeps pod traffic on this machine: whatever comes from the pod subnet, or is addressed
to the pod or service ranges, is dropped if it would leave through any interface but the bridge
and loopback.  Its checks sit in mangle POSTROUTING (not filter OUTPUT: for host -> ClusterIP,
filter OUTPUT still sees the pre-DNAT output device although kube-proxy's DNAT rerouted the
packet to the bridge), plus filter FORWARD for what pods route (accepted on the bridge only, as a
host FORWARD policy of DROP, which dockerd leaves behind, would otherwise stop pod-to-pod traffic).
It also keeps pods off this machine's own services: in filter INPUT, pods get replies and reach
only what the node published to them (the API server; a dev server such as Jaeger's OTLP receiver
when started on the bridge address); and it drops all IPv6 from or to the bridge (pods have none).
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Every cluster's pods live in 10.244.<N>.0/24 with N from here; the API server insists on a
#: service range, the same on every cluster (one real node runs per machine: see node.py).
POD_SUBNET_OCTETS = range(10, 250)
SERVICE_CIDR = "10.96.0.0/16"
#: The first address of the service range: the ``kubernetes`` Service's ClusterIP.
KUBERNETES_SERVICE_IP = "10.96.0.1"
#: A further node's address on the first node's bridge is .<NODE_ADDRESS_BASE + its index> of the
#: first node's subnet (node_namespaced.py); the CNI hands out pod addresses only below it.
NODE_ADDRESS_BASE = 240
CNI_PLUGIN_DIR = Path("/usr/lib/cni")
CNI_CONFIG_NAME = "10-warmpool.conflist"


class NetworkError(RuntimeError):
    """The node network could not be set up or torn down; the message names the command."""


@dataclass(frozen=True)
class NodeNetwork:
    """One cluster's bridge and subnet."""

    octet: int

    @property
    def bridge(self) -> str:
        return f"{BRIDGE_PREFIX}{self.octet}"  # at most 15 characters, as Linux requires

    @property
    def pod_cidr(self) -> str:
        return f"10.244.{self.octet}.0/24"

    @property
    def gateway(self) -> str:
        """The host's address on the bridge: the node IP, the API server's and kubelet's address."""
        return str(next(ipaddress.ip_network(self.pod_cidr).hosts()))

    def node_address(self, index: int) -> str:
        """The address on this bridge of the cluster's further node ``index`` (1, 2, ...)."""
        if not 0 < index < 255 - NODE_ADDRESS_BASE:
            raise NetworkError(f"node index {index} is out of range 1-{254 - NODE_ADDRESS_BASE}")
        return f"10.244.{self.octet}.{NODE_ADDRESS_BASE + index}"

    @property
    def last_pod_address(self) -> str:
        return f"10.244.{self.octet}.{NODE_ADDRESS_BASE - 1}"

    @property
    def network_name(self) -> str:
        return f"warmpool-{self.octet}"

    @property
    def filter_chain(self) -> str:
        return f"WARMPOOL-FWD-{self.octet}"

    @property
    def mangle_chain(self) -> str:
        return f"WARMPOOL-OUT-{self.octet}"

    @property
    def input_chain(self) -> str:
        return f"WARMPOOL-IN-{self.octet}"


#: Every cluster's pod subnet lies in here (POD_SUBNET_OCTETS).
POD_RANGE = ipaddress.ip_network("10.244.0.0/16")
BRIDGE_PREFIX = "wpbr"


def on_a_node_bridge(ip: str) -> bool:
    """``ip`` is a pod address on a bridge `cluster up` made: in the pod range, and this machine
    routes it out through that bridge (a 10.244.x.y of some other cluster would route elsewhere)."""
    try:
        if ipaddress.ip_address(ip) not in POD_RANGE:
            return False
    except ValueError:
        return False
    proc = run(["ip", "-j", "route", "get", ip], check=False)
    try:
        device = str(json.loads(proc.stdout or "[]")[0].get("dev") or "")
    except (ValueError, IndexError, AttributeError):
        return False
    return device.startswith(BRIDGE_PREFIX) and bridge_exists(device)


def guarded_service_address(ip: str) -> bool:
    """``ip`` is in the service range and a node bridge of this machine has its guard whole, which
    drops service-range traffic that would leave by any other way (so dialling it stays here)."""
    try:
        if ipaddress.ip_address(ip) not in ipaddress.ip_network(SERVICE_CIDR):
            return False
    except ValueError:
        return False
    links = json.loads(run(["ip", "-j", "link", "show", "type", "bridge"], check=False).stdout or "[]")
    octets = [name[len(BRIDGE_PREFIX):] for name in (str(link.get("ifname", "")) for link in links)
              if name.startswith(BRIDGE_PREFIX)]
    return any(octet.isdigit() and not guard_missing(NodeNetwork(int(octet))) for octet in octets)


def host_address_on_a_node_bridge(ip: str) -> bool:
    """``ip`` is this machine's own address on a bridge `cluster up` made (where a real-node
    cluster's API server and kubelet listen)."""
    try:
        if ipaddress.ip_address(ip) not in POD_RANGE:
            return False
    except ValueError:
        return False
    proc = run(["ip", "-j", "addr", "show"], check=False)
    try:
        links = json.loads(proc.stdout or "[]")
    except ValueError:
        return False
    return any(str(link.get("ifname", "")).startswith(BRIDGE_PREFIX)
               and any(a.get("local") == ip for a in link.get("addr_info", [])) for link in links)


def run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise NetworkError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def bridge_exists(name: str) -> bool:
    return run(["ip", "link", "show", "dev", name], check=False).returncode == 0


def create_bridge(net: NodeNetwork) -> None:
    """The bridge with the host's address, made before the API server binds to that address (the
    CNI bridge plugin would make it only with the first pod, and finds it made)."""
    if not bridge_exists(net.bridge):
        run(["ip", "link", "add", "name", net.bridge, "type", "bridge"])
    addresses = run(["ip", "-j", "addr", "show", "dev", net.bridge]).stdout
    present = {a.get("local") for link in json.loads(addresses or "[]") for a in link.get("addr_info", [])}
    if net.gateway not in present:
        run(["ip", "addr", "add", f"{net.gateway}/24", "dev", net.bridge])
    run(["ip", "link", "set", net.bridge, "up"])


def delete_bridge(net: NodeNetwork) -> None:
    if bridge_exists(net.bridge):
        run(["ip", "link", "delete", net.bridge])


def write_cni_config(net: NodeNetwork, conf_dir: Path, ipam_dir: Path) -> Path:
    """Bridge + host-local IPAM (+ portmap for hostPort), leases kept under the cluster's state."""
    conf_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "cniVersion": "1.0.0",
        "name": net.network_name,
        "plugins": [
            {
                "type": "bridge",
                "bridge": net.bridge,
                "isGateway": True,
                "ipMasq": False,  # nothing is ever NATed out: pod traffic stays on this machine
                "hairpinMode": True,  # a pod reaching its own Service's ClusterIP
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": net.pod_cidr, "gateway": net.gateway,
                                 "rangeEnd": net.last_pod_address}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": False},
        ],
    }
    path = conf_dir / CNI_CONFIG_NAME
    path.write_text(json.dumps(config, indent=2))
    return path


@dataclass(frozen=True)
class GuardChain:
    """One chain of the guard: its rules, in order, and the built-in chain that jumps to it first."""

    tool: str  # iptables or ip6tables
    table: str
    chain: str
    hook: str
    rules: tuple[tuple[str, ...], ...]

    def command(self, *args: str) -> list[str]:
        return [self.tool, "-w", "-t", self.table, *args]


#: Why a pod may open a connection to a host address: the node's own needs, opened by name.
PUBLISHED_COMMENT = "warmpool: published to pods"


def _guard_chains(net: NodeNetwork) -> tuple[GuardChain, ...]:
    br = net.bridge
    return (
        GuardChain("iptables", "filter", net.filter_chain, "FORWARD", (
            ("-i", br, "-o", br, "-j", "ACCEPT"),  # pod to pod on the bridge
            ("-i", br, "!", "-o", br, "-j", "DROP"),  # a pod routed anywhere else
            ("-o", br, "!", "-i", br, "-j", "DROP"),  # anything routed in from elsewhere
            ("-s", net.pod_cidr, "-j", "DROP"),
            ("-d", net.pod_cidr, "-j", "DROP"),
        )),
        GuardChain("iptables", "mangle", net.mangle_chain, "POSTROUTING", (
            ("-o", br, "-j", "RETURN"),
            ("-o", "lo", "-j", "RETURN"),
            ("-s", net.pod_cidr, "-j", "DROP"),
            ("-d", net.pod_cidr, "-j", "DROP"),
            ("-d", SERVICE_CIDR, "-j", "DROP"),
        )),
        # What pods send to this machine itself: only replies, and connections to what the node
        # published to them (the API server's port on the bridge address, see publish_to_pods,
        # inserted before the last rule); a host service on 0.0.0.0 or on the bridge address is
        # not theirs to reach.  RETURN, not ACCEPT: the host's own INPUT rules still apply.
        GuardChain("iptables", "filter", net.input_chain, "INPUT", (
            ("-i", "lo", "-j", "RETURN"),  # the host to its own addresses (API server to kubelet)
            ("!", "-i", br, "-s", net.pod_cidr, "-j", "DROP"),  # a pod's address from elsewhere: forged
            ("!", "-i", br, "-j", "RETURN"),
            ("-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"),
            ("-j", "DROP"),
        )),
        # Pods have no IPv6 address but their link-local ones: nothing IPv6 from or to the bridge
        # is routed, and nothing IPv6 from it reaches the host.
        GuardChain("ip6tables", "filter", net.filter_chain, "FORWARD", (
            ("-i", br, "-j", "DROP"),
            ("-o", br, "-j", "DROP"),
        )),
        GuardChain("ip6tables", "filter", net.input_chain, "INPUT", (
            ("-i", br, "-j", "DROP"),
        )),
    )


def guard_up(net: NodeNetwork) -> None:
    """Install the guard (idempotent): our own chains, each jumped to first from its built-in
    chain.  Pods reach no host service until one is published to them (publish_to_pods)."""
    guard_down(net)
    for chain in _guard_chains(net):
        run(chain.command("-N", chain.chain))
        for rule in chain.rules:
            run(chain.command("-A", chain.chain, *rule))
        run(chain.command("-I", chain.hook, "1", "-j", chain.chain))


def guard_down(net: NodeNetwork) -> None:
    for chain in _guard_chains(net):
        while run(chain.command("-D", chain.hook, "-j", chain.chain), check=False).returncode == 0:
            pass
        run(chain.command("-F", chain.chain), check=False)
        run(chain.command("-X", chain.chain), check=False)


def guard_missing(net: NodeNetwork) -> list[str]:
    """The guard rules not in place right now (empty when the guard is whole)."""
    missing = []
    for chain in _guard_chains(net):
        if run(chain.command("-C", chain.hook, "-j", chain.chain), check=False).returncode != 0:
            missing.append(f"{chain.tool} {chain.table} {chain.hook} -j {chain.chain}")
        for rule in chain.rules:
            if run(chain.command("-C", chain.chain, *rule), check=False).returncode != 0:
                missing.append(f"{chain.tool} {chain.table} {chain.chain} {' '.join(rule)}")
    return missing


def guard_present(net: NodeNetwork) -> list[str]:
    """``tool table chain`` of each guard chain on the machine (none after ``guard_down``)."""
    return [f"{chain.tool} {chain.table} {chain.chain}" for chain in _guard_chains(net)
            if run(chain.command("-S", chain.chain), check=False).returncode == 0]


def _input_guard(net: NodeNetwork) -> GuardChain:
    return next(c for c in _guard_chains(net) if c.tool == "iptables" and c.hook == "INPUT")


def _published_rule(net: NodeNetwork, port: int) -> tuple[str, ...]:
    return ("-i", net.bridge, "-d", net.gateway, "-p", "tcp", "--dport", str(port),
            "-m", "comment", "--comment", PUBLISHED_COMMENT, "-j", "RETURN")


def _network_of_host_address(address: str) -> NodeNetwork | None:
    """The node network whose host address ``address`` is, None for any other address."""
    if not host_address_on_a_node_bridge(address):
        return None
    net = NodeNetwork(int(address.split(".")[2]))
    return net if net.gateway == address else None


def publish_to_pods(address: str, port: int) -> bool:
    """Let the pods on the node bridge whose host address is ``address`` open TCP connections to
    ``port`` there (a server of the host that is meant for them); False, and nothing done, when
    ``address`` is not such an address (loopback: pods cannot reach it anyway)."""
    if not 0 < port < 65536:
        raise NetworkError(f"cannot publish port {port} to pods: not a TCP port")
    net = _network_of_host_address(address)
    if net is None:
        return False
    guard, rule = _input_guard(net), _published_rule(net, port)
    if run(guard.command("-C", guard.chain, *rule), check=False).returncode != 0:
        # Before the chain's last rule, its DROP.
        run(guard.command("-I", guard.chain, str(len(guard.rules)), *rule))
    return True


def withdraw_from_pods(address: str, port: int) -> None:
    """Undo publish_to_pods (nothing to do when it published nothing)."""
    net = _network_of_host_address(address)
    if net is None:
        return
    guard, rule = _input_guard(net), _published_rule(net, port)
    while run(guard.command("-D", guard.chain, *rule), check=False).returncode == 0:
        pass
