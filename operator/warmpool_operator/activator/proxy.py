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
A client's own ``traceparent`` parents its request's spans only: when it sent one, the hold whose
traceparent is written for the operator is a new trace of the activator's, linked to the request,
so nothing a client sends ever reaches a pod template.

Before anything is held (tenancy, shared/design.md): the path must be the serving API (exactly
``/v1/<segment>...``, no dot segments, no escapes, forwarded byte for byte as checked); the Host
must name a scale-to-zero pool whose Service and slice its WarmModel owns (activator/pools.py); the
caller must be one the pool's NetworkPolicies admit (activator/callers.py); and the body must fit
the worker's limit and the activator's byte budget, in time (activator/limits.py).  Refusals name
nothing of other pools, namespaces or pod addresses: the detail goes to the activator's log.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Gauge, Histogram
from yarl import URL

from warmpool.contract.http import MAX_REQUEST_BODY_BYTES
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
from warmpool.contract.zero import (
    ERROR_HOLD_FULL,
    ERROR_HOLD_TIMEOUT,
    ERROR_MISDIRECTED,
    ERROR_NOT_SERVING_API,
    ERROR_UPSTREAM,
)
from warmpool_operator.activator.callers import Callers
from warmpool_operator.activator.demand import Demand
from warmpool_operator.activator.limits import (
    RETRY_AFTER_SECONDS,
    ByteBudget,
    ConnectionGuard,
    Refused,
    openai_error,
    read_body,
)
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

#: The outcomes a pool's alert on refusals reads (429 maxHeldRequests, 503 holdTimeoutSeconds).
REFUSED_OUTCOMES = ("rejected_full", "timed_out")


def show_pool(key: tuple[str, str]) -> None:
    """A scale-to-zero pool this replica learned of: its held gauge and refusal counters exist at 0
    from now on, so the first refusal is an increase Prometheus sees (a series born at 1 is not)."""
    HELD.labels(*key)
    for outcome in REFUSED_OUTCOMES:
        REQUESTS.labels(*key, outcome)


#: Headers that belong to one connection, never forwarded (RFC 9110 7.6.1), and the ones aiohttp sets.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "content-length", "host"})
#: W3C trace context's header (lower case, as HOP_BY_HOP): a client's trace is the held request's parent.
TRACEPARENT_HEADER = "traceparent"
#: The paths forwarded: the serving API's, segment by segment, with nothing a server or a client
#: library would rewrite (no "." or ".." segment, no %-escape, no backslash, no empty segment).
SERVING_PATH = re.compile(r"/v1(?:/[A-Za-z0-9_~-][A-Za-z0-9._~-]*)+", re.ASCII)
#: Default bounds (the command line sets them): a body of the worker's limit, bytes held across
#: all pools (64 bodies of the largest size), and how long a body may take to arrive.
DEFAULT_BYTE_BUDGET = 64 * MAX_REQUEST_BODY_BYTES
DEFAULT_BODY_TIMEOUT_SECONDS = 30.0
#: A pod that refuses the connection (it just went away) is retried on the next one this often.
FORWARD_TRIES = 3
#: Connecting to a pod on the node's network takes milliseconds; a pod that does not answer in
#: this long is taken for gone.  The answer itself may take as long as generation does.
FORWARD_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=3.0)


def serving_path(raw: str) -> str | None:
    """The request target to forward (path and query, exactly as sent), or None when its path is
    not the serving API's in the one spelling that no server or client rewrites."""
    path, _, query = raw.partition("?")
    if not SERVING_PATH.fullmatch(path) or "#" in query or any(ch.isspace() for ch in query):
        return None
    return raw


