"""What the real node's kube-proxy does with a ClusterIP right now, read from its iptables rules
(iptables mode: the chains are the host's, see devcluster node.py).  A test that changed a
Service's endpoints polls this until kube-proxy has applied the change, instead of sleeping."""

from __future__ import annotations

import re
import shutil
import subprocess


def _nat_rules() -> list[str]:
    tool = shutil.which("iptables-save")
    if tool is None:
        raise FileNotFoundError("iptables-save is not installed: kube-proxy's rules cannot be read")
    saved = subprocess.run([tool, "-t", "nat"], capture_output=True, text=True, check=True, timeout=30)
    return saved.stdout.splitlines()


def _jumps(rules: list[str], chains: set[str], prefix: str) -> set[str]:
    """The chains named ``prefix...`` that a rule of one of ``chains`` jumps to."""
    found = set()
    for rule in rules:
        parts = rule.split()
        if len(parts) > 1 and parts[0] == "-A" and parts[1] in chains:
            match = re.search(rf"-j ({re.escape(prefix)}\S+)", rule)
            if match:
                found.add(match.group(1))
    return found


def cluster_ip_destinations(cluster_ip: str, port: int) -> set[str]:
    """The pod IPs kube-proxy sends a new connection to ``cluster_ip:port`` to now (empty: none)."""
    rules = _nat_rules()
    service_chains = {match.group(1) for rule in rules
                      if rule.startswith("-A KUBE-SERVICES ") and f"-d {cluster_ip}/32 " in rule
                      and f"--dport {port} " in rule and (match := re.search(r"-j (KUBE-SVC-\S+)", rule))}
    endpoints = _jumps(rules, service_chains, "KUBE-SEP-")
    destinations = set()
    for rule in rules:
        parts = rule.split()
        if len(parts) > 1 and parts[0] == "-A" and parts[1] in endpoints:
            match = re.search(r"--to-destination (\S+):\d+", rule)
            if match:
                destinations.add(match.group(1))
    return destinations
