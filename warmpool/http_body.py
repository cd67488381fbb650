"""Read an HTTP response body whole, up to a bound, or not at all.

aiohttp's ``content.read(n)`` returns whatever has arrived so far, not ``n`` bytes: a
worker that sends ``...used_ratio 0.`` and, a moment later, ``95`` would be parsed as 0 %
used.  And ``response.read()`` has no bound at all: one 200 MiB reply is 200 MiB of our
memory.  Every client in this project that reads a peer's body (the operator's scrapes and
directives, the sidecar's engine client) reads it through :func:`read_bounded`.
"""

from __future__ import annotations

import aiohttp

#: Chunk size for reading to EOF; small enough that an over-long body is refused early.
_CHUNK = 64 * 1024


class BodyTooLarge(Exception):
    """The peer sent (or announced) more than the bound: nothing of it is used."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"body larger than {limit} bytes")
        self.limit = limit


async def read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, read to EOF; :class:`BodyTooLarge` once it passes ``limit`` bytes.

    A ``Content-Length`` above the bound is refused before any byte is read.  Network
    errors and timeouts propagate as aiohttp raises them (a truncated body is never
    returned as if it were whole).
    """
    announced = response.content_length
    if announced is not None and announced > limit:
        raise BodyTooLarge(limit)
    parts: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(_CHUNK):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        parts.append(chunk)
    return b"".join(parts)


async def read_bounded_text(response: aiohttp.ClientResponse, limit: int) -> str:
    """:func:`read_bounded`, decoded as UTF-8 (undecodable bytes replaced, never an error)."""
    return (await read_bounded(response, limit)).decode("utf-8", errors="replace")
