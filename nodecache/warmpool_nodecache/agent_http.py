"""The node agent's own endpoints: Prometheus metrics on ``--metrics-port`` and the kubelet's
probes on ``--health-port`` (``/healthz``: the agent's event loop answers; ``/readyz``: it has
finished a pass, its first lists of WarmModels and pods answered).

The counters (names from :mod:`warmpool.contract.metrics`) use prometheus_client's default
registry: it is the agent process's only one, and carries the process collector for free.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import Counter, start_http_server

from warmpool.contract.http import PATH_READYZ
from warmpool.contract.metrics import (
    LABEL_NAMESPACE,
    LABEL_STAGE,
    LABEL_WARMMODEL,
    METRIC_NODE_AGENT_FILL_FAILURES,
    METRIC_NODE_AGENT_FILLS,
    NODE_AGENT_STAGE_BLOCKS,
    NODE_AGENT_STAGE_MANIFEST,
)

#: The liveness path, as the operator's and the activator's (the chart's probes name it).
PATH_HEALTHZ = "/healthz"

FILL_FAILURES = Counter(
    METRIC_NODE_AGENT_FILL_FAILURES,
    "Fills of this node's cache that failed, by stage: reading the revision's manifest, or its blocks",
    [LABEL_NAMESPACE, LABEL_WARMMODEL, LABEL_STAGE],
)
FILLS = Counter(
    METRIC_NODE_AGENT_FILLS,
    "Revisions this agent published into the node's cache",
    [LABEL_NAMESPACE, LABEL_WARMMODEL],
)


def show_model(namespace: str, warmmodel: str) -> None:
    """A WarmModel this agent serves: its counters exist at 0 from now on, so its first failed fill
    is an increase Prometheus sees (a series born at 1 is not)."""
    FILLS.labels(namespace, warmmodel)
    for stage in (NODE_AGENT_STAGE_MANIFEST, NODE_AGENT_STAGE_BLOCKS):
        FILL_FAILURES.labels(namespace, warmmodel, stage)


def serve_metrics(bind: str, port: int) -> None:
    """Start the metrics endpoint in a background thread (port 0: not at all)."""
    if port > 0:
        start_http_server(port, addr=bind)


async def serve_probes(bind: str, port: int, ready: Callable[[], bool]) -> web.AppRunner | None:
    """Serve /healthz and /readyz on ``port`` from the agent's own event loop (port 0: not at all):
    a loop that is stuck answers neither, and the kubelet restarts the agent."""
    if port <= 0:
        return None

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="no pass finished yet\n")

    app = web.Application()
    app.router.add_get(PATH_HEALTHZ, healthz)
    app.router.add_get(PATH_READYZ, readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, bind, port).start()
    return runner
