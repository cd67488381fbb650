"""The activator's bounds across all pools, so that no client can exhaust what every tenant's held
requests depend on: connections, the bytes of bodies it keeps, and time.

- :class:`ConnectionGuard` wraps the HTTP server's protocol: past ``max_connections`` open at
  once, a new connection is answered 503 with Retry-After and closed before any byte of it is
  read; a connection whose request head has not arrived within ``header_timeout_s`` of opening (or
  of its previous answer) is closed, so a client trickling headers ties nothing up for long.
- :class:`ByteBudget`: the bytes of request bodies held at once, over all pools; a request whose
  body does not fit is answered 503 with Retry-After, never buffered.
- :func:`read_body`: one body, refused with 413 past the worker's own limit (before any byte when
  Content-Length says so), with 408 when it does not arrive within ``body_timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from warmpool.contract.zero import ERROR_BODY_TOO_LARGE, ERROR_BUSY, ERROR_SLOW_CLIENT

#: Retry-After of a refusal for load: a few seconds frees a connection or some bytes.
RETRY_AFTER_SECONDS = 5


def openai_error(status: int, message: str, type_: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "code": status}}, status=status,
                             headers=headers)


def busy(message: str) -> web.Response:
    return openai_error(503, message, ERROR_BUSY, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def _raw_busy_answer() -> bytes:
    body = json.dumps({"error": {"message": "the activator has as many connections open as it allows: retry "
                                            f"in {RETRY_AFTER_SECONDS}s", "type": ERROR_BUSY, "code": 503}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: {RETRY_AFTER_SECONDS}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


@dataclass
class _Connection:
    deadline: asyncio.TimerHandle | None = None
    busy: bool = False


class ConnectionGuard:
    """Counts the server's connections and closes those that send no request head in time."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections, self.header_timeout_s = max_connections, header_timeout_s
        self.open: dict[asyncio.BaseTransport, _Connection] = {}
        self.refused = 0
        self.timed_out = 0

    def protocol_factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """Wrap the server's protocol factory (aiohttp's ``runner.server``)."""
        return lambda: _Guarded(self, make())

    def _admit(self, transport: asyncio.BaseTransport) -> bool:
        if len(self.open) >= self.max_connections:
            self.refused += 1
            return False
        self.open[transport] = _Connection()
        self._arm(transport)
        return True

    def _arm(self, transport: asyncio.BaseTransport) -> None:
        connection = self.open.get(transport)
        if connection is None:
            return
        if connection.deadline is not None:
            connection.deadline.cancel()
        connection.deadline = asyncio.get_running_loop().call_later(self.header_timeout_s, self._expire, transport)

    def _expire(self, transport: asyncio.BaseTransport) -> None:
        connection = self.open.get(transport)
        if connection is not None and not connection.busy:
            self.timed_out += 1
            transport.close()

    def _forget(self, transport: asyncio.BaseTransport) -> None:
        connection = self.open.pop(transport, None)
        if connection is not None and connection.deadline is not None:
            connection.deadline.cancel()

    def request_started(self, transport: asyncio.BaseTransport | None) -> None:
        """A request's head arrived on ``transport``: its handler runs (and reads the body under its own deadline)."""
        connection = self.open.get(transport) if transport is not None else None
        if connection is not None:
            connection.busy = True
            if connection.deadline is not None:
                connection.deadline.cancel()
                connection.deadline = None

    def request_finished(self, transport: asyncio.BaseTransport | None) -> None:
        """The answer is sent: the next request's head must come within the header timeout."""
        connection = self.open.get(transport) if transport is not None else None
        if connection is not None:
            connection.busy = False
            self._arm(transport)  # type: ignore[arg-type]


class _Guarded(asyncio.Protocol):
    """aiohttp's request handler behind the guard: everything passes through once admitted."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard, self.inner = guard, inner
        self.transport: asyncio.BaseTransport | None = None
        self.admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.admitted = self.guard._admit(transport)
        if not self.admitted:
            if isinstance(transport, asyncio.WriteTransport):
                transport.write(_raw_busy_answer())
            transport.close()
            return
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.guard._forget(self.transport)
        if self.admitted:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()


class ByteBudget:
    """Bytes of request bodies the activator keeps at once (all pools together)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used = max(0, self.used - n)


class Refused(Exception):
    """A body the activator will not take; ``response`` says why to the client."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.reason)
        self.response = response


async def read_body(request: web.Request, max_bytes: int, timeout_s: float, budget: ByteBudget,
                    taken: list[int]) -> bytes:
    """The request's body, whole, under the bounds; the bytes it took from ``budget`` are added to
    ``taken`` (the caller gives them back when the request ends).  Raises :class:`Refused`."""
    too_large = Refused(openai_error(413, f"the request body is larger than a worker accepts ({max_bytes} bytes)",
                                     ERROR_BODY_TOO_LARGE))
    declared = request.content_length
    if declared is not None:
        if declared > max_bytes:
            raise too_large
        if not budget.take(declared):
            raise Refused(busy("the activator holds as many request bytes as it allows: retry later"))
        taken.append(declared)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > max_bytes:
                    raise too_large
                if declared is None:
                    if not budget.take(len(chunk)):
                        raise Refused(busy("the activator holds as many request bytes as it allows: retry later"))
                    taken.append(len(chunk))
                chunks.append(chunk)
    except TimeoutError:
        raise Refused(openai_error(408, f"the request body did not arrive within {timeout_s:g}s",
                                   ERROR_SLOW_CLIENT)) from None
    return b"".join(chunks)
