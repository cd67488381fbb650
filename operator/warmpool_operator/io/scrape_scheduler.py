"""One scrape scheduler for every worker pod the operator watches.

Each round (every ``--scrape-interval``) every WarmModel's pods are scraped once, at a random
offset within the first ``JITTER`` of the interval (so a thousand pools do not dial at the same
instant), under one global bound on scrapes in flight.  The samples are handed to the
WarmModel's reconciler, which decides tiers from them; a reconcile may also ask for an
immediate scrape of a pod whose readiness changed since its last sample (through the same
bound), so a pod turning warm shows without waiting for the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

from warmpool_operator.io.worker_client import WorkerClient
from warmpool_operator.model import Sample

log = logging.getLogger("warmpool.operator")

#: The share of the interval over which a round's scrapes are spread.
JITTER = 0.25


class ScrapeScheduler:
    def __init__(self, workers: WorkerClient, interval: float, concurrency: int) -> None:
        self.workers = workers
        self.interval = interval
        self.gate = asyncio.Semaphore(max(1, concurrency))
        self.rounds = 0

    async def scrape(self, urls: Mapping[str, str]) -> dict[str, Sample]:
        """Scrape each url (key -> url), within the global bound and each bounded in time."""

        async def one(key: str, url: str) -> tuple[str, Sample]:
            async with self.gate:
                return key, await self.workers.metrics(url)

        return dict(await asyncio.gather(*(one(k, u) for k, u in urls.items())))

    async def run(self, pools: Callable[[], Iterable[Callable[[], Awaitable[None]]]]) -> None:
        """Forever: one round per interval.  ``pools`` gives, each round, one coroutine function per
        WarmModel that scrapes its pods (through :meth:`scrape`) and feeds its reconciler."""
        while True:
            started = time.monotonic()
            jobs = [self._later(job) for job in pools()]
            if jobs:
                # A round never outlives a few intervals: a stuck pool cannot stall the others.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.gather(*jobs), timeout=3 * self.interval + self.workers.timeout)
            self.rounds += 1
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def _later(self, job: Callable[[], Awaitable[None]]) -> None:
        await asyncio.sleep(random.uniform(0.0, JITTER * self.interval))
        try:
            await job()
        except Exception:  # one pool's failure must not end the scheduler
            log.exception("scrape round: a pool's scrape failed")
