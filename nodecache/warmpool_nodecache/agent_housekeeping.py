"""The node agent's work on the cache as a whole, after each pass over the WarmModels: pins on the
revisions pods here need, the node's labels saying which revisions it holds, and eviction down
to the budget.  A failure of any step is an Event on the Node and leaves the other steps to run."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from warmpool_nodecache import agent
from warmpool_nodecache import agent_notices as notices
from warmpool_nodecache.agent_kube import AgentKube
from warmpool_nodecache.evict import evict
from warmpool_nodecache.eviction_lock import CacheBusyError
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.use import RevisionNotCachedError, pinned

log = logging.getLogger("warmpool.node_agent")


class Housekeeping:
    def __init__(self, kube: AgentKube, layout: CacheLayout, said: notices.Notices, budget_bytes: int | None) -> None:
        self.kube, self.layout, self.notices, self.budget_bytes = kube, layout, said, budget_bytes
        self.pins: dict[str, contextlib.ExitStack] = {}

    def close(self) -> None:
        for stack in self.pins.values():
            stack.close()
        self.pins.clear()

    async def run(self, wanted: set[str], filling: bool, unread: frozenset[str] = frozenset()) -> None:
        """Pins, labels and eviction; a failure of one is an Event on the Node, the others still run.

        ``unread`` names WarmModels with pods here whose manifest this agent has not read yet (just
        started, or a slow source): the revision they need is unknown, so nothing is evicted until
        it is known (another agent, or this one before a restart, may have cached it)."""
        node = self.notices.node_object()
        try:
            self.pin(wanted)
        except Exception as error:
            await self._step_failed("pinning the revisions pods here need", error)
        try:
            await self.label()
        except Exception as error:
            await self._step_failed("labelling the node", error)
        if self.budget_bytes is None or filling:  # eviction would wait for the fill
            return
        if unread:
            log.info("node agent: eviction deferred: the revisions %s need are not known yet",
                     ", ".join(sorted(unread)))
            return
        try:
            result = await asyncio.to_thread(evict, self.layout, self.budget_bytes, lock_timeout_s=1.0,
                                             keep=frozenset(wanted))
        except CacheBusyError as error:  # another process's fill: evict on a later pass
            log.info("node agent: eviction deferred: %s", error)
            return
        except Exception as error:
            log.warning("node agent: eviction failed: %s", agent.failure_text(error))
            await self.notices.warn(node, notices.REASON_EVICTION_FAILED,
                                    f"eviction failed ({agent.failure_text(error)})")
            return
        self.notices.clear(node, notices.REASON_EVICTION_FAILED)
        if result.unreadable:
            await self.notices.warn(node, notices.REASON_MANIFEST_UNREADABLE,
                                    f"cached manifests no longer parse: {', '.join(result.unreadable)[:800]}; "
                                    "eviction went on without them (their revisions' files are unaffected)")
        if result.evicted:
            log.info("node agent: evicted %s (cache %d -> %d bytes)", result.evicted, result.bytes_before,
                     result.bytes_after)
            await self.label()

    async def _step_failed(self, step: str, error: Exception) -> None:
        log.warning("node agent: %s failed: %s", step, agent.failure_text(error))
        await self.notices.warn(self.notices.node_object(), notices.REASON_PASS_FAILED,
                                f"{step} failed ({agent.failure_text(error)})", topic=step)

    def pin(self, wanted: set[str]) -> None:
        """Hold a pin on each revision a pod here needs, so eviction spares it before it is mapped."""
        for digest in set(self.pins) - wanted:
            self.pins.pop(digest).close()
        for digest in wanted - set(self.pins):
            stack = contextlib.ExitStack()
            try:
                stack.enter_context(pinned(self.layout, digest))
            except RevisionNotCachedError:
                continue  # not published yet: pinned on a later pass
            self.pins[digest] = stack

    async def label(self) -> None:
        labels = await self.kube.node_labels()
        patch = agent.label_changes(labels, agent.published_digests(self.layout))
        if patch:
            await self.kube.patch_node_labels(patch)
            log.info("node agent: node %s labels %s", self.kube.node, patch)
