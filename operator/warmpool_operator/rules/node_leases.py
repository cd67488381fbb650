"""Which nodes have stopped renewing their Lease, sooner than their Ready condition says so (pure).

A kubelet renews its node's Lease in ``kube-node-lease`` every 10 s (a quarter of the Lease's 40 s).
The node lifecycle controller marks a node whose renewals stopped NotReady only after
``--node-monitor-grace-period`` (50 s by default), and later taints it.  The operator notices
sooner: a node whose renewal it has not seen for ``grace_s`` is **silent**, and a silent node is
treated as lost (rules/node_health.py): its pods count as not warm and are replaced elsewhere.

The operator judges by when *it* saw each renewal, never by the kubelets' ``renewTime`` against its
own clock (their clocks may differ), and its "now" is the latest renewal it saw of any node: only
another node's renewal, ``grace_s`` after this one's last, makes this one silent.  So a watch of its
own that stalls, or an event loop of its own held up, never makes a node silent (no renewal arrives,
so its clock stands still), a one-node cluster is never judged this way, and neither is a cluster
whose nodes all went quiet at once: those are left to the Ready condition.  With two nodes renewing
every 10 s, a dead one is silent 15-35 s after its kubelet died (the default grace, 25 s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: A kubelet renews its Lease every this many seconds (a quarter of the kubelet's 40 s nodeLeaseDurationSeconds).
KUBELET_RENEW_INTERVAL_S = 10.0
#: Two missed renewals and 5 s of slack for a slow API server or a late kubelet.
DEFAULT_GRACE_S = 25.0
#: Shorter than this, one late renewal would make a healthy node silent.
MIN_GRACE_S = 1.5 * KUBELET_RENEW_INTERVAL_S


@dataclass
class NodeLeases:
    """Each node's Lease as the operator last saw it renewed, and which nodes are silent now."""

    #: node -> the renewTime last seen (a change of it is a renewal)
    renewed: dict[str, str] = field(default_factory=dict)
    #: node -> when (the operator's monotonic clock) it last saw a renewal, or first saw the Lease
    seen_at: dict[str, float] = field(default_factory=dict)
    silent: set[str] = field(default_factory=set)
    #: The view before a relist: a Lease listed again with the same renewTime was not renewed.
    _before: tuple[dict[str, str], dict[str, float]] = field(default_factory=lambda: ({}, {}))

    def update(self, event_type: str | None, lease: Mapping[str, Any], now: float) -> None:
        """Take one watch event for a Lease in kube-node-lease (named after its node)."""
        name = str((lease.get("metadata") or {}).get("name") or "")
        if not name:
            return
        if event_type == "DELETED":
            self.renewed.pop(name, None)
            self.seen_at.pop(name, None)
            return
        renew = str((lease.get("spec") or {}).get("renewTime") or "")
        before_renewed, before_seen = self._before
        if name not in self.renewed and before_renewed.get(name) == renew and name in before_seen:
            self.seen_at[name] = before_seen[name]  # listed again, not renewed since
        elif self.renewed.get(name) != renew:
            self.seen_at[name] = now
        self.renewed[name] = renew

    def relist(self) -> None:
        """The watch lists again: what the list brings back is the view (a Lease gone meanwhile
        is forgotten), and each listed one keeps when it was last seen renewed."""
        self._before = (self.renewed, self.seen_at)
        self.renewed, self.seen_at = {}, {}

    def judge(self, grace_s: float) -> set[str]:
        """Which nodes are silent now (see the module docstring: "now" is the latest renewal seen);
        returns the names whose silence changed."""
        latest = max(self.seen_at.values(), default=0.0)
        silent = {name for name, at in self.seen_at.items() if latest - at > grace_s}
        changed = silent ^ self.silent
        self.silent = silent
        return changed
