"""The worker's HTTP surface (aiohttp): OpenAI-style completions, probes, metrics, control.

* ``POST /v1/completions``: prompt as a string or a list of token ids, ``max_tokens``,
  ``temperature``, ``stream`` (server-sent events ``data: {...}`` then ``data: [DONE]``).
* ``GET /v1/models``; ``GET /livez`` (the process answers); ``GET /readyz`` (200 only when
  warm; JSON body with the stage, tier, layers resident/total and warm-up state);
  ``GET /health`` (the path vLLM, SGLang, TGI and llama.cpp answer: 200 exactly when
  ``/readyz`` is); ``GET /metrics`` (prometheus-client text format).
* ``POST /control/tier``: the operator's directive ``{"tier": "truncated", "ttl_seconds": 60}``,
  ``Authorization: Bearer <token>`` with the token read from a file (a mounted Secret; read
  on each call so a rotated Secret takes effect without a restart).

Engine calls run in threads (torch releases the GIL), so probes and metrics answer while a
model loads or warms; one lock serialises engine work (generation and warm-up steps).
A bad request is a 4xx with ``{"error": {"message", "type", "param"}}`` naming the problem;
the server goes on serving.

Request lifecycle (`ServingLimits`): at most ``max_queued_requests`` requests wait for the
engine, a request beyond that is a 429 with ``Retry-After``; ``max_tokens`` above
``max_tokens_limit`` is a 400 naming the field (what an OpenAI-compatible server answers, so a
client learns its request was not served as asked, instead of a silently shorter completion).
A client that disconnects cancels its generation before the next decode step (aiohttp's
handler cancellation, plus a cancel flag the generating thread checks between steps); that is
counted and logged at INFO, never as a 500.  Logits holding NaN/Inf fail the request with a
500 and turn the worker unready for good (stage ``unhealthy``, the reason on /readyz).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from warmpool_worker.engine_api import (
    Engine,
    GenerationStep,
    KVCacheStats,
    NonFiniteLogitsError,
    RequestError,
    WeightsChangedError,
)
from warmpool_worker.guard import TierGuard
from warmpool_worker.metrics import CONTENT_TYPE, WorkerMetrics
from warmpool_worker.warmup import WarmupPlan, WarmupProgress

from warmpool.contract import (
    CONTROL_FIELD_TIER,
    CONTROL_FIELD_TTL,
    CONTROL_TOKEN_HEADER,
    DEFAULT_DIRECTIVE_TTL_SECONDS,
    DIRECTIVE_TIERS,
    MAX_DIRECTIVE_TTL_SECONDS,
    PATH_CONTROL_TIER,
    PATH_HEALTH,
    PATH_LIVEZ,
    PATH_METRICS,
    PATH_READYZ,
    STAGE_FAILED,
    STAGE_READY,
    STAGE_STARTING,
    STAGE_UNHEALTHY,
    Tier,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16
MAX_TEMPERATURE = 2.0
#: Threads for engine work: requests beyond this wait in the executor's queue (the lock
#: serialises the engine anyway; a few threads let tokenisation overlap).
ENGINE_THREADS = 4
DEFAULT_MAX_QUEUED_REQUESTS = 64
#: Default ceiling on max_tokens: bounds one request's compute (its KV grows with what it
#: generates, so the ceiling is about time held on the engine, not memory reserved up front).
DEFAULT_MAX_TOKENS_LIMIT = 4096
#: Seconds a client told 429 should wait before retrying (HTTP's Retry-After is whole seconds).
RETRY_AFTER_SECONDS = 1
REJECT_QUEUE_FULL = "queue_full"


@dataclass(frozen=True)
class ServingLimits:
    """Bounds of the request path (from `--max-queued-requests` and `--max-tokens-limit`)."""

    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1 or self.max_tokens_limit < 1:
            raise ValueError(f"serving limits must be positive: {self}")


@dataclass
class _Generation:
    """One request's generation, shared by the handler (event loop) and the engine thread."""

    cancel: threading.Event = field(default_factory=threading.Event)
    steps: int = 0  # tokens generated so far (engine thread)
    steps_at_disconnect: int | None = None  # `steps` when the client was seen gone (loop)
    queued: bool = True  # admitted, not yet holding the engine

    def disconnected(self) -> None:
        if self.steps_at_disconnect is None:
            self.steps_at_disconnect = self.steps
        self.cancel.set()


