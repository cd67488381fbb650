"""A stand-in for vLLM's OpenAI server on loopback, for the sidecar's engine-metrics tests.

vLLM itself cannot run on our machines (no GPU; its CPU build is far too heavy for 2 cores), so
this server answers what the sidecar uses (``/health``, ``/v1/models``, ``/v1/completions``) and
serves a ``/metrics`` page in vLLM's format: rendered by ``prometheus_client`` (the library vLLM
uses) from the definitions in vLLM's V1 ``PrometheusStatLogger`` (vllm/v1/metrics/loggers.py):
the same names, label names (``model_name``, ``engine``), ``finished_reason`` values and 1-2-5
bucket rule up to ``max_model_len``.  A prompt's tokens are its whitespace-separated words.

``metrics_mode`` switches the page: ``vllm`` (the above), ``none`` (an engine without those
figures: only the process start), ``garbage`` (a token histogram whose cumulative counts fall).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tests.support.procs import HOST, free_port

MODEL = "vllm-standin"


def buckets_1_2_5(max_value: int) -> list[int]:
    """vLLM's bucket rule for its token histograms: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return out
            out.append(mantissa * scale)
        scale *= 10


class VllmMetrics:
    """vLLM's request figures, in a registry of their own, for ``engines`` data-parallel engines."""

    def __init__(self, max_model_len: int, engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*labels, "finished_reason"], registry=r)
        buckets = buckets_1_2_5(max_model_len)
        self.prompt_hist = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                     labels, buckets=buckets, registry=r)
        self.generation_hist = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                         labels, buckets=buckets, registry=r)
        self.engines = [str(i) for i in range(engines)]
        for engine in self.engines:
            self.running.labels(MODEL, engine).set(0)
            self.waiting.labels(MODEL, engine).set(0)
            self.kv_usage.labels(MODEL, engine).set(0.1)
            for reason in ("stop", "length", "abort"):
                self.success.labels(MODEL, engine, reason)

    def finished(self, prompt_tokens: int, generated_tokens: int, engine: int = 0, reason: str = "length") -> None:
        labels = (MODEL, self.engines[engine])
        self.prompt_tokens.labels(*labels).inc(prompt_tokens)
        self.generation_tokens.labels(*labels).inc(generated_tokens)
        self.success.labels(*labels, reason).inc()
        self.prompt_hist.labels(*labels).observe(prompt_tokens)
        self.generation_hist.labels(*labels).observe(generated_tokens)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class VllmStandIn:
    """The server, on its own event loop thread; figures and modes are switched from the test."""

    def __init__(self, max_model_len: int = 8192) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.max_model_len = max_model_len
        self.vllm = VllmMetrics(max_model_len)
        self.metrics_mode = "vllm"
        self.start_time = time.time()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.complete)
        return app

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "max_model_len": self.max_model_len}]})

    async def metrics(self, _request: web.Request) -> web.Response:
        head = f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {self.start_time}\n"
        if self.metrics_mode == "none":
            return web.Response(text=head)
        page = self.vllm.render()
        if self.metrics_mode == "garbage":  # cumulative counts that fall as the bound grows
            page += (f'vllm:request_prompt_tokens_bucket{{engine="9",le="1000.0",model_name="{MODEL}"}} 50.0\n'
                     f'vllm:request_prompt_tokens_bucket{{engine="9",le="2000.0",model_name="{MODEL}"}} 10.0\n')
        return web.Response(text=head + page)

    async def complete(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        prompt = str(body.get("prompt", ""))
        max_tokens = int(body.get("max_tokens", 16))
        words = len(prompt.split())
        if words + max_tokens > self.max_model_len:
            return web.json_response({"error": {"message": "too long"}}, status=400)
        self.vllm.finished(words, max_tokens)
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [
            {"index": 0, "text": " ok" * max_tokens, "finish_reason": "length"}],
            "usage": {"prompt_tokens": words, "completion_tokens": max_tokens}})

    async def _start(self) -> None:
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, self.port).start()

    async def _cleanup(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def start(self) -> None:
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._cleanup(), self._loop).result(10)

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
