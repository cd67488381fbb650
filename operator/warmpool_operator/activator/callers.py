"""Who is calling the activator, and what the pools' namespaces' NetworkPolicies say about it.

Fed by watches (activator/app.py): pods (address -> namespace and labels; hostNetwork pods share
their node's address and say nothing about the caller, so they are left out), namespaces (their
labels, for ``namespaceSelector``), nodes (their addresses: traffic from a node is always admitted,
and so is loopback, which only the activator's own pod can send from) and NetworkPolicies (per
namespace).  A pod may call before the watch brought its address: an unknown caller waits for it,
briefly (:meth:`Callers.settle`).  Only what a decision needs is kept, not the objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Mapping
from typing import Any

from warmpool_operator.activator.reach import Caller, Target, admits


def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def _meta(body: Mapping[str, Any]) -> Mapping[str, Any]:
    return body.get("metadata") or {}


def _labels(body: Mapping[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in (_meta(body).get("labels") or {}).items()}


#: How long a request from an address no pod or node has waits for the pod watch to bring one: a
#: pod may call before the activator's watch has its address (the kubelet reports it at start).
NEW_POD_WAIT_SECONDS = 5.0


class Callers:
    """The activator's view of callers and policies (one per process; used on the event loop)."""

    def __init__(self) -> None:
        #: set (and replaced) whenever a pod's addresses arrive: callers waiting for theirs look again
        self._pods_changed = asyncio.Event()
        #: pod address -> (namespace, labels); pod uid -> its addresses (to forget them on delete)
        self.pods: dict[str, tuple[str, dict[str, str]]] = {}
        self._pod_ips: dict[str, list[str]] = {}
        self.namespace_labels: dict[str, dict[str, str]] = {}
        self._node_ips: dict[str, list[str]] = {}
        self.node_addresses: set[str] = set()
        #: namespace -> policy uid -> the policy (metadata stripped to what the evaluation reads)
        self.policies: dict[str, dict[str, Mapping[str, Any]]] = {}

    # ---------------------------------------------------------------- watch events

    def pod(self, event: str, body: Mapping[str, Any]) -> None:
        uid = str(_meta(body).get("uid") or "")
        for ip in self._pod_ips.pop(uid, []):
            self.pods.pop(ip, None)
        status, spec = body.get("status") or {}, body.get("spec") or {}
        if event == "DELETED" or spec.get("hostNetwork") or status.get("phase") in ("Succeeded", "Failed"):
            return
        ips = [str(p.get("ip")) for p in status.get("podIPs") or [] if p.get("ip")]
        if not ips and status.get("podIP"):
            ips = [str(status["podIP"])]
        entry = (str(_meta(body).get("namespace") or ""), _labels(body))
        for ip in ips:
            self.pods[ip] = entry
        self._pod_ips[uid] = ips
        if ips:
            self._pods_changed.set()
            self._pods_changed = asyncio.Event()

    def relisted_pods(self) -> None:
        self.pods.clear()
        self._pod_ips.clear()

    def namespace(self, event: str, body: Mapping[str, Any]) -> None:
        name = str(_meta(body).get("name") or "")
        if event == "DELETED":
            self.namespace_labels.pop(name, None)
        else:
            self.namespace_labels[name] = _labels(body)

    def node(self, event: str, body: Mapping[str, Any]) -> None:
        name = str(_meta(body).get("name") or "")
        self._node_ips.pop(name, None)
        if event != "DELETED":
            addresses = (body.get("status") or {}).get("addresses") or []
            self._node_ips[name] = [str(a.get("address")) for a in addresses
                                    if a.get("type") in ("InternalIP", "ExternalIP") and a.get("address")]
        self.node_addresses = {ip for ips in self._node_ips.values() for ip in ips}

    def relisted_nodes(self) -> None:
        self._node_ips.clear()
        self.node_addresses = set()

    def network_policy(self, event: str, body: Mapping[str, Any]) -> None:
        meta = _meta(body)
        namespace, uid = str(meta.get("namespace") or ""), str(meta.get("uid") or meta.get("name") or "")
        held = self.policies.setdefault(namespace, {})
        if event == "DELETED":
            held.pop(uid, None)
        else:
            held[uid] = {"spec": body.get("spec") or {}}

    def relisted_network_policies(self, namespace: str | None = None) -> None:
        """A full list of ``namespace``'s policies follows (None: every namespace's).  One watch
        runs per watched namespace: its list must not drop the other namespaces' policies (a pool
        whose namespace has none admits every caller)."""
        if namespace is None:
            self.policies.clear()
        else:
            self.policies.pop(namespace, None)

    # ---------------------------------------------------------------- decisions

    async def settle(self, ip: str, wait_s: float = NEW_POD_WAIT_SECONDS) -> None:
        """Return once ``ip`` is a pod or a node the watches brought, or after ``wait_s``: a pod
        that just started may call before its address reaches the activator."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while ip not in self.pods and ip not in self.node_addresses and not _loopback(ip):
            left = deadline - loop.time()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pods_changed.wait(), left)

    def caller(self, ip: str) -> Caller:
        known = self.pods.get(ip)
        if known is not None:
            namespace, labels = known
            return Caller(ip, namespace, labels, self.namespace_labels.get(namespace, {}))
        if ip in self.node_addresses or _loopback(ip):
            # A node's own traffic; loopback can come only from inside the activator's own pod.
            return Caller(ip, is_node=True)
        return Caller(ip)

    def may_reach(self, ip: str, target: Target) -> bool:
        """Whether the caller at ``ip`` could open the target pods' worker port directly."""
        return admits(self.policies.get(target.namespace, {}).values(), target, self.caller(ip))

    def namespace_of(self, ip: str) -> str | None:
        """The namespace of the pod at ``ip`` (a bare Service name is looked up there, as DNS would)."""
        known = self.pods.get(ip)
        return known[0] if known else None
