"""The HTTP plumbing the built-in worker and the sidecar share (aiohttp).

Errors as JSON (`BadRequest`, `json_errors`: a bad request is a 4xx with
``{"error": {"message", "type", "param"}}`` naming the problem, an unexpected one a 500, and
the server goes on serving), and the start and stop of the site both modes serve on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)


class BadRequest(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.headers = headers


def error_response(
    status: int, message: str, kind: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param}}, status=status, headers=headers
    )


@web.middleware
async def json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error as JSON; an unexpected one is a 500 and the server keeps serving."""
    try:
        return await handler(request)
    except BadRequest as error:
        return error_response(error.status, error.message, error.kind, error.param, error.headers)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return error_response(error.status, f"{error.reason}: {request.method} {request.path}", "http_error")
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return error_response(500, "internal error (see the worker's log)", "internal_error")



# -- serving: the start-up and stop shared by the built-in worker and the sidecar ---------------


async def start_site(
    app: web.Application, host: str, port: int, logger: logging.Logger
) -> tuple[web.AppRunner, list[Any]] | None:
    """Serve ``app`` on host:port: the runner and the bound addresses (the real port for port 0).

    None when the address cannot be bound: said in ``logger``, the runner cleaned up.
    """
    # handler_cancellation: a client that disconnects cancels its handler at once (by default
    # aiohttp lets the handler run on), which is what stops its generation.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as error:
        logger.error("cannot bind %s:%s: %s", host, port, error)
        await runner.cleanup()
        return None
    return runner, [s.getsockname() for s in getattr(site._server, "sockets", [])]


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set ``stop`` (the graceful way out), where the loop supports it."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)


async def cancel_tasks(tasks: Iterable[asyncio.Task[None] | None]) -> None:
    """Cancel each background task and wait for it to end, whatever it raises."""
    for task in tasks:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
