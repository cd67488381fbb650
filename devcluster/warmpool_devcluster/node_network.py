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

    @property
    def network_name(self) -> str:
        return f"warmpool-{self.octet}"

    @property
    def filter_chain(self) -> str:
        return f"WARMPOOL-FWD-{self.octet}"

    @property
    def mangle_chain(self) -> str:
        return f"WARMPOOL-OUT-{self.octet}"


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
                    "ranges": [[{"subnet": net.pod_cidr, "gateway": net.gateway}]],
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


def _guard_rules(net: NodeNetwork) -> dict[tuple[str, str], list[list[str]]]:
    """(table, chain) -> the rules in it, in order."""
    br = net.bridge
    return {
        ("filter", net.filter_chain): [
            ["-i", br, "-o", br, "-j", "ACCEPT"],  # pod to pod on the bridge
            ["-i", br, "!", "-o", br, "-j", "DROP"],  # a pod routed anywhere else
            ["-o", br, "!", "-i", br, "-j", "DROP"],  # anything routed in from elsewhere
            ["-s", net.pod_cidr, "-j", "DROP"],
            ["-d", net.pod_cidr, "-j", "DROP"],
        ],
        ("mangle", net.mangle_chain): [
            ["-o", br, "-j", "RETURN"],
            ["-o", "lo", "-j", "RETURN"],
            ["-s", net.pod_cidr, "-j", "DROP"],
            ["-d", net.pod_cidr, "-j", "DROP"],
            ["-d", SERVICE_CIDR, "-j", "DROP"],
        ],
    }


#: Where each guard chain is jumped to from.
_HOOKS = {"filter": "FORWARD", "mangle": "POSTROUTING"}


def guard_up(net: NodeNetwork) -> None:
    """Install the guard (idempotent): our own chains, jumped to first from FORWARD/POSTROUTING."""
    guard_down(net)
    for (table, chain), rules in _guard_rules(net).items():
        run(["iptables", "-w", "-t", table, "-N", chain])
        for rule in rules:
            run(["iptables", "-w", "-t", table, "-A", chain, *rule])
        run(["iptables", "-w", "-t", table, "-I", _HOOKS[table], "1", "-j", chain])


def guard_down(net: NodeNetwork) -> None:
    for table, chain in _guard_rules(net):
        while run(["iptables", "-w", "-t", table, "-D", _HOOKS[table], "-j", chain], check=False).returncode == 0:
            pass
        run(["iptables", "-w", "-t", table, "-F", chain], check=False)
        run(["iptables", "-w", "-t", table, "-X", chain], check=False)


def guard_missing(net: NodeNetwork) -> list[str]:
    """The guard rules not in place right now (empty when the guard is whole)."""
    missing = []
    for (table, chain), rules in _guard_rules(net).items():
        if run(["iptables", "-w", "-t", table, "-C", _HOOKS[table], "-j", chain], check=False).returncode != 0:
            missing.append(f"{table} {_HOOKS[table]} -j {chain}")
        for rule in rules:
            if run(["iptables", "-w", "-t", table, "-C", chain, *rule], check=False).returncode != 0:
                missing.append(f"{table} {chain} {' '.join(rule)}")
    return missing
