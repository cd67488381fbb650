"""Tell the operator at once how many requests this activator replica holds for a pool: the
``held.warmpool.dev/<this pod>`` annotation on the WarmModel (warmpool/contract/zero.py), which
the operator's watch turns into a pass within milliseconds, not on a scrape tick.

A count that rises from zero is written at once; later changes are coalesced (one write in
flight per pool, the latest count written next), and the key is removed once the replica holds
nothing.  While requests stay held the value is rewritten every ``REFRESH_SECONDS``, so the
operator can tell a live count from one left by a replica that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

import aiohttp

from warmpool.contract.api import API_GROUP, API_VERSION, PLURAL
from warmpool.contract.zero import held_annotation, held_value
from warmpool.kube import MERGE_PATCH, KubeClient, KubeError
from warmpool_operator.activator.pools import PoolKey

log = logging.getLogger("warmpool.activator")

#: Seconds between rewrites of a count that has not changed (the operator ignores one older than
#: the pool's hold timeout plus 30 s).
REFRESH_SECONDS = 10.0
#: Least seconds between two writes for one pool (the first of a hold is written at once).
COALESCE_SECONDS = 0.1


class Demand:
    """The held counts this replica reports, one writer task per pool while it has something to say."""

    def __init__(self, client: KubeClient, pod_name: str, wall: Callable[[], float] = time.time) -> None:
        self.client, self.pod_name, self.wall = client, pod_name, wall
        self.counts: dict[PoolKey, int] = {}
        #: the traceparent of the oldest hold of each pool (tracing on): written beside its count
        self.traces: dict[PoolKey, str | None] = {}
        self._written: dict[PoolKey, int] = {}
        self._changed: dict[PoolKey, asyncio.Event] = {}
        self._writers: dict[PoolKey, asyncio.Task[None]] = {}

    def set(self, key: PoolKey, count: int, trace: str | None = None) -> None:
        self.counts[key] = count
        self.traces[key] = trace
        self._changed.setdefault(key, asyncio.Event()).set()
        writer = self._writers.get(key)
        if writer is None or writer.done():
            self._writers[key] = asyncio.create_task(self._write_loop(key), name=f"demand {key[0]}/{key[1]}")

    def adopt(self, key: PoolKey, annotations: Mapping[str, object]) -> None:
        """A WarmModel seen with this replica's key that this process never wrote: left by the
        container before a restart (same pod name), and removed now rather than when it turns stale."""
        if held_annotation(self.pod_name) in annotations and key not in self.counts:
            self._written[key] = -1  # differs from 0: the writer removes the key
            self.set(key, 0)

    async def _write_loop(self, key: PoolKey) -> None:
        changed = self._changed[key]
        while True:
            changed.clear()
            count = self.counts.get(key, 0)
            if count != self._written.get(key, 0) or count:
                await self._write(key, count)
                await asyncio.sleep(COALESCE_SECONDS)  # a burst of arrivals: one write, not one each
            if count == 0 and self._written.get(key, 0) == 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), REFRESH_SECONDS)

    async def _write(self, key: PoolKey, count: int) -> None:
        annotation = held_annotation(self.pod_name)
        value = held_value(count, self.wall(), self.traces.get(key)) if count else None
        path = f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{key[0]}/{PLURAL}/{key[1]}"
        try:
            await self.client.request("PATCH", path, body={"metadata": {"annotations": {annotation: value}}},
                                      content_type=MERGE_PATCH)
        except KubeError as error:
            if error.status == 404:
                self._written[key] = 0  # no such WarmModel: nothing to remove later either
                return
            log.warning("%s/%s: held count %d not written (%s): tried again", *key, count, error)
            await asyncio.sleep(0.5)
            return
        except (aiohttp.ClientError, TimeoutError) as error:
            log.warning("%s/%s: held count %d not written (%s: %s): tried again", *key, count,
                        type(error).__name__, error)
            await asyncio.sleep(0.5)
            return
        self._written[key] = count

    async def clear_all(self) -> None:
        """At shutdown: remove this replica's keys (a count left would keep pools from zero until stale)."""
        for task in self._writers.values():
            task.cancel()
        for key, written in list(self._written.items()):
            if written:
                self.counts[key] = 0
                await self._write(key, 0)