class RequestQueue:
    """Requests admitted and waiting for the engine, bounded: over the bound, refuse at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting = 0
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self.waiting >= self.limit:
                return False
            self.waiting += 1
            return True

    def leave(self, generation: _Generation) -> int:
        """This request stopped waiting (it got the engine, or ended first); idempotent."""
        with self._lock:
            if generation.queued:
                generation.queued = False
                self.waiting -= 1
            return self.waiting


@dataclass
class WarmupStatus:
    """The warm-up state the built-in worker and the sidecar both publish on /readyz."""

    stage: str = STAGE_STARTING
    error: str | None = None
    plan: WarmupPlan | None = None
    warmup_tier: Tier | None = None
    progress: WarmupProgress = field(default_factory=WarmupProgress)

    def describe_warmup(self) -> dict[str, Any]:
        """The ``warmup`` part of the /readyz body: the plan, the tier it ran at, its progress."""
        return {
            "plan": None if self.plan is None else self.plan.describe(),
            "tier": None if self.warmup_tier is None else self.warmup_tier.value,
            **self.progress.describe(),
        }


@dataclass
class WorkerStatus(WarmupStatus):
    """What the worker is doing; written by the start-up sequence, read by the handlers."""

    model_name: str = field(kw_only=True)
    engine: Engine | None = None
    started_at: float = field(default_factory=time.time)
    #: Set for good once a request met NaN/Inf logits (sticky: a stage written later by the
    #: start-up sequence cannot make the worker ready again).
    unhealthy: bool = False

    @property
    def ready(self) -> bool:
        return self.stage == STAGE_READY and self.engine is not None and not self.unhealthy


class BadRequest(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.headers = headers


def error_response(
    status: int, message: str, kind: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param}}, status=status, headers=headers
    )


@web.middleware
async def json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error as JSON; an unexpected one is a 500 and the server keeps serving."""
    try:
        return await handler(request)
    except BadRequest as error:
        return error_response(error.status, error.message, error.kind, error.param, error.headers)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return error_response(error.status, f"{error.reason}: {request.method} {request.path}", "http_error")
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return error_response(500, "internal error (see the worker's log)", "internal_error")


@dataclass(frozen=True)
class CompletionRequest:
    prompt_ids: list[int] | None
    prompt_text: str | None
    max_tokens: int
    temperature: float
    stream: bool


def _parse_completion(body: object, model_name: str) -> CompletionRequest:
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(
            404, f"unknown model {model!r}; this worker serves {model_name!r}", "model_not_found", "model"
        )
    prompt = body.get("prompt")
    # OpenAI allows a batch (a list of prompts); accept a batch of one, refuse more clearly
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest(400, "prompt is empty", param="prompt")
        prompt_text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise BadRequest(400, "prompt is empty", param="prompt")
        if any(t < 0 for t in prompt):
            raise BadRequest(400, "prompt token ids must be non-negative", param="prompt")
        prompt_ids = list(prompt)
    elif isinstance(prompt, list):
        raise BadRequest(
            400, "batched prompts are not supported: send one prompt per request", param="prompt"
        )
    else:
        raise BadRequest(400, "prompt must be a string or a list of token ids", param="prompt")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest(
            400, f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens"
        )
    temperature = body.get("temperature", 1.0)
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not 0 <= temperature <= MAX_TEMPERATURE
    ):
        raise BadRequest(
            400,
            f"temperature must be a number within 0..{MAX_TEMPERATURE:g}, got {temperature!r}",
            param="temperature",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "stream must be true or false", param="stream")
    return CompletionRequest(prompt_ids, prompt_text, max_tokens, float(temperature), stream)


_DONE = object()


