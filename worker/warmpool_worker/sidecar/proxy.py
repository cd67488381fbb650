"""The pool's traffic through the sidecar: every OpenAI-compatible path (``/v1/...``) is passed on
to the engine over the pod's loopback, its answer streamed back as it comes.

The WarmModel's Service points at the sidecar's port (the one the readiness probe and the
operator's scrapes use), so this is how requests reach the engine, and why the engine may listen
on 127.0.0.1 alone: what else it serves (vLLM's dev-mode ``/sleep``, ``/wake_up``,
``/reset_prefix_cache``, without authentication) is then reachable from inside the pod only.
Only ``/v1/`` paths pass, decided on the path as the engine will read it and sent exactly as
decided (:mod:`warmpool_worker.sidecar.engine_path`); the client's own headers (its API key among
them) go through as sent.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import aiohttp
from aiohttp import web
from warmpool_worker.http_app import BadRequest, error_response
from warmpool_worker.sidecar.engine_path import FORWARDED_PREFIX, engine_target
from yarl import URL

log = logging.getLogger(__name__)

#: Connection-level headers, never passed on (RFC 9110 7.6.1), and those aiohttp sets itself.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"})
#: A generation may take minutes: only the connection to the engine is bounded.
CONNECT_TIMEOUT_S = 5.0


def _passed(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


class EngineProxy:
    """``mount`` it on the sidecar's app; the session lives as long as the app."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url.rstrip("/")
        #: the configured URL, encoded once here: what the decided target is appended to
        self._engine_base = str(URL(engine_url)).rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    def mount(self, app: web.Application) -> None:
        app.router.add_route("*", FORWARDED_PREFIX + "{tail:.*}", self.forward)
        app.on_cleanup.append(self._close)

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
                trust_env=False,  # the engine is on the pod's loopback: never through a proxy
                auto_decompress=False,  # the body passes as the engine encoded it
            )
        return self._session

    async def forward(self, request: web.Request) -> web.StreamResponse:
        try:
            target = engine_target(request.rel_url.raw_path, request.rel_url.raw_query_string)
        except BadRequest as refused:
            return error_response(refused.status, refused.message, refused.kind)
        # encoded=True: the target is sent as decided; a URL parsed from a string would have its
        # dot segments resolved again by the client, after the decision.
        url = URL(self._engine_base + target, encoded=True)
        try:
            upstream = await self._client().request(
                request.method, url, data=await request.read(), headers=_passed(request.headers),
                allow_redirects=False)
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            return error_response(502, f"the engine at {self.engine_url} did not answer: {type(error).__name__}",
                                  "engine_unavailable")
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                          headers=_passed(upstream.headers))
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                # The client hung up: leaving here closes the engine's connection, which stops it.
                log.info("client hung up on %s %s", request.method, request.path)
                return response
            except aiohttp.ClientPayloadError:
                log.warning("the engine's answer to %s %s was cut short", request.method, request.path)
                return response
            await response.write_eof()
        return response
