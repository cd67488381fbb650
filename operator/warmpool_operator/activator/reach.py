"""Whether a caller could reach a pool's pods directly: Kubernetes NetworkPolicy ingress rules,
evaluated for one connection.

The activator is shared by every pool, so the cluster's NetworkPolicies (which select the pool's
pods, not the activator) cannot stop a client of one team from asking it for another team's pool.
It therefore applies those same policies itself, to the caller it sees, before it holds or forwards
anything (activator/proxy.py): a request goes through only if its sender could have opened the
pool's worker port directly.

The semantics are the API's (``networking.k8s.io/v1``):
- a pod no Ingress policy selects admits every caller;
- a selected pod admits a caller if any rule of any selecting policy admits it: the rule's ports
  (none: every port) include the worker port, and its peers (none: everyone) include the caller;
- a peer is an ``ipBlock`` (the caller's address in ``cidr``, outside every ``except``), or pods by
  ``podSelector`` in the policy's namespace, or in the namespaces ``namespaceSelector`` picks;
- traffic from a node is always admitted (NetworkPolicy never isolates a pod from its node; the
  kubelet's probes and host clients come from there).
A selector operator this module does not know matches nothing: an unknown rule never opens a door.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Labels = Mapping[str, str]


@dataclass(frozen=True)
class Caller:
    """Who opened the connection: its address and, when it is a pod the activator knows, where it runs."""

    ip: str
    namespace: str | None = None
    labels: Labels | None = None
    namespace_labels: Labels | None = None
    is_node: bool = False


@dataclass(frozen=True)
class Target:
    """The pool's pods as a NetworkPolicy sees them: namespace, labels and the worker port."""

    namespace: str
    labels: Labels
    port: int
    port_name: str


def selector_matches(selector: Mapping[str, Any] | None, labels: Labels) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against labels; ``{}`` matches everything."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression.get("key"), expression.get("operator")
        values = set(expression.get("values") or [])
        if operator == "In":
            ok = key in labels and labels[key] in values
        elif operator == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif operator == "Exists":
            ok = key in labels
        elif operator == "DoesNotExist":
            ok = key not in labels
        else:
            return False
        if not ok:
            return False
    return True


def _in_block(ip: str, block: Mapping[str, Any]) -> bool:
    try:
        address = ipaddress.ip_address(ip)
        network = ipaddress.ip_network(str(block.get("cidr")), strict=False)
        if address not in network:
            return False
        return not any(address in ipaddress.ip_network(str(x), strict=False) for x in block.get("except") or [])
    except ValueError:
        return False


def _peer_admits(peer: Mapping[str, Any], policy_namespace: str, caller: Caller) -> bool:
    if "ipBlock" in peer:
        return _in_block(caller.ip, peer.get("ipBlock") or {})
    if caller.namespace is None or caller.labels is None:
        return False  # not a pod we know: only an ipBlock can name it
    pods, namespaces = peer.get("podSelector"), peer.get("namespaceSelector")
    if namespaces is None:
        in_namespace = caller.namespace == policy_namespace
    else:
        in_namespace = selector_matches(namespaces, caller.namespace_labels or {})
    return in_namespace and (pods is None or selector_matches(pods, caller.labels))


def _port_admits(rule_port: Mapping[str, Any], target: Target) -> bool:
    if str(rule_port.get("protocol") or "TCP") != "TCP":
        return False
    port = rule_port.get("port")
    if port is None:
        return True
    if isinstance(port, str):
        return port == target.port_name
    end = rule_port.get("endPort")
    return int(port) <= target.port <= (int(end) if end is not None else int(port))


def _rule_admits(rule: Mapping[str, Any], policy_namespace: str, target: Target, caller: Caller) -> bool:
    ports = rule.get("ports") or []
    if ports and not any(_port_admits(p, target) for p in ports):
        return False
    peers = rule.get("from") or []
    return not peers or any(_peer_admits(p, policy_namespace, caller) for p in peers)


def isolates_ingress(policy: Mapping[str, Any]) -> bool:
    spec = policy.get("spec") or {}
    types = spec.get("policyTypes")
    return True if types is None else "Ingress" in types


def admits(policies: Iterable[Mapping[str, Any]], target: Target, caller: Caller) -> bool:
    """Whether ``caller`` may open ``target``'s worker port, under the policies of its namespace."""
    if caller.is_node:
        return True
    selecting = [p for p in policies
                 if isolates_ingress(p) and selector_matches((p.get("spec") or {}).get("podSelector"), target.labels)]
    if not selecting:
        return True
    return any(_rule_admits(rule, target.namespace, target, caller)
               for policy in selecting for rule in (policy.get("spec") or {}).get("ingress") or [])
