"""Which nodes a pool's pods are about to lose, from the Node objects (pure).

Kubernetes takes its time with a node that stops answering: the node lifecycle controller marks
it NotReady / Unknown after ~40 s of missed heartbeats and taints it, and the pods on it are
evicted only when the taint's ``tolerationSeconds`` (300 s by default) run out.  Until then the
Deployment counts those pods as its replicas and starts none in their place.  The operator does
not wait: a pod on a **lost** node counts as not warm at once and is replaced (rules/scaling.py).

A node whose kubelet stopped renewing its Lease is **silent** (rules/node_leases.py) and counts as
lost too, well before the controller marks it: a SIGKILLed kubelet is noticed in 15-25 s, not 50 s.
So does a node where no worker pod of ours answers its scrapes while pods on other nodes do
(**unanswering**, rules/node_answers.py): a dead machine is noticed within a scrape interval or two.

A **cordoned** node (``spec.unschedulable``: ``kubectl cordon``, the first step of ``kubectl
drain``) still runs its pods, and they still serve; they are about to be evicted, so each one's
replacement starts elsewhere first, and the pool's PDB (minAvailable = minWarm, over Ready pods,
and Ready means warm) lets an eviction through only once enough others are warm.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Taints the node lifecycle controller sets on a node that stopped answering (NoSchedule first,
#: NoExecute once it evicts): either one means the node is lost, whatever its Ready says.
LOST_TAINTS = frozenset({"node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"})


def node_lost(node: Mapping[str, Any]) -> bool:
    """The node's Ready condition is False or Unknown, or it carries an unreachable / not-ready
    taint.  A node that reports no Ready condition yet (just registered) is not lost."""
    for taint in (node.get("spec") or {}).get("taints") or []:
        if isinstance(taint, Mapping) and taint.get("key") in LOST_TAINTS:
            return True
    for condition in (node.get("status") or {}).get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition.get("status") != "True"
    return False


def node_cordoned(node: Mapping[str, Any]) -> bool:
    """``spec.unschedulable``: no new pod lands there, and a drain is (probably) under way."""
    return (node.get("spec") or {}).get("unschedulable") is True


def lost_node_failure(node: str, silent: bool = False, unanswering: bool = False) -> str:
    """What a pod on a lost node shows as its failure (status.pods, the Progressing condition);
    ``silent``: lost by its Lease alone (rules/node_leases.py), its Ready condition not changed yet;
    ``unanswering``: by its pods' scrapes alone (rules/node_answers.py)."""
    if unanswering:
        return f"node {node}: no worker pod there answers its scrapes while pods on other nodes do: " \
               "replaced on another node"
    if silent:
        return f"node {node} renews no Lease while other nodes do: replaced on another node"
    return f"node {node} is not Ready or unreachable: replaced on another node"


@dataclass(frozen=True)
class NodeHealth:
    """The nodes a pass treats as going: lost ones, and cordoned ones that are not lost."""

    lost: frozenset[str] = frozenset()
    cordoned: frozenset[str] = frozenset()
    #: the lost nodes lost by their Lease alone (their Ready condition not changed yet)
    silent: frozenset[str] = frozenset()
    #: the lost nodes lost by their pods' scrapes alone (neither Lease nor Ready says so yet)
    unanswering: frozenset[str] = frozenset()

    def pod_lost(self, node: str) -> bool:
        return bool(node) and node in self.lost

    def failure(self, node: str) -> str:
        """Why a pod on lost node ``node`` counts as not warm."""
        return lost_node_failure(node, node in self.silent, node in self.unanswering)

    def pod_leaving(self, node: str) -> bool:
        return bool(node) and node in self.cordoned


#: Every node healthy: what a pass assumes when it cannot read Nodes (no RBAC on them).
ALL_HEALTHY = NodeHealth()


@dataclass
class NodeBoard:
    """Every node's state as the Node watch last showed it (lost, cordoned, or neither).

    Only the state is kept, never the Node (its image list and status are most of its size), and
    only a change of state is news: a kubelet's status heartbeat wakes no pass."""

    lost: set[str] = field(default_factory=set)
    cordoned: set[str] = field(default_factory=set)
    #: nodes whose Lease renewals stopped (control/nodes.py's Lease watch sets it): lost as well
    silent: set[str] = field(default_factory=set)
    #: nodes where no pod of ours answers its scrapes while others do (each pass sets it): lost as well
    unanswering: set[str] = field(default_factory=set)
    #: False when Nodes may not be read (forbidden): every node is then treated as healthy
    readable: bool = True

    def update(self, event_type: str | None, node: Mapping[str, Any]) -> bool:
        """Take one watch event; True when the node's state changed."""
        name = str((node.get("metadata") or {}).get("name") or "")
        if not name:
            return False
        before = (name in self.lost, name in self.cordoned)
        gone = event_type == "DELETED"
        lost = not gone and node_lost(node)
        cordoned = not gone and not lost and node_cordoned(node)
        for names, member in ((self.lost, lost), (self.cordoned, cordoned)):
            if member:
                names.add(name)
            else:
                names.discard(name)
        return (lost, cordoned) != before

    def clear(self) -> set[str]:
        """Forget every node (the watch lists again); the names that were lost or cordoned."""
        known = self.lost | self.cordoned
        self.lost.clear()
        self.cordoned.clear()
        return known

    def health(self) -> NodeHealth:
        if not self.readable:
            return ALL_HEALTHY
        lost = self.lost | self.silent | self.unanswering
        return NodeHealth(lost=frozenset(lost), cordoned=frozenset(self.cordoned - lost),
                          silent=frozenset(self.silent - self.lost),
                          unanswering=frozenset(self.unanswering - self.lost - self.silent))