class WorkerServer:
    def __init__(
        self,
        status: WorkerStatus,
        metrics: WorkerMetrics,
        guard: TierGuard,
        engine_lock: threading.Lock,
        control_token_file: Path | None = None,
        limits: ServingLimits | None = None,
    ) -> None:
        self.status = status
        self.metrics = metrics
        self.guard = guard
        self.engine_lock = engine_lock
        self.control_token_file = control_token_file
        self.limits = limits or ServingLimits()
        self.queue = RequestQueue(self.limits.max_queued_requests)
        self.executor = ThreadPoolExecutor(ENGINE_THREADS, thread_name_prefix="engine")

    def app(self) -> web.Application:
        app = web.Application(middlewares=[json_errors])
        app.router.add_get(PATH_LIVEZ, self.livez)
        app.router.add_get(PATH_READYZ, self.readyz)
        app.router.add_get(PATH_HEALTH, self.health)
        app.router.add_get(PATH_METRICS, self.metrics_handler)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post(PATH_CONTROL_TIER, self.control_tier)
        app.on_cleanup.append(self._shutdown_executor)
        return app

    async def _shutdown_executor(self, _app: web.Application) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

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
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # -- OpenAI-style API --------------------------------------------------------------
    def _engine(self) -> Engine:
        engine = self.status.engine
        if engine is None:
            raise BadRequest(503, f"model not loaded yet (stage {self.status.stage})", "unavailable")
        if self.status.unhealthy:
            raise BadRequest(503, f"worker unhealthy: {self.status.error}", "unavailable")
        return engine

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.status.model_name,
                        "object": "model",
                        "created": int(self.status.started_at),
                        "owned_by": "warmpool",
                        "ready": self.status.ready,
                    }
                ],
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        try:
            body = await request.json()
        except json.JSONDecodeError as error:
            raise BadRequest(400, f"malformed JSON body: {error}") from None
        except UnicodeDecodeError:
            raise BadRequest(400, "malformed JSON body: not UTF-8") from None
        engine = self._engine()
        parsed = _parse_completion(body, engine.model_name)
        generation = self._admit()
        producer: asyncio.Future[None] | None = None
        ident = f"cmpl-{uuid.uuid4().hex[:24]}"
        try:
            prompt_ids = await self._prompt_ids(engine, parsed)
            steps: asyncio.Queue[object] = asyncio.Queue()
            loop = asyncio.get_running_loop()
            producer = loop.run_in_executor(
                self.executor, self._produce, engine, prompt_ids, parsed, steps, loop, generation
            )
            first = await steps.get()
            if isinstance(first, BaseException):
                raise _answer_for(first)
            if first is not _DONE:
                self.metrics.observe_ttft(time.monotonic() - arrived)
            created = int(time.time())
            if parsed.stream:
                return await self._stream(request, ident, created, engine.model_name, first, steps, generation)
            return await self._collect(ident, created, engine, prompt_ids, first, steps)
        except asyncio.CancelledError:  # the client went away (aiohttp cancels the handler)
            generation.disconnected()
            raise
        finally:
            generation.cancel.set()  # whatever ended the handler, the engine stops at the next step
            if producer is None:
                self.metrics.set_queued(self.queue.leave(generation))
            else:
                with contextlib.suppress(Exception):
                    await producer
            if generation.steps_at_disconnect is not None:
                after = generation.steps - generation.steps_at_disconnect
                self.metrics.request_cancelled(after)
                log.info(
                    "%s: client disconnected after %d token(s); generation stopped %d step(s) later",
                    ident,
                    generation.steps_at_disconnect,
                    after,
                )

    def _admit(self) -> _Generation:
        """A place in the bounded queue of requests waiting for the engine, or a 429."""
        generation = _Generation()
        if not self.queue.try_enter():
            self.metrics.request_rejected(REJECT_QUEUE_FULL)
            raise BadRequest(
                429,
                f"too many requests waiting for the engine (the bound is {self.queue.limit}, "
                "--max-queued-requests): retry later",
                "queue_full",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        self.metrics.set_queued(self.queue.waiting)
        return generation

    async def _prompt_ids(self, engine: Engine, parsed: CompletionRequest) -> list[int]:
        """The prompt's token ids, checked against the context and the max_tokens ceiling."""
        if parsed.prompt_ids is not None:
            prompt_ids = parsed.prompt_ids
        else:
            loop = asyncio.get_running_loop()
            prompt_ids = await loop.run_in_executor(self.executor, engine.encode, parsed.prompt_text or "")
            if not prompt_ids:
                raise BadRequest(400, "prompt encodes to no tokens", param="prompt")
        if len(prompt_ids) + parsed.max_tokens > engine.max_context:
            raise BadRequest(
                400,
                f"prompt too long: {len(prompt_ids)} prompt tokens + max_tokens {parsed.max_tokens} "
                f"exceeds the model's context of {engine.max_context}",
                "context_length_exceeded",
                "prompt",
            )
        if parsed.max_tokens > self.limits.max_tokens_limit:
            raise BadRequest(
                400,
                f"max_tokens {parsed.max_tokens} exceeds this worker's limit of "
                f"{self.limits.max_tokens_limit} (--max-tokens-limit)",
                param="max_tokens",
            )
        return prompt_ids

    def _mark_unhealthy(self, error: NonFiniteLogitsError) -> None:
        """Non-finite logits on a live request: the model is unusable, unready for good."""
        self.metrics.logits_non_finite()
        if self.status.unhealthy:
            return
        self.status.error = str(error)
        self.status.unhealthy = True
        self.status.stage = STAGE_UNHEALTHY
        self.metrics.set_ready(False)
        log.error("%s; the worker is unready from now on (a restart re-runs the warm-up check)", error)

    def _produce(
        self,
        engine: Engine,
        prompt_ids: Sequence[int],
        parsed: CompletionRequest,
        steps: asyncio.Queue[object],
        loop: asyncio.AbstractEventLoop,
        generation: _Generation,
    ) -> None:
        """Generate under the engine lock, handing each step to the event loop.

        The cancel flag is read before every step is asked for, so a client gone while a
        step runs costs that one step and no more (and a request that never got the engine
        costs none).
        """

        def put(item: object) -> None:
            loop.call_soon_threadsafe(steps.put_nowait, item)

        try:
            with self.engine_lock:
                self.metrics.set_queued(self.queue.leave(generation))
                if generation.cancel.is_set():
                    return
                generator = engine.generate(prompt_ids, parsed.max_tokens, parsed.temperature)
                try:
                    for step in generator:
                        generation.steps += 1
                        self.metrics.token_generated()
                        put(step)
                        if generation.cancel.is_set() or step.finished:
                            break
                finally:
                    close = getattr(generator, "close", None)
                    if close is not None:
                        close()
        except BaseException as error:  # delivered to the handler, which answers for it
            if isinstance(error, NonFiniteLogitsError):
                self._mark_unhealthy(error)
            if isinstance(error, WeightsChangedError):
                # The files under the mapping changed in place: unready now; the runtime sees
                # STAGE_FAILED and exits non-zero for a restart (which maps the new files).
                log.error("weights changed under the live worker, turning unready: %s", error)
                self.status.stage = STAGE_FAILED
                self.status.error = str(error)
            put(error)
            return
        finally:
            self.metrics.set_queued(self.queue.leave(generation))
        put(_DONE)

    @staticmethod
    def _chunk(ident: str, created: int, model: str, text: str, finish: str | None) -> dict[str, Any]:
        return {
            "id": ident,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }

    async def _next(self, steps: asyncio.Queue[object]) -> object:
        item = await steps.get()
        if isinstance(item, BaseException):
            raise _answer_for(item)
        return item

    async def _collect(
        self,
        ident: str,
        created: int,
        engine: Engine,
        prompt_ids: Sequence[int],
        first: object,
        steps: asyncio.Queue[object],
    ) -> web.Response:
        produced: list[GenerationStep] = []
        item = first
        while isinstance(item, GenerationStep):
            produced.append(item)
            if item.finished:
                break
            item = await self._next(steps)
        finish = produced[-1].finish_reason if produced and produced[-1].finished else "length"
        text = "".join(step.text for step in produced)
        body = self._chunk(ident, created, engine.model_name, text, finish)
        body["usage"] = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(produced),
            "total_tokens": len(prompt_ids) + len(produced),
        }
        return web.json_response(body)

    async def _stream(
        self,
        request: web.Request,
        ident: str,
        created: int,
        model: str,
        first: object,
        steps: asyncio.Queue[object],
        generation: _Generation,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        try:
            await response.prepare(request)
            item = first
            failure: Exception | None = None
            while isinstance(item, GenerationStep):
                chunk = self._chunk(
                    ident, created, model, item.text, item.finish_reason if item.finished else None
                )
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if item.finished:
                    break
                try:
                    item = await self._next(steps)
                except Exception as error:  # headers are sent: report in-band, as OpenAI's API does
                    failure = error
                    break
            if failure is not None:
                if not isinstance(failure, BadRequest):
                    log.error("generation failed mid-stream", exc_info=failure)
                kind = failure.kind if isinstance(failure, BadRequest) else "internal_error"
                payload = {"error": {"message": str(failure), "type": kind, "param": None}}
                await response.write(f"data: {json.dumps(payload)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            # The peer closed before aiohttp told us (a write to a closing transport): the
            # same disconnect as a cancelled handler.  Returning the prepared response lets
            # aiohttp drop it quietly; raising would be logged as a 500.
            generation.disconnected()
        return response

    # -- control ------------------------------------------------------------------------
    def _check_token(self, request: web.Request) -> None:
        if self.control_token_file is None:
            raise BadRequest(
                403, "control endpoint disabled: the worker has no --control-token-file", "forbidden"
            )
        header = request.headers.get(CONTROL_TOKEN_HEADER, "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise BadRequest(
                401, f"missing bearer token in the {CONTROL_TOKEN_HEADER} header", "unauthorized"
            )
        try:
            expected = self.control_token_file.read_text(encoding="utf-8").strip()
        except OSError as error:
            log.error("cannot read control token file %s: %s", self.control_token_file, error)
            raise BadRequest(403, "control token unavailable on the worker", "forbidden") from None
        if not expected or not hmac.compare_digest(presented.strip().encode(), expected.encode()):
            raise BadRequest(403, "wrong bearer token", "forbidden")

    async def control_tier(self, request: web.Request) -> web.Response:
        self._check_token(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BadRequest(400, f"malformed JSON body: {error}") from None
        if not isinstance(body, dict):
            raise BadRequest(400, "request body must be a JSON object")
        names = [t.value for t in DIRECTIVE_TIERS]
        raw_tier = body.get(CONTROL_FIELD_TIER)
        if raw_tier not in names:
            raise BadRequest(
                400, f"{CONTROL_FIELD_TIER} must be one of {names}, got {raw_tier!r}", param="tier"
            )
        ttl = body.get(CONTROL_FIELD_TTL, DEFAULT_DIRECTIVE_TTL_SECONDS)
        if (
            isinstance(ttl, bool)
            or not isinstance(ttl, int | float)
            or not 0 < ttl <= MAX_DIRECTIVE_TTL_SECONDS
        ):
            raise BadRequest(
                400,
                f"{CONTROL_FIELD_TTL} must be a number within "
                f"(0, {MAX_DIRECTIVE_TTL_SECONDS:g}], got {ttl!r}",
                param=CONTROL_FIELD_TTL,
            )
        state = self.guard.set_directive(Tier(raw_tier), float(ttl))
        return web.json_response(state.describe())


def _answer_for(error: BaseException) -> BaseException:
    """The HTTP answer for an error the engine raised: a 4xx for the request's fault, a 503
    while the worker cannot serve, a 500 naming the model for non-finite logits."""
    if isinstance(error, RequestError):
        return BadRequest(400, str(error))
    if isinstance(error, WeightsChangedError):
        return BadRequest(503, str(error), "unavailable")
    if isinstance(error, NonFiniteLogitsError):
        return BadRequest(500, f"{error}; the worker is now unready", "non_finite_logits")
    return error


# -- serving: the start-up and stop shared by the built-in worker and the sidecar ---------------


async def start_site(
    app: web.Application, host: str, port: int, logger: logging.Logger
) -> tuple[web.AppRunner, list[Any]] | None:
    """Serve ``app`` on host:port: the runner and the bound addresses (the real port for port 0).

    None when the address cannot be bound: said in ``logger``, the runner cleaned up.
    """
    # handler_cancellation: a client that disconnects cancels its handler at once (by default
    # aiohttp lets the handler run on), which is what stops its generation.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as error:
        logger.error("cannot bind %s:%s: %s", host, port, error)
        await runner.cleanup()
        return None
    return runner, [s.getsockname() for s in getattr(site._server, "sockets", [])]


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set ``stop`` (the graceful way out), where the loop supports it."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)


async def cancel_tasks(tasks: Iterable[asyncio.Task[None] | None]) -> None:
    """Cancel each background task and wait for it to end, whatever it raises."""
    for task in tasks:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
