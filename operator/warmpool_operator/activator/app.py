"""``warmpool activator``: hold the requests of scale-to-zero pools at zero and forward them to the
first pod that turns warm (the chart runs it as its own Deployment, two replicas).

It watches WarmModels, the operator's Services and its pod EndpointSlices (activator/pools.py),
and, to tell who is calling and what the pools' NetworkPolicies let them reach, pods, namespaces
and nodes cluster-wide and the NetworkPolicies of the pools' namespaces (activator/callers.py);
serves the pools' traffic on ``--port`` (activator/proxy.py) within its bounds (activator/limits.py),
writes its held counts to the WarmModels (activator/demand.py), and answers /healthz and /readyz
(ready once its watches listed) on ``--health-port`` and Prometheus metrics on ``--metrics-port``; with
``OTEL_EXPORTER_OTLP_ENDPOINT`` set, a trace per held request (activator/proxy.py).  On SIGTERM it stops
being ready, goes on serving what it holds for up to ``--drain-seconds``, removes its held-count
annotations and exits: a client whose request it still held then sees its connection close at
once, never a hang.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import start_http_server

from warmpool.contract.api import API_GROUP, API_VERSION, PLURAL
from warmpool.contract.pods import LABEL_MANAGED_BY, MANAGED_BY
from warmpool.contract.telemetry import LOG_FORMAT_TEXT, LOG_FORMATS, TRACE_SERVICE_ACTIVATOR
from warmpool.contract.zero import DEFAULT_ACTIVATOR_PORT, ENDPOINTSLICE_MANAGER, LABEL_ENDPOINTSLICE_MANAGED_BY
from warmpool.kube import KubeClient, client_from_environment
from warmpool.logformat import add_log_level_flag, configure_logging
from warmpool_operator.activator.callers import Callers
from warmpool_operator.activator.demand import Demand
from warmpool_operator.activator.limits import ByteBudget, ConnectionGuard
from warmpool_operator.activator.pools import Pools
from warmpool_operator.activator.proxy import (
    DEFAULT_BODY_TIMEOUT_SECONDS,
    DEFAULT_BYTE_BUDGET,
    Activator,
    show_pool,
)
from warmpool_operator.io.list_watch import list_watch
from warmpool_operator.io.tracing import Tracing

log = logging.getLogger("warmpool.activator")

#: Connections open at once, over all pools (each costs a few KiB until its head arrives).
DEFAULT_MAX_CONNECTIONS = 1000
#: Seconds a connection may take to send a request head (after it opened, or after its last answer).
DEFAULT_HEADER_TIMEOUT_SECONDS = 10.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmpool activator", description=__doc__.split("\n\n")[0])
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch WarmModels cluster-wide")
    parser.add_argument("--port", type=int, default=DEFAULT_ACTIVATOR_PORT, help="the pools' traffic (HTTP)")
    parser.add_argument("--health-port", type=int, default=8081, help="GET /healthz and /readyz; 0: none")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics; 0: none")
    parser.add_argument("--bind", default="0.0.0.0", help="address every port binds")
    parser.add_argument("--drain-seconds", type=float, default=20.0,
                        help="on SIGTERM, how long held and in-flight requests may still finish")
    parser.add_argument("--pod-name", default=os.environ.get("POD_NAME") or os.uname().nodename,
                        help="this replica's name in its held-count annotation (default: $POD_NAME)")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="connections open at once over all pools; past it: 503 with Retry-After")
    parser.add_argument("--max-held-bytes", type=int, default=DEFAULT_BYTE_BUDGET,
                        help="bytes of request bodies kept at once over all pools; past it: 503 with Retry-After")
    parser.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_SECONDS,
                        help="seconds a connection may take to send a request head; then it is closed")
    parser.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_SECONDS,
                        help="seconds a request body may take to arrive; then 408")
    add_log_level_flag(parser)
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=LOG_FORMAT_TEXT)
    return parser


def _collections(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(kind, collection path, label selector) of every watch, per namespace or cluster-wide."""
    scopes = [""] if args.all_namespaces else [f"/namespaces/{ns}" for ns in args.namespace]
    # Callers may be pods of any namespace (a gateway's, say): who they are is read cluster-wide.
    out = [("pod", "/api/v1/pods", ""), ("namespace", "/api/v1/namespaces", ""), ("node", "/api/v1/nodes", "")]
    for scope in scopes:
        out += [
            ("warmmodel", f"/apis/{API_GROUP}/{API_VERSION}{scope}/{PLURAL}", ""),
            ("service", f"/api/v1{scope}/services", f"{LABEL_MANAGED_BY}={MANAGED_BY}"),
            ("endpointslice", f"/apis/discovery.k8s.io/v1{scope}/endpointslices",
             f"{LABEL_ENDPOINTSLICE_MANAGED_BY}={ENDPOINTSLICE_MANAGER}"),
            ("networkpolicy", f"/apis/networking.k8s.io/v1{scope}/networkpolicies", ""),
        ]
    return out


