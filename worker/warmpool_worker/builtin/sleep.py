"""Engine sleep on the built-in worker: ``POST /control/sleep``, ``POST /control/wake``,
``GET /control/sleep``, authenticated like ``/control/tier``; optionally vLLM's dev-mode
``POST /sleep?level=N``, ``POST /wake_up``, ``GET /is_sleeping`` (unauthenticated, as in vLLM).

Sleep and generation never overlap: both are decided under the engine gate (`engine_gate`),
the batch's admission included.  A sleep waits for the running batch to drain and for no
request to wait (at most ``--sleep-drain-timeout`` seconds), then sleeps under the gate; if
the batch does not drain in time it is refused (409) saying what still ran, and the engine
stays awake.  Wake runs under the gate too.  While asleep the worker stays Ready (/readyz 200,
its ``sleep`` field says so): a completion that finds the engine asleep wakes it and waits, at
most ``--wake-timeout`` seconds (then 503), and its time to first token includes the wake; a
request that reaches the batch after a sleep slipped in wakes the engine before it runs.

The memory a sleep released is measured, not assumed: the process's resident set (VmRSS,
file-backed pages included, since level 2 unmaps the weight files) on CPU, the caching
allocator's allocated bytes on CUDA.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from warmpool_worker.builtin.batch_scheduler import BatchScheduler, SleepRefused
from warmpool_worker.control import ControlEndpoint
from warmpool_worker.engine_api import Engine, Sleepable
from warmpool_worker.http_app import BadRequest
from warmpool_worker.metrics import WorkerMetrics
from warmpool_worker.sleep_request import parse_level, requested_level
from warmpool_worker.worker_status import WorkerStatus

from warmpool.contract.http import (
    PATH_CONTROL_SLEEP,
    PATH_CONTROL_WAKE,
    PATH_VLLM_IS_SLEEPING,
    PATH_VLLM_SLEEP,
    PATH_VLLM_WAKE_UP,
)

log = logging.getLogger(__name__)


def memory_held_bytes(device: str, proc_status: Path = Path("/proc/self/status")) -> int | None:
    """What the engine's memory figure is now: allocator bytes on CUDA, VmRSS on CPU."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.memory_allocated(torch.device(device)))
    try:
        for line in proc_status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class SleepController:
    """Puts the engine to sleep (once the batch drained) and wakes it, under the engine gate;
    the metrics follow."""

    def __init__(self, status: WorkerStatus, metrics: WorkerMetrics, scheduler: BatchScheduler,
                 wake_timeout_s: float) -> None:
        self.status = status
        self.metrics = metrics
        self.scheduler = scheduler
        self.gate = scheduler.gate
        self.wake_timeout_s = wake_timeout_s
        scheduler.waker = self.wake_for_batch
        self.released_bytes: int | None = None
        self.last_wake_seconds: float | None = None
        self._wake_task: asyncio.Future[None] | None = None

    def _engine(self) -> Sleepable:
        engine = self.status.engine
        if engine is None or not self.status.ready:
            raise BadRequest(409, f"cannot sleep or wake before the worker is ready (stage {self.status.stage})",
                             "conflict")
        if not isinstance(engine, Sleepable):
            raise BadRequest(409, "this engine cannot sleep (no sleep support)", "conflict")
        return engine

    def sleep_level(self) -> int | None:
        engine = self.status.engine
        return engine.sleep_level if isinstance(engine, Sleepable) else None

    def describe(self) -> dict[str, Any]:
        level = self.sleep_level()
        return {"sleeping": level is not None, "level": level, "released_bytes": self.released_bytes,
                "last_wake_seconds": self.last_wake_seconds}

    def _sleep_blocking(self, engine: Sleepable, level: int) -> None:
        def go_to_sleep() -> None:  # under the gate, the batch drained
            if engine.sleep_level is not None:
                return
            device = self.status.engine.device if self.status.engine is not None else "cpu"
            before = memory_held_bytes(device)
            engine.sleep(level)
            after = memory_held_bytes(device)
            released = max(0, before - after) if before is not None and after is not None else 0
            self.released_bytes = released
            self.metrics.slept(level, released)
            log.info("engine asleep at level %d: released %.1f MiB", level, released / 2**20)

        if engine.sleep_level is not None:
            return
        try:
            self.scheduler.sleep_when_idle(go_to_sleep)
        except SleepRefused as refused:
            log.info("%s", refused)
            raise BadRequest(409, str(refused), "conflict", headers={"Retry-After": "1"}) from None

    def wake_for_batch(self) -> None:
        """The batch found the engine asleep with a request at the head of its queue (a sleep
        won the gate after that request's own wake check): wake it now, on its behalf."""
        engine = self.status.engine
        if isinstance(engine, Sleepable):
            self._wake_blocking(engine, on_request=True)

    def _wake_blocking(self, engine: Sleepable, on_request: bool) -> None:
        with self.gate:
            if engine.sleep_level is None:
                return
            started = time.perf_counter()
            engine.wake()
            seconds = time.perf_counter() - started
            self.last_wake_seconds = seconds
            self.metrics.woke(seconds, on_request)
            log.info("engine awake in %.3fs%s", seconds, " (woken by a request)" if on_request else "")

    async def sleep(self, level: int) -> None:
        engine = self._engine()
        await asyncio.to_thread(self._sleep_blocking, engine, level)

    async def wake(self, on_request: bool = False) -> None:
        """Wake (one wake at a time: concurrent callers share it), bounded by --wake-timeout."""
        engine = self._engine()
        if engine.sleep_level is None:
            return
        if self._wake_task is None or self._wake_task.done():
            self._wake_task = asyncio.ensure_future(asyncio.to_thread(self._wake_blocking, engine, on_request))
        try:
            await asyncio.wait_for(asyncio.shield(self._wake_task), timeout=self.wake_timeout_s)
        except TimeoutError:
            raise BadRequest(503, f"the engine is still waking after {self.wake_timeout_s:g}s (--wake-timeout)",
                             "unavailable", headers={"Retry-After": "1"}) from None

    async def wake_for_request(self, engine: Engine) -> None:
        """A completion arrived: if the engine sleeps, wake it and wait (bounded)."""
        if isinstance(engine, Sleepable) and engine.sleep_level is not None:
            await self.wake(on_request=True)


