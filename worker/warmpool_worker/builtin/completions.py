"""The worker's OpenAI-style API: ``POST /v1/completions`` and ``GET /v1/models``.

* ``POST /v1/completions``: prompt as a string or a list of token ids, ``max_tokens``,
  ``temperature``, ``stream`` (server-sent events ``data: {...}`` then ``data: [DONE]``);
  every malformed body is a 400 naming the field (`completion_request` has the ranges).
* ``GET /v1/models``: the one model this worker serves, and whether it is ready.

Generation runs on the engine's batch (`batch_scheduler`): every request in flight shares
one running batch, joining and leaving it at token boundaries, each client (by API key when
the request carries one, else by address: `client_of`) with its share of the batch; the engine works in its own
thread (torch releases the GIL), so probes and metrics answer while it loads, warms or
serves; tokenisation runs in a few threads beside it.

Request lifecycle (`config.ServingLimits`): at most ``max_queued_requests`` requests wait for
the batch to have room, a request beyond that is a 429 with ``Retry-After``; ``max_tokens`` above
``max_tokens_limit`` is a 400 naming the field (what an OpenAI-compatible server answers, so a
client learns its request was not served as asked, instead of a silently shorter completion).
A client that disconnects cancels its generation before the next batch step (aiohttp's
handler cancellation, plus a cancel flag the batch's thread reads before every step); that is
counted and logged at INFO, never as a 500.  A request that fails inside a batch step (its
row could not be sampled) fails alone, a 500 or an in-band error on a stream, and its
batch-mates go on (`batch_scheduler`).  Logits holding NaN/Inf fail the request with a
500 and turn the worker unready for good (stage ``unhealthy``, the reason on /readyz).  The
weights changing under the mapping is a 503 and stage ``failed`` (the runtime then exits for
a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from warmpool_worker.builtin.batch_scheduler import BatchJob, BatchScheduler, KVCacheTooSmall, SchedulerStopped
from warmpool_worker.builtin.completion_request import CompletionRequest, check_room, load_body, parse_completion
from warmpool_worker.config import ServingLimits
from warmpool_worker.engine_api import (
    Engine,
    GenerationStep,
    NonFiniteLogitsError,
    RequestError,
    WeightsChangedError,
)
from warmpool_worker.http_app import BadRequest
from warmpool_worker.metrics import WorkerMetrics
from warmpool_worker.worker_status import WorkerStatus

from warmpool.contract.http import STAGE_FAILED, STAGE_UNHEALTHY

log = logging.getLogger(__name__)

#: Threads that tokenise prompts (the engine itself runs on the batch's own thread).
TOKENIZER_THREADS = 4
#: Seconds a client told 429 should wait before retrying (HTTP's Retry-After is whole seconds).
RETRY_AFTER_SECONDS = 1
REJECT_QUEUE_FULL = "queue_full"


@dataclass
class _Generation:
    """One request's generation, shared by the handler (event loop) and the engine thread."""

    cancel: threading.Event = field(default_factory=threading.Event)
    steps: int = 0  # tokens generated so far (engine thread)
    steps_at_disconnect: int | None = None  # `steps` when the client was seen gone (loop)
    queued: bool = True  # admitted, not yet in the running batch
    ran: bool = False  # it joined the batch (the engine worked for it)
    accounted: bool = False  # its disconnect was counted and logged
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def disconnected(self) -> None:
        if self.steps_at_disconnect is None:
            self.steps_at_disconnect = self.steps
        self.cancel.set()

    def take_disconnect(self) -> tuple[int, int] | None:
        """(tokens before the disconnect, steps run after it), once: the handler and the batch's
        end of the request both ask, whichever comes last with the client gone counts it."""
        with self._lock:
            if self.steps_at_disconnect is None or self.accounted:
                return None
            self.accounted = True
            return self.steps_at_disconnect, self.steps - self.steps_at_disconnect


class RequestQueue:
    """Requests admitted and waiting for the batch, bounded: over the bound, refuse at once."""

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
        """This request stopped waiting (it joined the batch, or ended first); idempotent."""
        with self._lock:
            if generation.queued:
                generation.queued = False
                self.waiting -= 1
            return self.waiting


_DONE = object()


