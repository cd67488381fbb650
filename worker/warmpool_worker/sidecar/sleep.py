"""The sidecar's sleep API: the built-in worker's ``/control/sleep``, ``/control/wake`` and
``GET /control/sleep`` (same token), translated to the external engine's own API.

How the sidecar knows the engine's API: the flag ``--engine-sleep-api``:

* ``vllm``   -- ``POST /sleep?level=N``, ``POST /wake_up``, ``GET /is_sleeping`` (vLLM's dev-mode
  server: ``VLLM_SERVER_DEV_MODE=1`` and ``--enable-sleep-mode``);
* ``sglang`` -- ``POST /release_memory_occupation``, ``POST /resume_memory_occupation`` (SGLang has
  one level, and no state endpoint: the sidecar keeps the state it last set);
* ``none``   -- the engine cannot sleep (llama.cpp, TGI);
* ``auto`` (default) -- once the engine answers its health probe, ``GET /is_sleeping``: a 200 with
  ``{"is_sleeping": bool}`` is vLLM; anything else (404 from llama.cpp or TGI) is no sleep API.
  SGLang is never guessed: name it.

An engine without a sleep API is reported (``warmpool_sleep_capable`` 0, /readyz's ``sleep``
field) and ``POST /control/sleep`` answers 409 naming why, so the operator never puts it to sleep.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web
from warmpool_worker.control import ControlEndpoint
from warmpool_worker.http_app import BadRequest
from warmpool_worker.metrics import WorkerMetrics
from warmpool_worker.sidecar.engine_client import EngineClient, EngineUnavailable
from warmpool_worker.sleep_request import requested_level

from warmpool.contract.http import (
    PATH_CONTROL_SLEEP,
    PATH_CONTROL_WAKE,
    PATH_VLLM_IS_SLEEPING,
    PATH_VLLM_SLEEP,
    PATH_VLLM_WAKE_UP,
)

PATH_SGLANG_RELEASE_MEMORY = "/release_memory_occupation"
PATH_SGLANG_RESUME_MEMORY = "/resume_memory_occupation"


log = logging.getLogger(__name__)

#: Seconds a sleep or wake call to the engine may take (a level-2 wake re-reads the weights).
ENGINE_SLEEP_TIMEOUT_S = 300.0


class EngineSleep:
    """The engine's sleep API as the sidecar speaks it; `mount` the control routes on its app."""

    def __init__(self, client: EngineClient, api: str, control: ControlEndpoint, metrics: WorkerMetrics,
                 probe_timeout_s: float) -> None:
        self.client = client
        self.api = api  # auto until resolved
        self.control = control
        self.metrics = metrics
        self.probe_timeout_s = probe_timeout_s
        self.reason: str | None = None  # why it cannot sleep
        self.level: int | None = None  # what the sidecar last set (SGLang has no state endpoint)
        self._lock = asyncio.Lock()
        if api == "none":
            self._unable("--engine-sleep-api none")
        elif api != "auto":
            self.metrics.sleep_capable.set(1)

    def _unable(self, why: str) -> None:
        self.api = "none"
        self.reason = why
        self.metrics.sleep_capable.set(0)
        log.info("the engine cannot sleep: %s", why)

    async def _is_sleeping(self) -> bool | None:
        """vLLM's answer, or None when the engine gives none (no such endpoint, not JSON)."""
        status, body = await self.client.call("GET", PATH_VLLM_IS_SLEEPING, self.probe_timeout_s)
        if status != 200:
            return None
        try:
            parsed = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        value = parsed.get("is_sleeping") if isinstance(parsed, dict) else None
        return value if isinstance(value, bool) else None

    async def resolve(self) -> None:
        """`auto`: decide from GET /is_sleeping (call once the engine is healthy)."""
        if self.api != "auto":
            return
        try:
            sleeping = await self._is_sleeping()
        except EngineUnavailable as error:
            log.debug("sleep API probe failed, retried later: %s", error)
            return
        if sleeping is None:
            self._unable(f"the engine answers no vLLM {PATH_VLLM_IS_SLEEPING} and no --engine-sleep-api was named")
            return
        self.api = "vllm"
        self.metrics.sleep_capable.set(1)
        log.info("the engine speaks vLLM's sleep API (%s answered)", PATH_VLLM_IS_SLEEPING)

    def describe(self) -> dict[str, Any]:
        return {"api": self.api, "capable": None if self.api == "auto" else self.api != "none",
                "reason": self.reason, "sleeping": self.level is not None, "level": self.level}

    async def _engine_call(self, path: str, body: object = None) -> None:
        try:
            status, answer = await self.client.call("POST", path, ENGINE_SLEEP_TIMEOUT_S, body)
        except EngineUnavailable as error:
            raise BadRequest(502, f"engine call failed: {error}", "engine_error") from None
        if not 200 <= status < 300:
            raise BadRequest(502, f"engine answered POST {path} with HTTP {status}: "
                             f"{answer[:200].decode(errors='replace')}", "engine_error")

    def _usable(self) -> None:
        if self.api == "auto":
            raise BadRequest(409, "the engine's sleep API is not known yet (engine not answering)", "conflict")
        if self.api == "none":
            raise BadRequest(409, f"this engine cannot sleep: {self.reason}", "conflict")

    async def sleep(self, level: int) -> None:
        await self.resolve()
        self._usable()
        async with self._lock:
            if self.api == "vllm":
                await self._engine_call(f"{PATH_VLLM_SLEEP}?level={level}")
            else:
                await self._engine_call(PATH_SGLANG_RELEASE_MEMORY, {})
            self.level = level
            self.metrics.slept(level, None)

    async def wake(self) -> None:
        await self.resolve()
        self._usable()
        async with self._lock:
            loop = asyncio.get_running_loop()
            started = loop.time()
            if self.api == "vllm":
                await self._engine_call(PATH_VLLM_WAKE_UP)
            else:
                await self._engine_call(PATH_SGLANG_RESUME_MEMORY, {})
            was_asleep = self.level is not None
            self.level = None
            if was_asleep:
                self.metrics.woke(loop.time() - started, on_request=False)

    async def refresh(self) -> None:
        """vLLM: the engine's own state wins (it may have been woken or put to sleep directly)."""
        if self.api != "vllm":
            return
        try:
            sleeping = await self._is_sleeping()
        except EngineUnavailable:
            return
        if sleeping is False:
            self.level = None
        elif sleeping and self.level is None:
            self.level = 1  # asleep at a level the sidecar did not set: vLLM does not say which

    # -- HTTP ---------------------------------------------------------------------------------
    def mount(self, app: web.Application) -> None:
        app.router.add_post(PATH_CONTROL_SLEEP, self.control_sleep)
        app.router.add_get(PATH_CONTROL_SLEEP, self.control_state)
        app.router.add_post(PATH_CONTROL_WAKE, self.control_wake)

    async def control_sleep(self, request: web.Request) -> web.Response:
        self.control.check_token(request)
        await self.sleep(await requested_level(request))
        return web.json_response(self.describe())

    async def control_wake(self, request: web.Request) -> web.Response:
        self.control.check_token(request)
        await self.wake()
        return web.json_response(self.describe())

    async def control_state(self, request: web.Request) -> web.Response:
        self.control.check_token(request)
        await self.resolve()
        await self.refresh()
        return web.json_response(self.describe())