async def _health_app(synced: list[asyncio.Event], stopping: asyncio.Event) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(_: web.Request) -> web.Response:
        # Readiness only: what is held, for whom, is in the metrics (whose port the chart restricts).
        ready = all(event.is_set() for event in synced) and not stopping.is_set()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def serve(args: argparse.Namespace, client: KubeClient, tracing: Tracing | None = None) -> None:
    pools = Pools()
    callers = Callers()
    demand = Demand(client, args.pod_name)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    loop.add_signal_handler(signal.SIGINT, stopping.set)
    def warmmodel(event: str, body: Mapping[str, Any]) -> None:
        pools.warmmodel(event, body)
        if event != "DELETED":
            meta = body.get("metadata") or {}
            key = (str(meta.get("namespace")), str(meta.get("name")))
            if pools.pool(key).scale_to_zero:
                show_pool(key)
            demand.adopt((str(meta.get("namespace")), str(meta.get("name"))), meta.get("annotations") or {})

    handlers = {"warmmodel": (warmmodel, lambda: None), "service": (pools.service, lambda: None),
                "endpointslice": (pools.endpoint_slice, pools.relisted_endpoint_slices),
                "pod": (callers.pod, callers.relisted_pods), "namespace": (callers.namespace, lambda: None),
                "node": (callers.node, callers.relisted_nodes),
                "networkpolicy": (callers.network_policy, callers.relisted_network_policies)}
    synced: list[asyncio.Event] = []
    watches: list[asyncio.Task[None]] = []
    for kind, path, selector in _collections(args):
        event = asyncio.Event()
        synced.append(event)
        on_event, on_list = handlers[kind]
        if kind in ("endpointslice", "networkpolicy") and "/namespaces/" in path:
            # One watch per namespace: its relist starts over that namespace's objects alone.
            relisted = pools.relisted_endpoint_slices if kind == "endpointslice" else callers.relisted_network_policies
            on_list = functools.partial(relisted, path.split("/namespaces/")[1].split("/")[0])
        watches.append(asyncio.create_task(list_watch(client, path, selector or None, on_event, on_list, event)))
    # No pooled connection outlives a pod: each forward dials afresh (milliseconds on the node's network).
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        guard = ConnectionGuard(args.max_connections, args.header_timeout)
        activator = Activator(pools, demand, session, tracing=tracing, callers=callers, guard=guard,
                              budget=ByteBudget(args.max_held_bytes), body_timeout_s=args.body_timeout)
        app = web.Application()  # bodies are read by the handler, under its own bounds
        app.router.add_route("*", "/{path:.*}", activator.handle)
        # handler_cancellation: a client that hangs up cancels its handler, which drops it from the hold.
        runners = [web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)]
        await runners[0].setup()
        assert runners[0].server is not None
        data_server = await loop.create_server(guard.protocol_factory(runners[0].server), args.bind, args.port,
                                               reuse_address=True)
        if args.health_port > 0:
            runners.append(web.AppRunner(await _health_app(synced, stopping), access_log=None))
            await runners[1].setup()
            await web.TCPSite(runners[1], args.bind, args.health_port).start()
        log.info("activator %s serving on %s:%d (watching %s)", args.pod_name, args.bind, args.port,
                 "every namespace" if args.all_namespaces else ", ".join(args.namespace))
        await stopping.wait()
        log.info("SIGTERM: not ready; %d request(s) held, up to %gs to finish", activator.held_total(),
                 args.drain_seconds)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(args.drain_seconds):
                await activator.none_held.wait()
        data_server.close()
        for runner in runners:
            await runner.cleanup()
        for task in watches:
            task.cancel()
        await demand.clear_all()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for port in (args.port, args.health_port, args.metrics_port):
        if not 0 <= port <= 65535:
            print(f"warmpool activator: port {port} is not 0-65535", file=sys.stderr)
            return 2
    for flag, value in (("--max-connections", args.max_connections), ("--max-held-bytes", args.max_held_bytes),
                        ("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not value > 0:
            print(f"warmpool activator: {flag} must be above 0, got {value}", file=sys.stderr)
            return 2
    if args.port == 0:
        print("warmpool activator: --port must not be 0", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format)
    if args.metrics_port > 0:
        start_http_server(args.metrics_port, addr=args.bind)

    # OTEL_EXPORTER_OTLP_ENDPOINT set: a trace per held request, which the passes and pods it starts join.
    tracing = Tracing.from_env(TRACE_SERVICE_ACTIVATOR)

    async def run() -> None:
        client = KubeClient(await client_from_environment())
        try:
            await serve(args, client, tracing)
        finally:
            await client.close()
            tracing.shutdown()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