class CompletionsApi:
    """The OpenAI-style routes over one engine; `mount` them on the worker's app."""

    def __init__(
        self,
        status: WorkerStatus,
        metrics: WorkerMetrics,
        scheduler: BatchScheduler,
        limits: ServingLimits,
        wake: Callable[[Engine], Awaitable[None]] | None = None,
    ) -> None:
        self.status = status
        self.metrics = metrics
        self.scheduler = scheduler
        self.limits = limits
        #: Wakes a sleeping engine and waits (bounded) before a completion uses it.
        self.wake = wake
        self.queue = RequestQueue(limits.max_queued_requests)
        self.executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    def mount(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.on_cleanup.append(self._shutdown_executor)

    async def _shutdown_executor(self, _app: web.Application) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _engine(self) -> Engine:
        engine = self.status.engine
        if engine is None:
            raise BadRequest(503, f"model not loaded yet (stage {self.status.stage})", "unavailable")
        if self.status.unhealthy:
            raise BadRequest(503, f"worker unhealthy: {self.status.error}", "unavailable")
        if self.status.stage == STAGE_FAILED:
            raise BadRequest(503, f"worker failed, restarting: {self.status.error}", "unavailable")
        if not self.scheduler.attached:
            raise BadRequest(503, f"model not loaded yet (stage {self.status.stage})", "unavailable")
        return engine

    async def models(self, _request: web.Request) -> web.Response:
        model = {"id": self.status.model_name, "object": "model", "created": int(self.status.started_at),
                 "owned_by": "warmpool", "ready": self.status.ready}
        return web.json_response({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        # Counted on arrival, whatever the outcome: the operator's idle signal (and what it drains).
        self.metrics.request_arrived()
        try:
            return await self._complete(request, arrived)
        finally:
            self.metrics.request_done()

    async def _complete(self, request: web.Request, arrived: float) -> web.StreamResponse:
        # the bytes, not request.json(): JSON is UTF-8 whatever charset the header claims
        body = load_body(await request.read())
        engine = self._engine()
        parsed = parse_completion(body, engine.model_name)
        generation = self._admit()
        ended: asyncio.Event | None = None
        ident = f"cmpl-{uuid.uuid4().hex[:24]}"
        try:
            if self.wake is not None:  # a sleeping engine wakes first; TTFT includes the wake
                await self.wake(engine)
            prompt_ids = await self._prompt_ids(engine, parsed)
            steps: asyncio.Queue[object] = asyncio.Queue()
            job_ended = asyncio.Event()
            try:
                job = self._job(ident, prompt_ids, parsed, steps, generation, job_ended)
                job.client = client_of(request)
                self.scheduler.submit(job)
            except KVCacheTooSmall as error:
                raise BadRequest(400, str(error), param="max_tokens") from None
            except RequestError as error:  # the engine's checks beyond the body's: the prompt's token ids
                raise BadRequest(400, str(error), param="prompt") from None
            ended = job_ended
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
            if ended is None:
                self.metrics.set_queued(self.queue.leave(generation))
            else:  # the batch lets go of it before the next step: wait for that (a second
                # cancellation may cut the wait short; the batch's end of the request counts it then)
                with contextlib.suppress(Exception):
                    await ended.wait()
            if ended is None or ended.is_set():
                self._count_disconnect(ident, generation)

    def _count_disconnect(self, ident: str, generation: _Generation) -> None:
        counted = generation.take_disconnect()
        if counted is None:
            return
        before, after = counted
        self.metrics.request_cancelled(after)
        log.info("%s: client disconnected after %d token(s); generation stopped %d step(s) later",
                 ident, before, after)

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
        check_room(len(prompt_ids), parsed.max_tokens, engine.max_context, self.limits.max_tokens_limit)
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

    def _job(
        self,
        ident: str,
        prompt_ids: Sequence[int],
        parsed: CompletionRequest,
        steps: asyncio.Queue[object],
        generation: _Generation,
        ended: asyncio.Event,
    ) -> BatchJob:
        """The request as the batch runs it: its callbacks (on the batch's thread) hand each
        step to the event loop, and account for the request once it ends."""
        loop = asyncio.get_running_loop()

        def to_loop(callback: Callable[..., object], *args: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(callback, *args)

        def admitted() -> None:
            generation.ran = True
            self.metrics.set_queued(self.queue.leave(generation))

        def step(item: GenerationStep) -> None:
            generation.steps += 1
            self.metrics.token_generated()
            to_loop(steps.put_nowait, item)

        def end(error: BaseException | None) -> None:
            self.metrics.set_queued(self.queue.leave(generation))
            if generation.ran:  # what the engine did for this request, failed or cut short included
                self.metrics.request_served(len(prompt_ids), generation.steps)
            if isinstance(error, NonFiniteLogitsError):
                self._mark_unhealthy(error)
            elif isinstance(error, WeightsChangedError):
                # The files under the mapping changed in place: unready now; the runtime sees
                # STAGE_FAILED and exits non-zero for a restart (which maps the new files).
                log.error("weights changed under the live worker, turning unready: %s", error)
                self.status.stage = STAGE_FAILED
                self.status.error = str(error)
            to_loop(steps.put_nowait, _DONE if error is None else error)
            to_loop(ended.set)
            self._count_disconnect(ident, generation)

        return BatchJob(list(prompt_ids), parsed.max_tokens, parsed.temperature, generation.cancel,
                        admitted, step, end)

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


def client_of(request: web.Request) -> str:
    """Who sent a request, for the batch's per-client share: its API key (the bearer token a
    gateway or client presents; only a digest is kept, never the key), else its peer address."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return "key:" + hashlib.sha256(key.strip().encode()).hexdigest()[:16]
    return f"addr:{request.remote or 'unknown'}"


def _answer_for(error: BaseException) -> BaseException:
    """The HTTP answer for an error the engine raised: a 4xx for the request's fault, a 503
    while the worker cannot serve, a 500 naming the model for non-finite logits."""
    if isinstance(error, RequestError):
        return BadRequest(400, str(error))
    if isinstance(error, WeightsChangedError | SchedulerStopped):
        return BadRequest(503, str(error), "unavailable")
    if isinstance(error, NonFiniteLogitsError):
        return BadRequest(500, f"{error}; the worker is now unready", "non_finite_logits")
    return error
