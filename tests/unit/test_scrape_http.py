"""The operator's real scrape and directive code against a real loopback aiohttp peer:
a /metrics body is read whole before it is parsed (a split body is never "0 % used"), a body
over the bound or cut short of its Content-Length is an error (tier Unknown), and a refused
directive's error body is read under a bound (a huge one is not read into memory)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from warmpool_operator.io import worker_client as scrape
from warmpool_operator.rules import gating

from tests.support.loopback_peer import LoopbackPeer, Reply
from warmpool.contract.api import Tier
from warmpool.contract.http import PATH_CONTROL_TIER
from warmpool.contract.metrics import METRIC_MEMORY_USED_RATIO
from warmpool.tiering import Thresholds

pytestmark = pytest.mark.unit

TH = Thresholds(70, 90, 5)
POD = gating.PodRef("u", "p", "node", "127.0.0.1")


def worker_metrics(used: int, capacity: int) -> bytes:
    """What a real worker serves on /metrics, rendered by the worker's own metrics code."""
    from warmpool_worker.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    metrics.set_memory(used, capacity, "configured")
    metrics.set_ready(True)
    metrics.set_layers(4, 4)
    return metrics.render()


def split_at_ratio(body: bytes) -> tuple[bytes, bytes]:
    """The body cut inside the used-ratio figure, e.g. ``... 0.`` | ``95``."""
    line_start = body.index(METRIC_MEMORY_USED_RATIO.encode() + b"{")
    cut = body.index(b" 0.", line_start) + len(b" 0.")
    return body[:cut], body[cut:]


@pytest.fixture()
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as client:
        yield client


async def test_a_split_body_is_read_whole_not_as_zero_used(session: aiohttp.ClientSession) -> None:
    first, rest = split_at_ratio(worker_metrics(95, 100))
    async with LoopbackPeer() as peer:
        peer.replies["/metrics"] = Reply((first, rest), pause=0.3)
        sample = await scrape.scrape_one(session, peer.url("/metrics"), 5.0)
    assert sample.ok, sample.error
    assert sample.used_ratio == pytest.approx(0.95)
    assert gating.decide([POD], {"u": sample}, gating.GateState(), TH)[0].tier is Tier.PAUSED


async def test_a_body_over_the_bound_is_unknown(session: aiohttp.ClientSession) -> None:
    body = worker_metrics(10, 100)
    padding = b"# " + b"x" * 65_000 + b"\n"
    pieces = (body, *(padding,) * (scrape.MAX_BODY_BYTES // len(padding) + 2))
    async with LoopbackPeer() as peer:
        peer.replies["/metrics"] = Reply(pieces)  # chunked: no Content-Length to refuse early
        sample = await scrape.scrape_one(session, peer.url("/metrics"), 5.0)
    assert not sample.ok and sample.used_ratio is None
    assert sample.error is not None and "larger than" in sample.error
    assert gating.decide([POD], {"u": sample}, gating.GateState(), TH)[0].tier is Tier.UNKNOWN


async def test_a_body_short_of_its_content_length_is_unknown(session: aiohttp.ClientSession) -> None:
    body = worker_metrics(10, 100)
    async with LoopbackPeer() as peer:
        peer.replies["/metrics"] = Reply((body,), content_length=len(body) + 100)
        sample = await scrape.scrape_one(session, peer.url("/metrics"), 5.0)
    assert not sample.ok and sample.used_ratio is None
    assert sample.error is not None and sample.error.startswith("truncated")


async def test_an_announced_length_over_the_bound_is_unknown(session: aiohttp.ClientSession) -> None:
    body = worker_metrics(10, 100)
    async with LoopbackPeer() as peer:
        peer.replies["/metrics"] = Reply((body,), content_length=scrape.MAX_BODY_BYTES + 1)
        sample = await scrape.scrape_one(session, peer.url("/metrics"), 5.0)
    assert not sample.ok and sample.used_ratio is None


async def _send_tier(session: aiohttp.ClientSession, url: str, limit: float) -> str | None:
    """One tier directive the way a pass sends it (WorkerClient.send_tiers); its error or None."""
    sent = await scrape.WorkerClient(session, timeout=limit).send_tiers([("pod", url, Tier.FULL)], "token", 30.0)
    return sent["pod"]


async def test_a_refused_directive_with_a_huge_error_body_is_not_read_whole(
    session: aiohttp.ClientSession,
) -> None:
    piece = b"e" * 65_536
    async with LoopbackPeer() as peer:
        # 64 MiB of error text (the issue saw 200 MiB cost the operator 448 MiB).
        peer.replies[PATH_CONTROL_TIER] = Reply((piece,) * 1024, status=500)
        error = await _send_tier(session, peer.url(PATH_CONTROL_TIER), limit=10.0)
        sent = peer.sent[PATH_CONTROL_TIER]
    assert sent < 32 * 1024 * 1024, f"the operator read on: the peer sent {sent} bytes"
    assert error is not None and error.startswith("http 500")
    assert "body larger than" in error


async def test_a_refused_directive_reports_its_error_body(session: aiohttp.ClientSession) -> None:
    async with LoopbackPeer() as peer:
        peer.replies[PATH_CONTROL_TIER] = Reply((b"bad ", b"token"), pause=0.2, status=401)
        error = await _send_tier(session, peer.url(PATH_CONTROL_TIER), limit=5.0)
        peer.replies[PATH_CONTROL_TIER] = Reply((b"ok",), status=200)
        delivered = await _send_tier(session, peer.url(PATH_CONTROL_TIER), limit=5.0)
    assert error == "http 401: bad token"
    assert delivered is None
