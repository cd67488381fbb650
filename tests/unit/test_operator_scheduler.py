"""The scrape scheduler (one for all pools) against a real loopback aiohttp worker stand-in:
scrapes from every pool share one global bound, and a round reaches every pool once.
The leader Lease's expiry rule, on real timestamps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta

import aiohttp
import pytest
from aiohttp import web
from warmpool_operator import leader
from warmpool_operator.scheduler import ScrapeScheduler

pytestmark = pytest.mark.unit


class CountingWorker:
    """A /metrics endpoint that holds each request a moment and records the most in flight."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.most = 0
        self.served = 0

    async def metrics(self, _: web.Request) -> web.Response:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(0.05)
        finally:
            self.in_flight -= 1
        self.served += 1
        return web.Response(text="# nothing of ours\n")


@pytest.fixture()
async def worker() -> AsyncIterator[tuple[CountingWorker, str]]:
    counting = CountingWorker()
    app = web.Application()
    app.router.add_get("/metrics", counting.metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert isinstance(server, asyncio.Server)
    port = int(server.sockets[0].getsockname()[1])
    try:
        yield counting, f"http://127.0.0.1:{port}/metrics"
    finally:
        await runner.cleanup()


async def test_scrapes_of_all_pools_share_one_global_bound(worker: tuple[CountingWorker, str]) -> None:
    counting, url = worker
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), trust_env=False) as session:
        scheduler = ScrapeScheduler(session, interval=60.0, timeout=5.0, concurrency=3)
        pools = [{f"{pool}-{pod}": url for pod in range(4)} for pool in range(5)]  # 20 pods in 5 pools
        results = await asyncio.wait_for(asyncio.gather(*(scheduler.scrape(urls) for urls in pools)), timeout=30)
    assert counting.served == 20
    assert counting.most == 3, counting.most  # the bound is global: never 5 pools x 3
    assert all(len(found) == 4 for found in results)


async def test_a_round_reaches_every_pool_once() -> None:
    reached: list[int] = []
    all_reached = asyncio.Event()

    def job(pool: int) -> Callable[[], Awaitable[None]]:
        async def scrape_round() -> None:
            reached.append(pool)
            if len(reached) >= 7:
                all_reached.set()
        return scrape_round

    async with aiohttp.ClientSession(trust_env=False) as session:
        scheduler = ScrapeScheduler(session, interval=0.2, timeout=1.0, concurrency=2)
        task = asyncio.create_task(scheduler.run(lambda: [job(i) for i in range(7)]))
        try:
            await asyncio.wait_for(all_reached.wait(), timeout=10)
        finally:
            task.cancel()
    assert sorted(reached[:7]) == list(range(7))


def test_a_lease_expires_after_its_duration_from_the_last_renewal() -> None:
    now = datetime(2026, 12, 1, 8, 0, 0, tzinfo=UTC)

    def lease(renewed: datetime | None, duration: int = 8) -> dict[str, object]:
        spec: dict[str, object] = {"holderIdentity": "a-1", "leaseDurationSeconds": duration}
        if renewed is not None:
            spec["renewTime"] = renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {"spec": spec}

    assert not leader.expired(lease(now - timedelta(seconds=7)), now)
    assert leader.expired(lease(now - timedelta(seconds=9)), now)
    assert leader.expired(lease(None), now)  # never renewed: anyone may take it
