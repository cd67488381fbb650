"""Every HTTP call the operator makes to a worker pod: ``GET /metrics`` and the authenticated
control calls ``POST /control/tier``, ``/control/sleep`` and ``/control/wake``.

Bodies are read whole, to EOF, under a byte bound (:mod:`warmpool.http_body`), then parsed
(io/worker_metrics.py); a refused control call's error body is read under a bound too, so a
worker that answers with megabytes costs the operator nothing.  Nothing here raises for a
worker's failure: a scrape gives a :class:`~warmpool_operator.model.Sample` with ``error`` set,
a control call gives the reason it failed (None when it succeeded).

:class:`WorkerClient` binds the session and the bounds; the reconcilers and the scrape
scheduler reach workers only through it, so a unit test stands in for every worker pod with
one small fake of this class.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
import urllib.parse
from collections.abc import Iterable, Mapping

import aiohttp

from warmpool.contract.api import Tier
from warmpool.contract.http import (
    CONTROL_FIELD_SLEEP_LEVEL,
    CONTROL_FIELD_TIER,
    CONTROL_FIELD_TRACEPARENT,
    CONTROL_FIELD_TTL,
    CONTROL_TOKEN_HEADER,
)
from warmpool.http_body import BodyTooLarge, read_bounded_text
from warmpool_operator.io.worker_metrics import parse_metrics
from warmpool_operator.model import Sample

#: Largest metrics body we read (a worker's is a few kB; per-layer heat of a big model ~20 kB).
MAX_BODY_BYTES = 2 * 1024 * 1024
#: Largest error body of a refused control call we read (we keep 200 characters of it).
MAX_DIRECTIVE_ERROR_BYTES = 16 * 1024
#: Longest a sleep or a wake call may take (a level-2 wake re-reads the weights from the files).
CONTROL_TIMEOUT = 120.0


def worker_url(ip: str, port: int, path: str) -> str:
    """The URL of ``path`` on a worker pod (an IPv6 address in brackets)."""
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{path}"


async def scrape_one(session: aiohttp.ClientSession, url: str, limit: float) -> Sample:
    sent_at = time.monotonic()
    sample = await _scrape(session, url, limit)
    sample.sent_at = sent_at
    return sample


async def _scrape(session: aiohttp.ClientSession, url: str, limit: float) -> Sample:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=limit, connect=limit)) as response:
            if response.status != 200:
                return Sample(error=f"http {response.status}")
            text = await read_bounded_text(response, MAX_BODY_BYTES)
    except BodyTooLarge as error:
        return Sample(error=f"garbage: {error}")
    except TimeoutError:
        return Sample(error="timeout")
    except aiohttp.ClientPayloadError as error:
        # The connection ended before the body did (e.g. short of its Content-Length).
        return Sample(error=f"truncated: {str(error)[:120]}")
    except aiohttp.ClientConnectorError as error:
        # Refused: the pod's network answered (a worker still starting, or restarting), so its node
        # is alive; anything else (no route, unreachable host) may be a node that is gone.
        refused = error.os_error.errno == errno.ECONNREFUSED
        return Sample(error=f"{'refused' if refused else 'unreachable'}: {type(error).__name__}")
    except aiohttp.ClientError as error:
        return Sample(error=f"unreachable: {type(error).__name__}")
    except OSError as error:
        return Sample(error=_connection_failure(error))
    return parse_metrics(text)


def _connection_failure(error: OSError) -> str:
    """A scrape's error for a connection that failed: refused (the pod's host answered), or not."""
    return f"{'refused' if error.errno == errno.ECONNREFUSED else 'unreachable'}: {error.strerror or error}"


async def knock(url: str, limit: float) -> Sample:
    """Whether the host of a worker's ``url`` answers at all: a TCP connection to its port, opened
    and closed at once (no request: the worker's own load cannot slow the answer, the kernel gives
    it), ``sent_at`` stamped, errors as a scrape's ("timeout", "refused: ...", "unreachable: ...")."""
    sent_at = time.monotonic()
    parts = urllib.parse.urlsplit(url)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port), limit)
    except TimeoutError:
        sample = Sample(error="timeout")
    except OSError as error:
        sample = Sample(error=_connection_failure(error))
    else:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        sample = Sample()
    sample.sent_at = sent_at
    return sample