class SleepEndpoint:
    """The sleep routes; `mount` them on the worker's app."""

    def __init__(self, controller: SleepController, control: ControlEndpoint, vllm_api: bool) -> None:
        self.controller = controller
        self.control = control
        self.vllm_api = vllm_api

    def mount(self, app: web.Application) -> None:
        app.router.add_post(PATH_CONTROL_SLEEP, self.control_sleep)
        app.router.add_get(PATH_CONTROL_SLEEP, self.control_state)
        app.router.add_post(PATH_CONTROL_WAKE, self.control_wake)
        if self.vllm_api:
            app.router.add_post(PATH_VLLM_SLEEP, self.vllm_sleep)
            app.router.add_post(PATH_VLLM_WAKE_UP, self.vllm_wake_up)
            app.router.add_get(PATH_VLLM_IS_SLEEPING, self.vllm_is_sleeping)

    async def control_sleep(self, request: web.Request) -> web.Response:
        self.control.check_token(request)
        await self.controller.sleep(await requested_level(request))
        return web.json_response(self.controller.describe())

    async def control_wake(self, request: web.Request) -> web.Response:
        self.control.check_token(request)
        await self.controller.wake()
        return web.json_response(self.controller.describe())

    async def control_state(self, request: web.Request) -> web.Response:
        self.control.check_token(request)
        return web.json_response(self.controller.describe())

    # vLLM's dev-mode shapes: 200 with an empty body for /sleep and /wake_up,
    # {"is_sleeping": bool} for /is_sleeping.
    async def vllm_sleep(self, request: web.Request) -> web.Response:
        await self.controller.sleep(parse_level(request.query.get("level", "1")))
        return web.Response(status=200)

    async def vllm_wake_up(self, _request: web.Request) -> web.Response:
        await self.controller.wake()
        return web.Response(status=200)

    async def vllm_is_sleeping(self, _request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.controller.sleep_level() is not None})
