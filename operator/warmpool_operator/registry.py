"""The operator-wide set of reconcilers (kept in kopf's memo), and the routing of watch events
to the one WarmModel they concern."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from warmpool_operator.cache import Cache
from warmpool_operator.kube import Kube
from warmpool_operator.reconciler import Reconciler
from warmpool_operator.scheduler import ScrapeScheduler


@dataclass
class Registry:
    kube: Kube
    session: aiohttp.ClientSession
    scheduler: ScrapeScheduler
    cache: Cache | None = None
    by_key: dict[tuple[str, str], Reconciler] = field(default_factory=dict)
    scheduling: asyncio.Task[None] | None = None
    #: reconcilers of WarmModels deleted and made again under the same name, while they stop
    stopping: set[asyncio.Task[None]] = field(default_factory=set)

    def start_scheduler(self) -> None:
        if self.scheduling is None:
            self.scheduling = asyncio.create_task(self.scheduler.run(self.rounds), name="scrape scheduler")

    def rounds(self) -> Iterator[Callable[[], Awaitable[None]]]:
        return (rec.scrape_round for rec in list(self.by_key.values()))

    def get(self, namespace: str, name: str, uid: str | None = None) -> Reconciler | None:
        rec = self.by_key.get((namespace, name))
        if rec is None or (uid is not None and rec.uid != uid):
            return None
        return rec

    def ensure(self, body: Mapping[str, Any], cache: Cache) -> Reconciler:
        """The WarmModel's reconciler, made and started on first sight; ``body`` becomes its view."""
        meta = body["metadata"]
        key = (str(meta["namespace"]), str(meta["name"]))
        rec = self.by_key.get(key)
        if rec is not None and rec.uid != str(meta["uid"]):  # deleted and made again under the same name
            self.by_key.pop(key, None)
            stopping = asyncio.create_task(rec.stop())
            self.stopping.add(stopping)
            stopping.add_done_callback(self.stopping.discard)
            rec = None
        if rec is None:
            self.cache = cache
            rec = Reconciler(body, self.kube, cache, self.scheduler)
            self.by_key[key] = rec
            rec.start()
        else:
            rec.body = dict(body)
        return rec

    async def forget(self, namespace: str, name: str, uid: str) -> None:
        rec = self.get(namespace, name, uid)
        if rec is not None:
            self.by_key.pop((namespace, name), None)
            await rec.stop()

    async def close(self) -> None:
        if self.scheduling is not None:
            self.scheduling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.scheduling
        for rec in list(self.by_key.values()):
            await rec.stop()
        self.by_key.clear()
