"""Which WarmModels' manifests this node's agent reads, and the reads themselves.

A WarmModel's author chooses the URL the agents read, so an agent reads a manifest only when
the WarmModel needs its node: a worker pod of the WarmModel is bound here (it will be filled
here).  One case needs a read before any pod exists: the operator builds pods only once some
node has reported the revision's digest in ``status.cacheNodes``.  That first read goes to one
agent in the cluster at a time -- the holder of the WarmModel's read Lease
(``agent_kube.read_lease_name``) -- and only while no node has reported a revision for the
current source.  So a spec makes one node read its URL, not every node.

Reads run as tasks beside the pass, at most ``bound`` at once, each bounded in size and time by
the source's ``ReadLimits``: a slow or hostile source holds one slot for at most its deadline,
and the pass -- the other WarmModels' fills, reports, pins and eviction -- never waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from warmpool.contract.files import MANIFEST_FILENAME
from warmpool.kube import KubeError
from warmpool.lease import Lease, LeaseLostError, Observed
from warmpool_nodecache.agent import ModelRef
from warmpool_nodecache.agent_kube import AgentKube, agent_lease, read_lease_name
from warmpool_nodecache.manifest import Manifest, parse_manifest
from warmpool_nodecache.source import ReadLimits, Source

log = logging.getLogger("warmpool.node_agent")


def revision_reported(obj: Mapping[str, Any], fingerprint: str) -> bool:
    """Whether some node reported a revision for the source ``fingerprint`` names (any node)."""
    for entry in (obj.get("status") or {}).get("cacheNodes") or []:
        if isinstance(entry, Mapping) and entry.get("source") == fingerprint and entry.get("revision"):
            return True
    return False


async def read_manifest(source: Source, limits: ReadLimits) -> Manifest:
    """The source's manifest, read within ``limits`` (in a thread: the sources are blocking)."""
    text = await asyncio.to_thread(source.fetch_manifest)
    return parse_manifest(text, f"{source.describe()}/{MANIFEST_FILENAME}", max_block_size=limits.max_block_bytes)


class FirstReads:
    """The read Leases this agent holds: one per WarmModel whose first digest it reads (see the
    module docstring).  A Lease is renewed while its WarmModel waits for a first revision; once
    one is reported it rests -- kept, no longer renewed -- and expires on its own.  Released at
    once, another agent whose list predates the report could take it and read again; expiring,
    it is free only after every agent's list shows the report."""

    def __init__(self, kube: AgentKube, namespace: str, node: str, duration_s: float) -> None:
        self.kube, self.namespace, self.node, self.duration_s = kube, namespace, node, duration_s
        self.held: dict[str, Lease] = {}
        #: what this agent saw of each read Lease another agent held, by WarmModel
        self.seen: dict[str, Observed] = {}
        self.resting: set[str] = set()

    async def may_read(self, ref: ModelRef, reported: bool) -> bool:
        """Whether this agent reads ``ref``'s manifest for no pod of its own: only while no node has
        reported a revision of the current source, and only as the holder of its read Lease."""
        if reported:
            self.seen.pop(ref.key, None)
            self.rest(ref.key)
            return False
        lease = self.held.get(ref.key)
        if lease is not None:
            if time.monotonic() - lease.renewed_at < lease.duration_s / 3:
                self.resting.discard(ref.key)
                return True
            try:
                await lease.renew()
                self.resting.discard(ref.key)
                return True
            except LeaseLostError:  # expired while it rested, or taken over: ask for it again
                self.held.pop(ref.key, None)
                self.resting.discard(ref.key)
        lease = agent_lease(self.kube, self.namespace, read_lease_name(ref.uid), self.duration_s,
                            self.seen.setdefault(ref.key, Observed()))
        if await lease.try_acquire():
            self.held[ref.key] = lease
            self.seen.pop(ref.key, None)
            return True
        return False

    def rest(self, key: str) -> None:
        """A revision is reported: the Lease is no longer renewed (see the class docstring)."""
        if key in self.held:
            self.resting.add(key)

    async def release(self, key: str) -> None:
        """The WarmModel is gone (or this agent stops): give its Lease up."""
        self.resting.discard(key)
        self.seen.pop(key, None)
        lease = self.held.pop(key, None)
        if lease is not None:
            with contextlib.suppress(KubeError, OSError, TimeoutError, LeaseLostError):
                await lease.release()

    async def close(self) -> None:
        for key in list(self.held):
            await self.release(key)