class Activator:
    """One replica's holds, per pool; the aiohttp handler is :meth:`handle`."""

    def __init__(self, pools: Pools, demand: Demand, session: aiohttp.ClientSession,
                 clock: Callable[[], float] = time.monotonic, tracing: Tracing | None = None,
                 callers: Callers | None = None, guard: ConnectionGuard | None = None,
                 budget: ByteBudget | None = None, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_SECONDS) -> None:
        self.pools, self.demand, self.session, self.clock = pools, demand, session, clock
        self.tracing = tracing or Tracing()
        self.callers = callers or Callers()
        self.guard = guard
        self.budget = budget or ByteBudget(DEFAULT_BYTE_BUDGET)
        self.body_timeout_s = body_timeout_s
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
        if self.guard is not None:
            self.guard.request_started(request.transport)
        try:
            return await self._checked(request, arrived)
        finally:
            if self.guard is not None:
                self.guard.request_finished(request.transport)

    async def _checked(self, request: web.Request, arrived: float) -> web.StreamResponse:
        target = serving_path(request.raw_path)
        if target is None:
            REQUESTS.labels("", "", "not_serving_api").inc()
            return openai_error(404, "the activator forwards only the serving API (/v1/...)", ERROR_NOT_SERVING_API)
        ip = request.remote or ""
        await self.callers.settle(ip)
        try:
            key = self.pools.resolve(request.host, self.callers.namespace_of(ip))
            if not self.callers.may_reach(ip, self.pools.target(key)):
                raise Misdirected(f"{ip} may not reach WarmModel {key[0]}/{key[1]}'s pods (its NetworkPolicies)")
        except Misdirected as error:
            log.info("refused a request from %s for Host %r: %s", ip, request.host, error.reason)
            REQUESTS.labels("", "", "misdirected").inc()
            return openai_error(421, str(error), ERROR_MISDIRECTED)
        taken: list[int] = []  # bytes of the budget this request holds, given back however it ends
        try:
            try:
                body = await read_body(request, MAX_REQUEST_BODY_BYTES, self.body_timeout_s, self.budget, taken)
            except Refused as refused:
                REQUESTS.labels(*key, "refused_body").inc()
                refused.response.force_close()
                return refused.response
            client_trace = request.headers.get(TRACEPARENT_HEADER)
            with self.tracing.span(SPAN_HELD_REQUEST, {ATTR_WARMMODEL: "/".join(key)},
                                   parent=client_trace if valid_traceparent(client_trace) else None):
                response = await self._hold_and_forward(request, target, body, key, arrived,
                                                        client_traced=valid_traceparent(client_trace))
                self.tracing.set_attribute(ATTR_OUTCOME, response.status)
                return response
        finally:
            self.budget.give(sum(taken))

    async def _hold_and_forward(self, request: web.Request, target: str, body: bytes, key: PoolKey,
                                arrived: float, client_traced: bool) -> web.StreamResponse:
        pool = self.pools.pool(key)
        if pool.pods:  # the switch to the pods is under way: this connection was opened before it
            return await self._forward_or_error(request, target, body, key, pool, arrived, held=False)
        policy = pool.policy
        if self.held.get(key, 0) >= policy.max_held:
            REQUESTS.labels(*key, "rejected_full").inc()
            return openai_error(429, f"WarmModel {key[0]}/{key[1]} is at zero and {policy.max_held} requests are "
                                f"already held for it (maxHeldRequests): retry in {RETRY_AFTER_SECONDS}s",
                                ERROR_HOLD_FULL, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        # A client's trace never reaches a pod template: its hold is then a trace of our own, linked.
        with self.tracing.span(SPAN_HOLD, new_trace=client_traced):
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
        return await self._forward_or_error(request, target, body, key, pool, arrived, held=True)

    async def _forward_or_error(self, request: web.Request, target: str, body: bytes, key: PoolKey, pool: Pool,
                                arrived: float, held: bool) -> web.StreamResponse:
        with self.tracing.span(SPAN_FORWARD):
            return await self._forward_to_a_pod(request, target, body, key, pool, arrived if held else None)

    async def _forward_to_a_pod(self, request: web.Request, target: str, body: bytes, key: PoolKey, pool: Pool,
                                arrived: float | None) -> web.StreamResponse:
        for _ in range(FORWARD_TRIES):
            base = pool.next_pod()
            if base is None:
                break
            try:
                response = await self._forward(request, target, body, base, key, arrived)
            except (aiohttp.ClientConnectionError, TimeoutError) as error:
                log.info("%s/%s: forwarding to %s failed before an answer (%s: %s): next pod", *key, base,
                         type(error).__name__, error)
                continue
            REQUESTS.labels(*key, "forwarded").inc()
            return response
        REQUESTS.labels(*key, "error").inc()
        return openai_error(502, f"WarmModel {key[0]}/{key[1]}: no pod took the request (the activator's log has "
                            "the detail)", ERROR_UPSTREAM)

    async def _forward(self, request: web.Request, target: str, body: bytes, base: str, key: PoolKey,
                       arrived: float | None) -> web.StreamResponse:
        """Send the request to one pod and stream its answer back; raises only before the answer began."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        trace = self.tracing.traceparent()
        if trace is not None:  # the pod's side of the answer joins the held request's trace
            headers = {k: v for k, v in headers.items() if k.lower() != TRACEPARENT_HEADER}
            headers[TRACEPARENT_HEADER] = trace
        # The target as checked, byte for byte: encoded=True keeps the client library from rewriting it.
        async with self.session.request(request.method, URL(base + target, encoded=True), data=body or None,
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

