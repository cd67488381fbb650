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
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

from warmpool_operator.io import metrics
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
                await self._bounded(jobs)
            self.rounds += 1
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def _bounded(self, jobs: Sequence[Awaitable[None]]) -> None:
        """Run one round's jobs, for at most a few intervals.  Rounds run one after another, so a
        stuck pool delays every pool's next round until this bound; then the round is cancelled,
        the stuck pool's job and any other job still running alike, logged and counted
        (SCRAPE_ROUNDS_CUT), and the next round starts."""
        bound = self.round_bound()
        try:
            await asyncio.wait_for(asyncio.gather(*jobs), timeout=bound)
        except TimeoutError:
            metrics.SCRAPE_ROUNDS_CUT.inc()
            log.warning("scrape round %d cut after %gs: a pool's scrape or pass did not finish "
                        "(its next round starts now)", self.rounds, bound)

    def round_bound(self) -> float:
        """Seconds a round may run: three intervals and one scrape's timeout."""
        return 3 * self.interval + self.workers.timeout

    async def _later(self, job: Callable[[], Awaitable[None]]) -> None:
        await asyncio.sleep(random.uniform(0.0, JITTER * self.interval))
        try:
            await job()
        except Exception:  # one pool's failure must not end the scheduler
            log.exception("scrape round: a pool's scrape failed")
