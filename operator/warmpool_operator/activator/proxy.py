"""The activator's data path: hold a request for a pool with no awake warm pod, then forward it.

A request arrives here only while the pool's Service routes to the activator (the operator's
EndpointSlices, rules/zero.py).  It is held, bounded in count (``maxHeldRequests``, then 429 with
Retry-After) and in time (``holdTimeoutSeconds``, then 503 naming the WarmModel and what it waited
for), while demand.py tells the operator; the first pod that turns warm gets it, and its answer is
streamed back as it comes (server-sent events included).  A client that hangs up is dropped from
the hold at once (the server cancels its handler).  Errors are OpenAI-style JSON.

With tracing on, each request is a ``held_request`` span (a child of the client's own
``traceparent``, if it sent one) with a ``hold`` and a ``forward`` child.  The oldest open hold's
traceparent goes beside the count (demand.py): the operator's passes for the held requests, and
the cold starts of the pods they start, join its trace; the pod gets the forward's traceparent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Gauge, Histogram

from warmpool.contract.metrics import (
    LABEL_NAMESPACE,
    LABEL_OUTCOME,
    LABEL_WARMMODEL,
    METRIC_ACTIVATOR_FIRST_BYTE_SECONDS,
    METRIC_ACTIVATOR_HELD,
    METRIC_ACTIVATOR_HOLD_SECONDS,
    METRIC_ACTIVATOR_REQUESTS,
)
from warmpool.contract.telemetry import (
    ATTR_OUTCOME,
    ATTR_WARMMODEL,
    SPAN_FORWARD,
    SPAN_HELD_REQUEST,
    SPAN_HOLD,
    valid_traceparent,
)
from warmpool.contract.zero import ERROR_HOLD_FULL, ERROR_HOLD_TIMEOUT, ERROR_MISDIRECTED, ERROR_UPSTREAM
from warmpool_operator.activator.demand import Demand
from warmpool_operator.activator.pools import Misdirected, Pool, PoolKey, Pools
from warmpool_operator.io.tracing import Tracing

log = logging.getLogger("warmpool.activator")

HELD = Gauge(METRIC_ACTIVATOR_HELD, "Requests this activator replica holds for the pool now",
             [LABEL_NAMESPACE, LABEL_WARMMODEL])
HOLD_SECONDS = Histogram(METRIC_ACTIVATOR_HOLD_SECONDS, "Seconds a request was held (arrival to forwarded or refused)",
                         [LABEL_NAMESPACE, LABEL_WARMMODEL],
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600))
REQUESTS = Counter(METRIC_ACTIVATOR_REQUESTS, "Requests the activator took, by what became of them",
                   [LABEL_NAMESPACE, LABEL_WARMMODEL, LABEL_OUTCOME])
FIRST_BYTE = Histogram(METRIC_ACTIVATOR_FIRST_BYTE_SECONDS,
                       "Seconds from a held request's arrival to its answer's first byte (first token when streamed)",
                       [LABEL_NAMESPACE, LABEL_WARMMODEL],
                       buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600))

#: Headers that belong to one connection, never forwarded (RFC 9110 7.6.1), and the ones aiohttp sets.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "content-length", "host"})
#: W3C trace context's header (lower case, as HOP_BY_HOP): a client's trace is the held request's parent.
TRACEPARENT_HEADER = "traceparent"
#: Retry-After of a 429: the hold is full, and a pod is on its way; a few seconds is a fair guess.
RETRY_AFTER_SECONDS = 5
#: A pod that refuses the connection (it just went away) is retried on the next one this often.
FORWARD_TRIES = 3
#: Connecting to a pod on the node's network takes milliseconds; a pod that does not answer in
#: this long is taken for gone.  The answer itself may take as long as generation does.
FORWARD_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=3.0)


def openai_error(status: int, message: str, type_: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "code": status}}, status=status,
                             headers=headers)


class Activator:
    """One replica's holds, per pool; the aiohttp handler is :meth:`handle`."""

    def __init__(self, pools: Pools, demand: Demand, session: aiohttp.ClientSession,
                 clock: Callable[[], float] = time.monotonic, tracing: Tracing | None = None) -> None:
        self.pools, self.demand, self.session, self.clock = pools, demand, session, clock
        self.tracing = tracing or Tracing()
        self.held: dict[PoolKey, int] = {}
        #: the traceparents of the holds open now, oldest first (tracing on): the operator's passes
        #: and the pods they start join the oldest one's trace
        self.hold_traces: dict[PoolKey, list[str]] = {}
        #: set while this replica holds nothing (a stopping replica waits on it)
        self.none_held = asyncio.Event()
        self.none_held.set()

    def _hold(self, key: PoolKey, delta: int, trace: str | None) -> None:
        count = self.held.get(key, 0) + delta
        self.held[key] = count
        traces = self.hold_traces.setdefault(key, [])
        if trace is not None and delta > 0:
            traces.append(trace)
        elif trace is not None:
            traces.remove(trace)
        if self.held_total():
            self.none_held.clear()
        else:
            self.none_held.set()
        HELD.labels(*key).set(count)
        self.demand.set(key, count, traces[0] if traces else None)

    def held_total(self) -> int:
        return sum(self.held.values())

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrived = self.clock()
        try:
            key = self.pools.resolve(request.host)
        except Misdirected as error:
            REQUESTS.labels("", "", "misdirected").inc()
            return openai_error(421, str(error), ERROR_MISDIRECTED)
        client_trace = request.headers.get(TRACEPARENT_HEADER)
        with self.tracing.span(SPAN_HELD_REQUEST, {ATTR_WARMMODEL: "/".join(key)},
                               parent=client_trace if valid_traceparent(client_trace) else None):
            response = await self._hold_and_forward(request, key, arrived)
            self.tracing.set_attribute(ATTR_OUTCOME, response.status)
            return response

    async def _hold_and_forward(self, request: web.Request, key: PoolKey, arrived: float) -> web.StreamResponse:
        body = await request.read()
        pool = self.pools.pool(key)
        if pool.pods:  # the switch to the pods is under way: this connection was opened before it
            return await self._forward_or_error(request, body, key, pool, arrived, held=False)
        policy = pool.policy
        if self.held.get(key, 0) >= policy.max_held:
            REQUESTS.labels(*key, "rejected_full").inc()
            return openai_error(429, f"WarmModel {key[0]}/{key[1]} is at zero and {policy.max_held} requests are "
                                f"already held for it (maxHeldRequests): retry in {RETRY_AFTER_SECONDS}s",
                                ERROR_HOLD_FULL, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        with self.tracing.span(SPAN_HOLD):
            trace = self.tracing.traceparent()
            self._hold(key, +1, trace)
            try:
                await asyncio.wait_for(pool.has_pods.wait(), max(0.0, arrived + policy.hold_timeout_s - self.clock()))
            except TimeoutError:
                REQUESTS.labels(*key, "timed_out").inc()
                HOLD_SECONDS.labels(*key).observe(self.clock() - arrived)
                return openai_error(503, f"WarmModel {key[0]}/{key[1]} had no awake warm pod after "
                                    f"{policy.hold_timeout_s:g}s (holdTimeoutSeconds): the request waited for a pod "
                                    "to wake or start; see `kubectl describe warmmodel` for why none came",
                                    ERROR_HOLD_TIMEOUT, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            except asyncio.CancelledError:
                REQUESTS.labels(*key, "client_gone").inc()
                HOLD_SECONDS.labels(*key).observe(self.clock() - arrived)
                raise
            finally:
                self._hold(key, -1, trace)
        HOLD_SECONDS.labels(*key).observe(self.clock() - arrived)
        return await self._forward_or_error(request, body, key, pool, arrived, held=True)

    async def _forward_or_error(self, request: web.Request, body: bytes, key: PoolKey, pool: Pool, arrived: float,
                                held: bool) -> web.StreamResponse:
        with self.tracing.span(SPAN_FORWARD):
            return await self._forward_to_a_pod(request, body, key, pool, arrived if held else None)

    async def _forward_to_a_pod(self, request: web.Request, body: bytes, key: PoolKey, pool: Pool,
                                arrived: float | None) -> web.StreamResponse:
        last = "no pod address"
        for _ in range(FORWARD_TRIES):
            base = pool.next_pod()
            if base is None:
                break
            try:
                response = await self._forward(request, body, base, key, arrived)
            except (aiohttp.ClientConnectionError, TimeoutError) as error:
                last = f"{base}: {type(error).__name__}: {error}"
                log.info("%s/%s: forwarding to %s failed before an answer (%s): next pod", *key, base, last)
                continue
            REQUESTS.labels(*key, "forwarded").inc()
            return response
        REQUESTS.labels(*key, "error").inc()
        return openai_error(502, f"WarmModel {key[0]}/{key[1]}: no pod took the request ({last})", ERROR_UPSTREAM)

    async def _forward(self, request: web.Request, body: bytes, base: str, key: PoolKey,
                       arrived: float | None) -> web.StreamResponse:
        """Send the request to one pod and stream its answer back; raises only before the answer began."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        trace = self.tracing.traceparent()
        if trace is not None:  # the pod's side of the answer joins the held request's trace
            headers = {k: v for k, v in headers.items() if k.lower() != TRACEPARENT_HEADER}
            headers[TRACEPARENT_HEADER] = trace
        async with self.session.request(request.method, base + request.rel_url.path_qs, data=body or None,
                                        headers=headers, timeout=FORWARD_TIMEOUT, allow_redirects=False) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    response.headers.add(name, value)
            await response.prepare(request)
            first = True
            try:
                async for chunk in upstream.content.iter_any():
                    if first and arrived is not None:
                        FIRST_BYTE.labels(*key).observe(self.clock() - arrived)
                    first = False
                    await response.write(chunk)
                await response.write_eof()
            except (aiohttp.ClientError, TimeoutError) as error:
                # The answer had begun: the client sees the connection end early, as from the pod itself.
                log.warning("%s/%s: the answer from %s broke off (%s: %s)", *key, base, type(error).__name__, error)
                if request.transport is not None:
                    request.transport.close()
            return response


def describe(activator: Activator) -> dict[str, Any]:
    """What /readyz reports besides readiness: the requests held, by pool."""
    return {f"{ns}/{name}": n for (ns, name), n in activator.held.items() if n}
