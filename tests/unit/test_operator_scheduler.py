"""The scrape scheduler (one for all pools) against a real loopback aiohttp worker stand-in:
scrapes from every pool share one global bound, and a round reaches every pool once.
The leader Lease's expiry rule, on real timestamps."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import REGISTRY
from warmpool_operator.app import leader
from warmpool_operator.io.scrape_scheduler import ScrapeScheduler
from warmpool_operator.io.worker_client import WorkerClient

from warmpool.contract.metrics import METRIC_OPERATOR_SCRAPE_ROUNDS_CUT
from warmpool.lease import Observed

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
        scheduler = ScrapeScheduler(WorkerClient(session, timeout=5.0), interval=60.0, concurrency=3)
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
        scheduler = ScrapeScheduler(WorkerClient(session, timeout=1.0), interval=0.2, concurrency=2)
        task = asyncio.create_task(scheduler.run(lambda: [job(i) for i in range(7)]))
        try:
            await asyncio.wait_for(all_reached.wait(), timeout=10)
        finally:
            task.cancel()
    assert sorted(reached[:7]) == list(range(7))


def _rounds_cut() -> float:
    return REGISTRY.get_sample_value(METRIC_OPERATOR_SCRAPE_ROUNDS_CUT) or 0.0


async def test_a_round_held_up_by_a_stuck_pool_is_cut_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    """A pool whose scrape never ends holds the round up to its bound, no longer: then the round is
    cancelled, a warning says so and the counter counts it, and the next round reaches the pools."""
    rounds_reached: list[int] = []

    async def stuck() -> None:
        await asyncio.Event().wait()  # a scrape or pass that never returns

    async def healthy() -> None:
        rounds_reached.append(scheduler.rounds)

    before = _rounds_cut()
    async with aiohttp.ClientSession(trust_env=False) as session:
        scheduler = ScrapeScheduler(WorkerClient(session, timeout=0.1), interval=0.05, concurrency=2)
        with caplog.at_level(logging.WARNING, logger="warmpool.operator"):
            task = asyncio.create_task(scheduler.run(lambda: [stuck, healthy]))
            try:
                deadline = time.monotonic() + 10  # the bound is 0.25 s: this only catches a hang
                while scheduler.rounds < 2 or _rounds_cut() < before + 2:
                    assert not task.done(), task
                    assert time.monotonic() < deadline, (scheduler.rounds, _rounds_cut() - before)
                    await asyncio.sleep(0.02)
            finally:
                task.cancel()
    assert sorted(set(rounds_reached))[:2] == [0, 1]  # the stuck pool held no one back past the bound
    cut = [r.getMessage() for r in caplog.records if "scrape round" in r.getMessage()]
    assert cut and "cut after 0.25s" in cut[0], cut


def _lease(holder: str, renewed: str, version: str, duration: int = 8) -> dict[str, object]:
    return {"metadata": {"resourceVersion": version},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration, "renewTime": renewed}}


def test_a_standby_judges_expiry_by_its_own_clock_from_when_it_saw_the_record() -> None:
    observed = Observed()
    # The holder's renewTime is an hour in the past by our clock (its clock is behind): not expired
    # on sight, only after the record stood unchanged for the lease's duration as we measure it.
    stale = _lease("a-1-x", "2026-12-01T07:00:00.000000Z", "10")
    assert not observed.expired(stale, now=100.0)
    assert not observed.expired(stale, now=107.9)
    assert observed.expired(stale, now=108.1)
    # A renewal (a new record) starts the count again, whatever its renewTime says.
    renewed = _lease("a-1-x", "2026-12-01T07:00:00.000000Z", "11")
    assert not observed.expired(renewed, now=108.2)
    assert not observed.expired(renewed, now=116.0)
    assert observed.expired(renewed, now=116.3)
    # A released Lease (no holder) is free at once.
    assert Observed().expired(_lease("", "", "12"), now=0.0)


def test_the_holder_stops_acting_before_a_standby_may_take_over() -> None:
    cfg = leader.LeaderConfig(namespace="ns", name="l", identity="a")
    assert cfg.renew_deadline < cfg.lease_duration
    assert leader.time_left(cfg, renewed=50.0, now=50.0 + cfg.renew_deadline - 0.5) == pytest.approx(0.5)
    assert leader.time_left(cfg, renewed=50.0, now=50.0 + cfg.renew_deadline) <= 0
    for renew_deadline, retry_period in ((8.0, 2.0), (9.0, 2.0), (6.0, 6.0), (6.0, 0.0)):
        with pytest.raises(ValueError, match=r"retry period .* < renew deadline .* < lease duration"):
            leader.LeaderConfig(namespace="ns", name="l", identity="a", lease_duration=8.0,
                                renew_deadline=renew_deadline, retry_period=retry_period)
