"""`warmpool worker sidecar`: make Ready mean warm for an external OpenAI-compatible engine.

The pod's readiness probe points here, not at the engine.  Start-up, all at once:

* bind ``/livez``, ``/readyz``, ``/metrics``, ``/control/tier`` first (same surface and
  metric names as the built-in worker; the control endpoint is the worker's own
  `control.ControlEndpoint`);
* the local tier guard ticks (shared `TierGuard`: memory probe, hysteresis, operator
  directive, stricter wins);
* the page-cache prefetch of the engine's weight files runs in a thread, hottest layers
  first, bounded by the tier (`sidecar.weight_prefetch`, `prefetch`), and tops up if the tier relaxes;
* the engine supervisor waits for the engine's health endpoint, then sends the warm-up
  plan of the shared core (`warmup.plan_warmup`: buckets and prompt counts by tier,
  prompts sized to buckets with the model's tokenizer.json when there is one) through
  ``/v1/completions``, with a timeout and bounded retries per request.  Only then is
  ``/readyz`` 200.

Afterwards the supervisor keeps probing: when the engine stops answering for
``--lost-after`` consecutive probes, or its process identity changes (a restart quicker
than a probe), readiness drops and the whole warm-up runs again against the new process
(its caches are cold).  An engine that answers its health endpoint but fails warm-up
requests (5xx, garbage) is not ready: the warm-up is retried with backoff until it passes.

Cold-start phases here: ``weights_mapped`` = the tier's share of the weights prefetched
(or the engine healthy, without a model dir); ``first_layer_ready`` = the engine first
answered its health endpoint; ``warmup_done`` and ``ready`` as in the worker.  Phases are
first-time marks of this process; an engine restart shows in ``warmpool_engine_restarts_total``.
``warmpool_layers_resident`` counts layers whose weights the prefetch has put in the page
cache (the engine's own residency is not visible from outside it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from warmpool_worker.config import SidecarConfig
from warmpool_worker.control import ControlEndpoint
from warmpool_worker.guard import TierGuard
from warmpool_worker.http_app import cancel_tasks, json_errors, start_site, stop_on_signals
from warmpool_worker.memory import MemoryProbe, MemoryReading, make_probe
from warmpool_worker.metrics import CONTENT_TYPE, ENGINE_KV_SOURCE, SidecarMetrics
from warmpool_worker.sidecar.engine_client import EngineClient, EngineError, EngineScrape, EngineUnavailable
from warmpool_worker.sidecar.proxy import EngineProxy
from warmpool_worker.sidecar.sleep import EngineSleep
from warmpool_worker.sidecar.weight_prefetch import WeightPrefetch
from warmpool_worker.warmup import (
    WarmupPlan,
    WarmupProgress,
    load_prompts,
    plan_for_tier,
    sized_prompt_text,
    sized_prompt_tokens,
)
from warmpool_worker.worker_status import WarmupStatus

from warmpool.contract.api import Tier
from warmpool.contract.http import (
    MAX_REQUEST_BODY_BYTES,
    PATH_LIVEZ,
    PATH_METRICS,
    PATH_READYZ,
    STAGE_READY,
    STAGE_WAITING_ENGINE,
    STAGE_WARMING,
)

log = logging.getLogger("warmpool.sidecar")

#: Backoff between whole warm-up attempts against an engine that is up but failing them.
RETRY_WARMUP_MIN_S = 1.0
RETRY_WARMUP_MAX_S = 30.0
#: How often the engine's /metrics is scraped (KV-cache figure, restart identity, request figures).
SCRAPE_INTERVAL_S = 2.0
#: Keep this many recent warm-up errors in the /readyz body.
RECENT_ERRORS = 5


@dataclass
class EngineState:
    url: str
    up: bool = False
    model: str | None = None
    max_context: int | None = None
    restarts: int = 0
    identity: float | None = None
    last_error: str | None = None
    kv_cache_usage: float | None = None
    kv_cache_metric: str | None = None

    def describe(self) -> dict[str, object]:
        return {
            "url": self.url,
            "up": self.up,
            "model": self.model,
            "max_context": self.max_context,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "kv_cache_usage": self.kv_cache_usage,
            "kv_cache_metric": self.kv_cache_metric,
        }


@dataclass
class SidecarStatus(WarmupStatus):
    ready: bool = False
    skipped: dict[int, str] = field(default_factory=dict)  # bucket -> why the engine refused it
    errors: list[str] = field(default_factory=list)  # recent warm-up errors, newest last
    warmup_seconds: float | None = None

    def note_error(self, message: str) -> None:
        self.errors = [*self.errors, message][-RECENT_ERRORS:]

    def describe(self) -> dict[str, Any]:
        """The sidecar's own part of /readyz: readiness, stage and the warm-up's progress."""
        return {
            "ready": self.ready,
            "stage": self.stage,
            "mode": "sidecar",
            "warmup": {
                **self.describe_warmup(),
                "seconds": None if self.warmup_seconds is None else round(self.warmup_seconds, 3),
                "skipped_buckets": {str(b): why for b, why in sorted(self.skipped.items())},
                "recent_errors": list(self.errors),
            },
            "error": self.error,
        }


#: Scale of the engine-KV "reading": the guard's probe speaks bytes, the engine gives a ratio.
ENGINE_KV_SCALE = 1_000_000


class EngineKvProbe:
    """The tier from the engine's own KV-cache usage (``--memory-source engine-kv``).

    vLLM pre-allocates most of the GPU (``--gpu-memory-utilization``, 0.9 by default) at
    start, so a device-wide NVML reading beside it sits near 90 % and would hold the
    sidecar at ``paused`` for good.  What a warm-up competes with there is KV-cache room,
    which vLLM exports.  No figure (not exported, engine down) -> None: Unknown, never 0.
    """

    def __init__(self, engine: EngineState) -> None:
        self.engine = engine

    def read(self) -> MemoryReading | None:
        ratio = self.engine.kv_cache_usage
        if ratio is None:
            return None
        return MemoryReading(round(ratio * ENGINE_KV_SCALE), ENGINE_KV_SCALE, ENGINE_KV_SOURCE)


class PromptSizer:
    """Warm-up prompts sized to a bucket: exactly with the model's tokenizer.json when it is
    usable, else approximately by characters (the engine is reached over HTTP)."""

    def __init__(self, prompts: list[str], chars_per_token: float) -> None:
        self.prompts = prompts
        self.chars_per_token = chars_per_token
        self._encode: Callable[[str], list[int]] | None = None
        self._decode: Callable[[list[int]], str] | None = None

    def use_tokenizer(self, tokenizer_path: Path) -> None:
        if not tokenizer_path.is_file():
            return
        try:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(tokenizer_path))
            self._encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False).ids)
            self._decode = lambda ids: str(tokenizer.decode(ids))
        except Exception as error:  # an unusable tokenizer costs precision, not the warm-up
            log.warning("tokenizer %s unusable (%s): sizing prompts by characters", tokenizer_path, error)

    def prompt_for(self, bucket: int, variant: int) -> str:
        if self._encode is not None and self._decode is not None:
            try:
                return self._decode(sized_prompt_tokens(self.prompts, bucket, self._encode, variant))
            except ValueError as error:
                log.warning("sizing with the tokenizer failed (%s): by characters", error)
        return sized_prompt_text(self.prompts, bucket, variant, self.chars_per_token)


class Sidecar:
    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.metrics = SidecarMetrics()
        self.status = SidecarStatus()
        self.engine = EngineState(url=config.engine_url)
        self.client = EngineClient(
            config.engine_url,
            health_path=config.health_path,
            request_timeout=config.request_timeout_s,
            probe_timeout=config.probe_timeout_s,
            api_key=_read_secret(config.api_key_file),
        )
        probe: MemoryProbe = (
            EngineKvProbe(self.engine)
            if config.memory_source == "engine-kv"
            else make_probe(config.device, config.guard.memory_capacity_bytes, config.guard.memory_account_pids)
        )
        self.guard = TierGuard(probe, config.guard.thresholds, on_update=self.metrics.publish_guard)
        self.stop = asyncio.Event()
        self.prompts = PromptSizer([], config.chars_per_token)  # the set comes in `prepare`
        self.prefetch = WeightPrefetch(config, self.guard, self.metrics, self.stop)
        self.control = ControlEndpoint(self.guard, config.listen.control_token_file)
        self.sleep = EngineSleep(self.client, config.engine_sleep_api, self.control, self.metrics,
                                 config.probe_timeout_s)

    # -- state published to probes and metrics ----------------------------------------------
    def _set_ready(self, ready: bool, stage: str) -> None:
        self.status.ready = ready
        self.status.stage = stage
        self.metrics.set_ready(ready)

    def _set_engine_up(self, up: bool) -> None:
        self.engine.up = up
        self.metrics.engine_up.set(1 if up else 0)

    def readiness(self) -> dict[str, Any]:
        return {**self.status.describe(), "engine": self.engine.describe(), "prefetch": self.prefetch.describe(),
                "layers_total": self.prefetch.num_layers, "sleep": self.sleep.describe(),
                **self.guard.state.describe()}

    # -- HTTP -------------------------------------------------------------------------------
    def app(self) -> web.Application:
        # The body limit the activator also holds clients to (one number, in the contract).
        app = web.Application(middlewares=[json_errors], client_max_size=MAX_REQUEST_BODY_BYTES)
        app.router.add_get(PATH_LIVEZ, self.livez)
        app.router.add_get(PATH_READYZ, self.readyz)
        app.router.add_get(PATH_METRICS, self.metrics_handler)
        self.control.mount(app)
        self.sleep.mount(app)
        EngineProxy(self.config.engine_url).mount(app)
        return app

    async def livez(self, _request: web.Request) -> web.Response:
        return web.json_response({"alive": True, "stage": self.status.stage})

    async def readyz(self, _request: web.Request) -> web.Response:
        return web.json_response(self.readiness(), status=200 if self.status.ready else 503)

    async def metrics_handler(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # -- set-up -----------------------------------------------------------------------------
    def prepare(self) -> None:
        """Blocking: prompts, tokenizer, weight map and heat order (cheap: headers only)."""
        config = self.config
        self.prompts = PromptSizer(load_prompts(config.warmup.prompts_file), config.chars_per_token)
        if config.model_dir is not None:
            self.prompts.use_tokenizer(config.model_dir / "tokenizer.json")
            self.prefetch.prepare(config.model_dir)

    # -- engine -----------------------------------------------------------------------------
    async def resolve_sleep_api(self) -> None:
        """``--engine-sleep-api auto``: probe the engine's sleep API once it answers."""
        while self.sleep.api == "auto" and not self.stop.is_set():
            if self.engine.up:
                await self.sleep.resolve()
            if await self._sleep(self.config.poll_interval_s):
                return

    async def scrape_loop(self) -> None:
        """The engine's memory figure and process identity, every few seconds."""
        while not self.stop.is_set():
            scrape = await self.client.scrape(self.config.engine_metrics_path)
            self._apply_scrape(scrape)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), timeout=SCRAPE_INTERVAL_S)

    def _apply_scrape(self, scrape: EngineScrape) -> None:
        self.engine.kv_cache_usage = scrape.kv_cache_usage
        self.engine.kv_cache_metric = scrape.kv_cache_metric
        self.metrics.set_engine_memory(scrape.kv_cache_usage, scrape.kv_cache_metric)
        self.metrics.set_engine_signals(scrape.signals)
        if scrape.process_start is not None:
            self.engine.identity = scrape.process_start

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopping; True if the sidecar is stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), timeout=seconds)
        return self.stop.is_set()

    async def wait_for_engine(self) -> bool:
        """Poll health until it answers; False if stopping first."""
        started = time.monotonic()
        last_log = started
        while not self.stop.is_set():
            if await self.client.health():
                log.info("engine healthy at %s after %.1fs", self.config.engine_url, time.monotonic() - started)
                return True
            if time.monotonic() - last_log >= 10.0:
                log.info("still waiting for the engine at %s (%.0fs)", self.config.engine_url,
                         time.monotonic() - started)
                last_log = time.monotonic()
            if await self._sleep(self.config.poll_interval_s):
                return False
        return False

    async def _engine_gone(self) -> bool:
        """After a failed request: is the engine down (health fails) rather than just failing prompts?"""
        for _ in range(max(1, self.config.lost_after)):
            if await self.client.health():
                return False
            if await self._sleep(self.config.poll_interval_s):
                return True
        return True

    def _plan(self, tier: Tier) -> WarmupPlan:
        return plan_for_tier(tier, self.config.warmup, self.prefetch.order, self.engine.max_context)

    def _count_error(self, error: EngineError) -> None:
        self.metrics.warmup_errors.labels(error.reason).inc()
        self.engine.last_error = str(error)
        self.status.note_error(f"{error.reason}: {error}")

    async def warm(self, deadline: float | None) -> str:
        """Run the tier's plan (or what is left of it): 'ok', 'lost', 'failed' or 'stopped'."""
        progress = self.status.progress
        for _attempt in range(4):  # a stricter tier mid-way re-plans at it; bounded
            tier = self.guard.state.effective
            plan = self._plan(tier)
            self.status.plan = plan
            self.metrics.set_planned(plan.per_bucket())
            todo = progress.remaining(plan)
            log.info("warm-up plan at tier %s: %s", tier.value, plan.describe())
            restart = False
            for bucket in todo.buckets:
                if bucket in self.status.skipped:
                    continue
                while progress.prefills.get(bucket, 0) < plan.prompts_per_bucket:
                    if self.stop.is_set():
                        return "stopped"
                    if self.guard.state.effective.strictness > plan.tier.strictness:
                        restart = True
                        break
                    if deadline is not None and time.monotonic() > deadline:
                        done = sum(progress.prefills.values())
                        log.warning("warm-up timeout (%.0fs): %d prefill(s) done", self.config.warmup.timeout_s, done)
                        return "ok" if done else "failed"
                    variant = progress.prefills.get(bucket, 0)
                    prompt = await asyncio.to_thread(self.prompts.prompt_for, bucket, variant)
                    try:
                        _text, seconds = await self.client.complete_with_retries(
                            prompt,
                            plan.decode_tokens,
                            self.engine.model,
                            retries=self.config.retries,
                            backoff=self.config.retry_backoff_s,
                            on_error=self._count_error,
                        )
                    except EngineUnavailable as error:
                        self.status.error = f"engine unavailable during warm-up: {error}"
                        return "lost" if await self._engine_gone() else "failed"
                    except EngineError as error:
                        if error.retryable:
                            self.status.error = f"warm-up request kept failing: {error}"
                            return "lost" if await self._engine_gone() else "failed"
                        # the engine refused this prompt (too long for it, say): skip the bucket
                        log.warning("warm-up bucket %d skipped: %s", bucket, error)
                        self.status.skipped[bucket] = str(error)
                        break
                    progress.prefills[bucket] = variant + 1
                    self.metrics.warmup_prefill_done(bucket)
                    log.info("warm-up (%s): bucket %d prompt %d/%d in %.3fs", plan.tier.value, bucket,
                             variant + 1, plan.prompts_per_bucket, seconds)
                if restart:
                    break
            if restart:
                continue
            if plan.total_prefills and not any(progress.prefills.values()):
                self.status.error = "the engine refused every warm-up prompt: " + "; ".join(
                    self.status.skipped.values()
                )
                return "failed"
            self.status.warmup_tier = plan.tier
            self.metrics.set_warmup_tier(plan.tier)
            return "ok"
        return "ok" if any(self.status.progress.prefills.values()) or self.status.plan is None else "failed"

    async def supervise(self) -> None:
        """Wait for the engine, warm it, watch it; start over when it is lost."""
        retry_delay = RETRY_WARMUP_MIN_S
        while not self.stop.is_set():
            self._set_ready(False, STAGE_WAITING_ENGINE)
            self._set_engine_up(False)
            if not await self.wait_for_engine():
                return
            self._set_engine_up(True)
            self.metrics.mark_phase("first_layer_ready")
            if not self.prefetch.active:
                self.metrics.mark_phase("weights_mapped")
            info = await self.client.describe()
            self.engine.model = self.config.served_model_name or info.model_id
            self.engine.max_context = (
                self.config.max_context or info.max_context or config_context(self.config.model_dir)
            )
            self._apply_scrape(await self.client.scrape(self.config.engine_metrics_path))
            await asyncio.to_thread(self.guard.tick)  # decide on this figure, not the last tick's
            incarnation = self.engine.identity
            # a new engine process has cold caches: warm-up starts from nothing
            self.status.progress = WarmupProgress()
            self.status.skipped = {}
            self.status.error = None
            self._set_ready(False, STAGE_WARMING)
            started = time.monotonic()
            outcome = await self.warm(time.monotonic() + self.config.warmup.timeout_s)
            if outcome == "stopped":
                return
            if outcome == "ok" and None not in (incarnation, self.engine.identity) and (
                incarnation != self.engine.identity
            ):
                outcome = "lost"  # it restarted between two of our requests: what we warmed is gone
            if outcome == "lost":
                self._lost("engine stopped answering during warm-up")
                continue
            if outcome == "failed":
                log.warning("warm-up failed (%s); retrying in %.0fs", self.status.error, retry_delay)
                if await self._sleep(retry_delay):
                    return
                retry_delay = min(RETRY_WARMUP_MAX_S, retry_delay * 2)
                continue
            retry_delay = RETRY_WARMUP_MIN_S
            self.status.warmup_seconds = time.monotonic() - started
            self.metrics.mark_phase("warmup_done")
            self._set_ready(True, STAGE_READY)
            self.metrics.mark_phase("ready")
            log.info("ready: engine %s warm (%s) in %.2fs", self.engine.model, self.status.progress.describe(),
                     self.status.warmup_seconds)
            why = await self.watch(incarnation)
            if why is None:
                return
            self._lost(why)

    def _lost(self, why: str) -> None:
        log.warning("engine lost: %s; readiness dropped, warm-up will run again", why)
        self.engine.restarts += 1
        self.engine.last_error = why
        self.metrics.engine_restarts.inc()
        self._set_ready(False, STAGE_WAITING_ENGINE)
        self._set_engine_up(False)

    async def watch(self, incarnation: float | None) -> str | None:
        """While ready: probe health; top up on a relaxed tier.  Why the engine was lost, or None on stop."""
        failures = 0
        next_top_up = 0.0  # after a failed top-up, leave a failing engine alone for a while
        while not await self._sleep(self.config.poll_interval_s):
            if await self.client.health():
                failures = 0
            else:
                failures += 1
                if failures >= self.config.lost_after:
                    return f"health probe failed {failures} times in a row"
                continue
            identity = self.engine.identity
            if incarnation is not None and identity is not None and identity != incarnation:
                return f"engine process restarted (start time {incarnation:.0f} -> {identity:.0f})"
            if incarnation is None and identity is not None:
                incarnation = identity
            plan = self._plan(self.guard.state.effective)
            remaining = self.status.progress.remaining(plan).buckets
            if time.monotonic() < next_top_up or all(b in self.status.skipped for b in remaining):
                continue
            log.info("tier %s: topping up the warm-up", plan.tier.value)
            outcome = await self.warm(None)
            if outcome == "lost":
                return "engine stopped answering during a warm-up top-up"
            if outcome == "failed":  # still ready on what is warm; try again later
                next_top_up = time.monotonic() + RETRY_WARMUP_MAX_S
        return None

