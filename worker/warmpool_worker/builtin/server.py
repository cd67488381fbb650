"""The built-in worker's HTTP surface (aiohttp): probes, metrics, and the routes mounted on it.

* ``GET /livez`` (the process answers); ``GET /readyz`` (200 only when warm; JSON body with
  the stage, tier, layers resident/total and warm-up state); ``GET /health`` (the path vLLM,
  SGLang, TGI and llama.cpp answer: 200 exactly when ``/readyz`` is); ``GET /metrics``
  (prometheus-client text format).
* the OpenAI-style API (`completions.CompletionsApi`: ``/v1/completions``, ``/v1/models``);
* ``POST /control/tier``, the operator's directive (`control.ControlEndpoint`, which the
  sidecar mounts too);
* ``/control/sleep``, ``/control/wake`` (`sleep.SleepEndpoint`): while asleep the worker stays
  Ready, /readyz's ``sleep`` field says it sleeps, and a completion wakes it.

Errors are JSON (`http_app.json_errors`); the server goes on serving after any of them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from aiohttp import web
from warmpool_worker.builtin.batch_scheduler import BatchScheduler
from warmpool_worker.builtin.completions import CompletionsApi
from warmpool_worker.builtin.sleep import SleepController, SleepEndpoint
from warmpool_worker.config import ServingLimits
from warmpool_worker.control import ControlEndpoint
from warmpool_worker.engine_api import BatchingEngine, KVCacheStats
from warmpool_worker.guard import TierGuard
from warmpool_worker.http_app import error_response, json_errors
from warmpool_worker.metrics import CONTENT_TYPE, WorkerMetrics
from warmpool_worker.worker_status import WorkerStatus

from warmpool.contract.http import MAX_REQUEST_BODY_BYTES, PATH_HEALTH, PATH_LIVEZ, PATH_METRICS, PATH_READYZ

if TYPE_CHECKING:
    from warmpool_worker.tracing import TraceSink

#: The route whose requests are traced (the first one always, later ones sampled).
TRACED_PATH = "/v1/completions"


class WorkerServer:
    def __init__(
        self,
        status: WorkerStatus,
        metrics: WorkerMetrics,
        guard: TierGuard,
        scheduler: BatchScheduler,
        control: ControlEndpoint,
        limits: ServingLimits,
        sleep: SleepController | None = None,
        vllm_sleep_api: bool = False,
        traces: TraceSink | None = None,
    ) -> None:
        self.traces = traces
        self.status = status
        self.metrics = metrics
        self.guard = guard
        self.control = control
        self.sleep = sleep
        self.sleep_endpoint = None if sleep is None else SleepEndpoint(sleep, control, vllm_sleep_api)
        self.api = CompletionsApi(status, metrics, scheduler, limits,
                                  wake=None if sleep is None else sleep.wake_for_request)

    def app(self) -> web.Application:
        # The tracing middleware exists only with tracing on: off, a request pays nothing for it.
        middlewares = [json_errors] if self.traces is None else [self.trace_requests, json_errors]
        # The body limit the activator also holds clients to (one number, in the contract).
        app = web.Application(middlewares=middlewares, client_max_size=MAX_REQUEST_BODY_BYTES)
        app.router.add_get(PATH_LIVEZ, self.livez)
        app.router.add_get(PATH_READYZ, self.readyz)
        app.router.add_get(PATH_HEALTH, self.health)
        app.router.add_get(PATH_METRICS, self.metrics_handler)
        self.api.mount(app)
        self.control.mount(app)
        if self.sleep_endpoint is not None:
            self.sleep_endpoint.mount(app)
        return app

    @web.middleware
    async def trace_requests(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != TRACED_PATH or self.traces is None:
            return await handler(request)  # type: ignore[no-any-return]
        started = time.time()
        status = 500
        try:
            response: web.StreamResponse = await handler(request)
            status = response.status
            return response
        except web.HTTPException as error:
            status = error.status
            raise
        finally:
            self.traces.request(started, time.time(), self.guard.state.effective.value, status)

    # -- probes and metrics ------------------------------------------------------------
    async def livez(self, _request: web.Request) -> web.Response:
        return web.json_response({"alive": True, "stage": self.status.stage})

    def readiness(self) -> dict[str, Any]:
        status = self.status
        engine = status.engine
        body: dict[str, Any] = {
            "ready": status.ready,
            "stage": status.stage,
            "model": status.model_name,
            "layers_resident": engine.layers_resident() if engine is not None else 0,
            "layers_total": engine.num_layers if engine is not None else None,
            "warmup": status.describe_warmup(),
            "error": status.error,
            "sleep": None if self.sleep is None else self.sleep.describe(),
        }
        body.update(self.guard.state.describe())
        return body

    async def readyz(self, _request: web.Request) -> web.Response:
        return web.json_response(self.readiness(), status=200 if self.status.ready else 503)

    async def health(self, _request: web.Request) -> web.Response:
        """The ecosystem's health probe, as llama.cpp answers it: 200 ``{"status": "ok"}`` when
        requests can be served (here: warm, the same truth as /readyz), else 503 with why."""
        if self.status.ready:
            return web.json_response({"status": "ok"})
        reason = self.status.error or f"not ready (stage {self.status.stage})"
        return error_response(503, reason, "unavailable")

    async def metrics_handler(self, _request: web.Request) -> web.Response:
        engine = self.status.engine
        if engine is not None:
            self.metrics.set_layers(engine.layers_resident(), engine.num_layers)
            if isinstance(engine, KVCacheStats):
                self.metrics.set_kv_cache_tokens(engine.kv_cache_tokens())
            if isinstance(engine, BatchingEngine):
                self.metrics.set_kv_blocks(engine.kv_blocks())
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})