def tier_body(tier: Tier, ttl: float, traceparent: str | None = None) -> dict[str, object]:
    """A tier directive; ``traceparent``: the deciding pass's trace context, so the worker's
    reaction joins its trace."""
    body: dict[str, object] = {CONTROL_FIELD_TIER: tier.value, CONTROL_FIELD_TTL: ttl}
    if traceparent is not None:
        body[CONTROL_FIELD_TRACEPARENT] = traceparent
    return body


def token_refused(error: str | None) -> bool:
    """Whether :func:`post_control`'s answer says the worker refused the control token."""
    return error is not None and error.startswith(("http 401:", "http 403:"))


async def post_control(
    session: aiohttp.ClientSession, url: str, token: str, body: Mapping[str, object], limit: float
) -> str | None:
    """POST a JSON body to one of a worker's authenticated control endpoints (tier, sleep,
    wake); None on success, else why not (status and the head of the worker's answer)."""
    headers = {CONTROL_TOKEN_HEADER: f"Bearer {token}"}
    try:
        async with session.post(
            url, json=dict(body), headers=headers, timeout=aiohttp.ClientTimeout(total=limit)
        ) as response:
            if response.status < 300:
                return None
            status = response.status
            try:
                detail = (await read_bounded_text(response, MAX_DIRECTIVE_ERROR_BYTES))[:200]
            except BodyTooLarge as error:
                detail = f"({error})"
            except aiohttp.ClientPayloadError:
                detail = "(body cut short)"
            return f"http {status}: {detail}"
    except TimeoutError:
        return "timeout"
    except (aiohttp.ClientError, OSError) as error:
        return f"unreachable: {type(error).__name__}"


class WorkerClient:
    """The operator's one way to worker pods: a session (never through a proxy from the
    environment) and the bounds every call runs under."""

    def __init__(self, session: aiohttp.ClientSession, timeout: float, concurrency: int = 16) -> None:
        self.session = session
        #: seconds a scrape or a tier directive may take (connect + read)
        self.timeout = timeout
        #: control calls of one batch in flight at once (tier directives of one pool)
        self.concurrency = concurrency

    @classmethod
    def open(cls, timeout: float, concurrency: int) -> WorkerClient:
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout),
            connector=aiohttp.TCPConnector(limit=concurrency * 2, force_close=True),
            trust_env=False,  # never send scrapes through a proxy from the environment
        )
        return cls(session, timeout, concurrency)

    async def close(self) -> None:
        await self.session.close()

    async def metrics(self, url: str) -> Sample:
        """One scrape of a worker's /metrics (``sent_at`` stamped)."""
        return await scrape_one(self.session, url, self.timeout)

    async def post(self, url: str, token: str, body: Mapping[str, object], limit: float) -> str | None:
        """One control call; None on success, else why not."""
        return await post_control(self.session, url, token, body, limit)

    async def send_tiers(self, directives: Iterable[tuple[str, str, Tier]], token: str, ttl: float,
                         traceparent: str | None = None) -> dict[str, str | None]:
        """Send (key, url, tier) directives, bounded in concurrency; key -> error or None."""
        gate = asyncio.Semaphore(max(1, self.concurrency))

        async def one(key: str, url: str, tier: Tier) -> tuple[str, str | None]:
            async with gate:
                return key, await self.post(url, token, tier_body(tier, ttl, traceparent), self.timeout)

        return dict(await asyncio.gather(*(one(k, u, t) for k, u, t in directives)))

    async def sleep(self, url: str, token: str, level: int) -> str | None:
        """``POST /control/sleep {"level": N}``: answers once the engine sleeps."""
        return await self.post(url, token, {CONTROL_FIELD_SLEEP_LEVEL: level}, CONTROL_TIMEOUT)

    async def wake(self, url: str, token: str) -> str | None:
        """``POST /control/wake``: answers once the engine is awake and checked by the worker."""
        return await self.post(url, token, {}, CONTROL_TIMEOUT)