def config_context(model_dir: Path | None) -> int | None:
    """The context length in the checkpoint's config.json, when there is a readable one."""
    if model_dir is None:
        return None
    try:
        raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = raw.get("max_position_embeddings") if isinstance(raw, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _read_secret(path: Path | None) -> str | None:
    if path is None:
        return None
    return path.read_text(encoding="utf-8").strip() or None


async def serve_sidecar(config: SidecarConfig) -> int:
    """The start-up of the module docstring, in that order; the process's exit code."""
    sidecar = Sidecar(config)
    started = await start_site(sidecar.app(), config.listen.host, config.listen.port, log)
    if started is None:
        return 1
    runner, _ = started
    log.info("sidecar listening on %s:%s for engine %s", config.listen.host, config.listen.port, config.engine_url)
    stop_on_signals(sidecar.stop)
    tasks: list[asyncio.Task[None]] = [asyncio.create_task(sidecar.guard.run(sidecar.stop, config.guard.interval_s))]
    exit_code = 0
    try:
        await asyncio.to_thread(sidecar.guard.wait_first_tick, 10.0)
        try:
            await asyncio.to_thread(sidecar.prepare)
        except Exception as error:  # bad prompts file: nothing to warm with; say so and exit
            log.error("sidecar set-up failed: %s", error)
            sidecar.status.error = str(error)
            exit_code = 1
            return exit_code
        tasks += [
            asyncio.create_task(sidecar.prefetch.run()),
            asyncio.create_task(sidecar.scrape_loop()),
            asyncio.create_task(sidecar.supervise()),
            asyncio.create_task(sidecar.resolve_sleep_api()),
        ]
        await sidecar.stop.wait()
    finally:
        sidecar.stop.set()
        sidecar.prefetch.cancel.set()
        await cancel_tasks(tasks)
        await sidecar.client.close()
        await runner.cleanup()
        log.info("sidecar stopped (exit %d)", exit_code)
    return exit_code
