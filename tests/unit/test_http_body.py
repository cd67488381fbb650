"""warmpool.http_body against a real loopback aiohttp server: a body is read whole, to EOF,
under a bound, or not at all (a split body waits for its last piece; an over-long one, or
one that announces too much, is refused; one cut short of its Content-Length is an error)."""

from __future__ import annotations

import aiohttp
import pytest

from tests.support.loopback_peer import LoopbackPeer, Reply
from warmpool.http_body import BodyTooLarge, read_bounded, read_bounded_text

pytestmark = pytest.mark.unit

#: Every request in these tests is bounded in time.
TIMEOUT = aiohttp.ClientTimeout(total=10)


async def _get(peer: LoopbackPeer, path: str, limit: int) -> bytes:
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=TIMEOUT) as session,
        session.get(peer.url(path)) as response,
    ):
        return await read_bounded(response, limit)


async def test_a_body_sent_in_two_pieces_is_read_whole() -> None:
    async with LoopbackPeer() as peer:
        peer.replies["/split"] = Reply((b"warmpool_memory_used_ratio 0.", b"95\n"), pause=0.3)
        assert await _get(peer, "/split", 1024) == b"warmpool_memory_used_ratio 0.95\n"


async def test_a_split_body_with_a_true_content_length_is_read_whole() -> None:
    async with LoopbackPeer() as peer:
        peer.replies["/split"] = Reply((b"abc", b"def"), pause=0.3, content_length=6)
        assert await _get(peer, "/split", 6) == b"abcdef"  # exactly the bound is allowed


async def test_a_chunked_body_over_the_bound_is_refused_and_not_read_on() -> None:
    piece = b"# padding\n" * 6554  # ~64 KiB
    async with LoopbackPeer() as peer:
        peer.replies["/big"] = Reply((piece,) * 512)  # ~32 MiB, no Content-Length
        with pytest.raises(BodyTooLarge) as caught:
            await _get(peer, "/big", 256 * 1024)
        assert caught.value.limit == 256 * 1024
        # The client stopped reading at the bound: the peer could not send it all.
        assert peer.sent["/big"] < peer.replies["/big"].size // 2


async def test_one_byte_over_the_bound_is_refused() -> None:
    async with LoopbackPeer() as peer:
        peer.replies["/over"] = Reply((b"x" * 100, b"y"), pause=0.1)
        with pytest.raises(BodyTooLarge):
            await _get(peer, "/over", 100)


async def test_an_announced_length_over_the_bound_is_refused_before_reading() -> None:
    async with LoopbackPeer() as peer:
        peer.replies["/announced"] = Reply((b"small",), content_length=10_000_000)
        with pytest.raises(BodyTooLarge):
            await _get(peer, "/announced", 1024)


async def test_a_body_short_of_its_content_length_is_an_error_not_a_body() -> None:
    async with LoopbackPeer() as peer:
        peer.replies["/liar"] = Reply((b"warmpool_memory_used_ratio 0.",), content_length=500)
        with pytest.raises(aiohttp.ClientPayloadError):
            await _get(peer, "/liar", 1024)


async def test_text_is_utf8_with_bad_bytes_replaced() -> None:
    async with (
        LoopbackPeer() as peer,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=TIMEOUT) as session,
    ):
        peer.replies["/text"] = Reply(("héllo ".encode(), b"\xff!"), pause=0.1)
        peer.replies["/empty"] = Reply(())
        async with session.get(peer.url("/text")) as response:
            assert await read_bounded_text(response, 64) == "héllo \ufffd!"
        async with session.get(peer.url("/empty")) as response:
            assert await read_bounded_text(response, 64) == ""
