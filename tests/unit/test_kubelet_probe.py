"""Probe settings, the threshold state machine, and the probe checks against a loopback server."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from warmpool_devcluster.kubelet import Backoff
from warmpool_devcluster.kubelet_probe import ProbeContext, ProbeSpec, ProbeTracker, resolve_port, run_probe

pytestmark = pytest.mark.unit


def test_defaults_follow_the_api() -> None:
    spec = ProbeSpec.from_k8s({"httpGet": {"port": 80}}, "readiness")
    assert (spec.handler, spec.initial_delay, spec.period, spec.timeout) == ("httpGet", 0, 10, 1)
    assert (spec.success_threshold, spec.failure_threshold) == (1, 3)
    liveness = ProbeSpec.from_k8s({"tcpSocket": {"port": 1}, "successThreshold": 5}, "liveness")
    assert liveness.success_threshold == 1  # forced to 1 for liveness and startup


def test_readiness_needs_consecutive_successes_and_failures() -> None:
    spec = ProbeSpec.from_k8s({"httpGet": {"port": 1}, "successThreshold": 2, "failureThreshold": 2}, "readiness")
    tracker = ProbeTracker(spec, "readiness")
    assert tracker.result is False  # not ready until probes pass
    assert [tracker.observe(ok) for ok in (True, False, True, True, False, True, False, False)] == [
        False, False, False, True, True, True, True, False]


def test_liveness_starts_passed_and_startup_unknown() -> None:
    spec = ProbeSpec.from_k8s({"exec": {"command": ["true"]}, "failureThreshold": 3}, "liveness")
    tracker = ProbeTracker(spec, "liveness")
    assert tracker.result is True
    assert [tracker.observe(False) for _ in range(3)] == [True, True, False]
    startup = ProbeTracker(ProbeSpec.from_k8s({"exec": {}, "failureThreshold": 2}, "startup"), "startup")
    assert startup.result is None
    assert startup.observe(False) is None
    assert startup.observe(True) is True


def test_crash_loop_backoff_sequence() -> None:
    backoff = Backoff(10, 300)
    delays = [backoff.next_delay(ran_for=1) for _ in range(8)]
    assert delays == [0, 10, 20, 40, 80, 160, 300, 300]
    assert backoff.next_delay(ran_for=600) == 0  # a long healthy run resets it


def test_named_ports() -> None:
    container = {"ports": [{"name": "http", "containerPort": 8080}]}
    assert resolve_port("http", container) == 8080
    assert resolve_port(9000, container) == 9000
    assert resolve_port("9001", container) == 9001
    with pytest.raises(ValueError):
        resolve_port("grpc", container)


@pytest.fixture()
async def server() -> AsyncIterator[int]:
    async def ready(request: web.Request) -> web.Response:
        status = 200 if request.headers.get("X-Probe") == "yes" else 503
        return web.Response(status=status, text=request.headers.get("User-Agent", ""))

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(3)
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/ready", ready)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield port
    finally:
        await runner.cleanup()


async def test_http_tcp_exec_probes(server: int) -> None:
    container = {"ports": [{"name": "web", "containerPort": server}]}
    async with aiohttp.ClientSession() as session:
        ctx = ProbeContext("127.0.0.1", container, dict(os.environ), None, session)

        def http(path: str, **extra: object) -> ProbeSpec:
            return ProbeSpec.from_k8s({"httpGet": {"path": path, "port": "web", **extra}}, "readiness")

        ok, message = await run_probe(http("/ready"), ctx)
        assert (ok, message) == (False, "HTTP probe returned 503")
        headers = [{"name": "X-Probe", "value": "yes"}]
        assert (await run_probe(http("/ready", httpHeaders=headers), ctx))[0] is True
        ok, message = await run_probe(http("/slow"), ctx)  # timeoutSeconds defaults to 1
        assert not ok and "Timeout" in message
        ok, message = await run_probe(http("/ready", host="192.168.1.1"), ctx)
        assert not ok and "non-loopback" in message  # never dial a private address

        tcp = ProbeSpec.from_k8s({"tcpSocket": {"port": server}}, "liveness")
        assert (await run_probe(tcp, ctx))[0] is True
        closed = ProbeSpec.from_k8s({"tcpSocket": {"port": 1}}, "liveness")
        assert (await run_probe(closed, ctx))[0] is False

        exec_spec = ProbeSpec.from_k8s({"exec": {"command": ["x"]}}, "liveness")
        assert (await run_probe(exec_spec, ctx, [sys.executable, "-c", "raise SystemExit(0)"]))[0] is True
        assert (await run_probe(exec_spec, ctx, [sys.executable, "-c", "raise SystemExit(3)"]))[0] is False
        ok, message = await run_probe(exec_spec, ctx, [sys.executable, "-c", "import time; time.sleep(5)"])
        assert not ok and "timed out" in message
