"""A real aiohttp server on 127.0.0.1 that answers each path exactly as a test tells it to:
in pieces with a pause between them, with a chunked body of any size, or with a
Content-Length that lies.  The peers the project reads bodies from (worker /metrics,
a worker's /control/tier, an external engine) are played by it in the body-reading tests.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web


@dataclass(frozen=True)
class Reply:
    """What the peer sends for one path."""

    pieces: tuple[bytes, ...]
    #: Seconds between two pieces (each piece is flushed before the pause).
    pause: float = 0.0
    status: int = 200
    #: The announced Content-Length; None sends the body chunked.  When it is larger than
    #: what the pieces hold, the peer closes the connection after the last piece.
    content_length: int | None = None
    content_type: str = "text/plain"

    @property
    def size(self) -> int:
        return sum(len(piece) for piece in self.pieces)


@dataclass
class LoopbackPeer:
    """``async with LoopbackPeer() as peer``: ``peer.replies[path] = Reply(...)``, ``peer.url(path)``."""

    replies: dict[str, Reply] = field(default_factory=dict)
    #: path -> bytes the server managed to write (a client that stops reading stops it).
    sent: dict[str, int] = field(default_factory=dict)
    _runner: web.AppRunner | None = None
    _port: int = 0

    async def __aenter__(self) -> LoopbackPeer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)
        self._port = int(server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        await request.read()  # a POST's body (a directive) is consumed before answering
        reply = self.replies.get(request.path)
        if reply is None:
            return web.Response(status=404, text=f"no reply set for {request.path}")
        response = web.StreamResponse(status=reply.status, headers={"Content-Type": reply.content_type})
        if reply.content_length is None:
            response.enable_chunked_encoding()
        else:
            response.content_length = reply.content_length
        await response.prepare(request)
        self.sent[request.path] = 0
        try:
            for index, piece in enumerate(reply.pieces):
                if index and reply.pause:
                    await asyncio.sleep(reply.pause)
                await response.write(piece)
                self.sent[request.path] += len(piece)
        except (ConnectionError, RuntimeError):
            return response  # the client went away (it stopped reading): what we expect of it
        if reply.content_length is not None and reply.content_length > reply.size:
            # The lie: fewer bytes than announced, then the connection ends.
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write_eof()
        return response
