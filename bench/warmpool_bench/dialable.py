"""What the benchmarks may dial: loopback, and pods on the local cluster's real node (their bridge
`cluster up` made, behind the guard that keeps pod traffic on this machine).  Nothing else."""

from __future__ import annotations

import functools
import ipaddress

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


class NotDialable(RuntimeError):
    """An address neither on loopback nor a pod on the local cluster's node was about to be dialled."""


@functools.lru_cache(maxsize=4096)
def _pod_on_the_local_node(ip: str) -> bool:
    from warmpool_devcluster.node_network import on_a_node_bridge

    return on_a_node_bridge(ip)


def check_dialable(ip: str) -> str:
    """``ip`` itself if the bench may dial it: loopback, or a pod on the local cluster's node bridge."""
    try:
        if ipaddress.ip_address(ip) in LOOPBACK or _pod_on_the_local_node(ip):
            return ip
    except ValueError:
        pass
    raise NotDialable(f"refusing to dial {ip}: the live replay talks to loopback and the local node's pods only")
