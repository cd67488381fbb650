"""An OpenAI-compatible engine stand-in on loopback that records the exact request target of
every request it receives, for the tests of what the sidecar passes on.

It answers what the sidecar itself uses (``/health``, ``/v1/models``, ``/metrics``), a
``/v1/completions`` (streamed as server-sent events when asked), and *every other path* with a
200 naming it, as vLLM's unauthenticated dev endpoints (``/sleep``, ``/reset_prefix_cache``)
would: a request that should never have reached it is both recorded and visible in the answer.
Requests are told apart by the ``PROBE_HEADER`` a test sends (the sidecar's own probes carry none).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from tests.support.procs import HOST, free_port

#: The header a test puts on each of its requests; the sidecar passes client headers on.
PROBE_HEADER = "X-Path-Probe"
MODEL = "path-recorder"
#: The pieces of a streamed completion, one server-sent event each.
STREAMED_PIECES = (" one", " two", " three")


@dataclass(frozen=True)
class Received:
    method: str
    #: the request target exactly as it came on the request line (path and query, still encoded)
    target: str
    probe: str | None


class PathRecordingEngine:
    """Started on construction in a thread of its own; ``close()`` stops it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self._received: list[Received] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def received(self, probe: str | None = None) -> list[Received]:
        """What reached the engine, in order; only the requests of ``probe`` when given."""
        with self._lock:
            return [r for r in self._received if probe is None or r.probe == probe]

    def probed(self) -> list[Received]:
        """Every request that carried a test's probe header."""
        with self._lock:
            return [r for r in self._received if r.probe is not None]

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_route("*", "/{anything:.*}", self._anything)
        return app

    @web.middleware
    async def _record(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        # raw_path is the request line's target as sent (aiohttp keeps it undecoded)
        with self._lock:
            self._received.append(Received(request.method, request.raw_path, request.headers.get(PROBE_HEADER)))
        return await handler(request)

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({})

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text="process_start_time_seconds 1.0\n")

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "max_model_len": 4096}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "".join(STREAMED_PIECES), "index": 0,
                                                   "finish_reason": "length"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in STREAMED_PIECES:
            event = {"choices": [{"text": piece, "index": 0, "finish_reason": None}]}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _anything(self, request: web.Request) -> web.Response:
        return web.json_response({"engine_reached": request.raw_path})

    async def _start(self) -> None:
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, self.port).start()

    async def _cleanup(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
