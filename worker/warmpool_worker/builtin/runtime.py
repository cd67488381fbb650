"""``warmpool worker serve``: the built-in worker's start-up sequence and its background loops.

Start-up order (`serve_worker`; cold start is the product, and the probes must tell the
truth throughout):

0. begin the tokenizer's read, import torch with its thread pool sized to the pod's CPU, and
   resolve ``--device auto`` (`torch_start`: before the bind for every device, so no request
   served meanwhile slows the import) -- the memory probe is chosen per device;
1. bind the HTTP server, so ``/livez`` and ``/metrics`` answer before any weight is touched;
2. start the local tier guard and take one memory reading (the warm-up depth depends on it);
3. import the engine -> ``imports_done``, then map the weights (``load_engine``: headers
   validated, nothing read yet) -> ``weights_mapped``;
4. load layers in heat order per the tier's plan, logging each -> ``first_layer_ready``, then
   ``weights_loaded`` once the plan's layers are all resident;
5. warm up per the tier (prefill + short decode per bucket, until its latency settles or
   the bucket's ceiling of prompts) -> ``warmup_done``; when the tier
   ran no prefill (paused), a one-token check prefill instead: a model whose logits are
   NaN/Inf never turns Ready, whatever the tier (the check passes every layer, so it loads
   them all: what the first request would have done);
6. capture CUDA graphs of the decode step, after a full warm-up only;
7. ``/readyz`` turns 200 -> ``ready``.  Afterwards, if the tier relaxes, the warm-up is
   topped up to the deeper plan in the background (never undone when it tightens).

Requests are served by the engine's batch (`batch_scheduler`) as soon as the weights are
mapped; warm-up steps, sleep and wake take the engine gate (`engine_gate`) between its steps.
The weight files are leased once mapped (`weight_leases`): a file opened for writing or
truncated in place turns the worker unready and makes it exit for a restart, never SIGBUS.

Steps 3-7 are `WorkerRuntime.startup`, in a thread.  A load failure is logged, ``/readyz``
never turns 200, and the process exits non-zero; so does a failure after ready that no retry
can fix (the weights changed under the mapping), so the pod restarts on the new files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable

from warmpool_worker.builtin.batch_scheduler import BatchScheduler, BatchSettings
from warmpool_worker.builtin.engine_gate import AwakeOnly, EngineAsleep, EngineGate
from warmpool_worker.builtin.server import WorkerServer
from warmpool_worker.builtin.sleep import SleepController
from warmpool_worker.builtin.torch_start import TorchStart, start_torch
from warmpool_worker.builtin.weight_leases import WeightLeases
from warmpool_worker.config import ServeConfig
from warmpool_worker.control import ControlEndpoint
from warmpool_worker.defaults import READINESS_CHECK_PROMPT
from warmpool_worker.engine_api import (
    BatchingEngine,
    Engine,
    GraphCapture,
    ModelLoadError,
    NonFiniteLogitsError,
    Sleepable,
)
from warmpool_worker.guard import TierGuard
from warmpool_worker.http_app import cancel_tasks, start_site, stop_on_signals
from warmpool_worker.memory import make_probe
from warmpool_worker.metrics import WorkerMetrics
from warmpool_worker.tracing import ColdStartRecorder, TraceSink
from warmpool_worker.warmup import (
    PromptsError,
    WarmupPlan,
    WarmupStopped,
    execute_plan,
    load_prompts,
    plan_for_tier,
)
from warmpool_worker.worker_status import WorkerStatus

from warmpool.contract.api import Tier
from warmpool.contract.http import STAGE_FAILED, STAGE_LOADING, STAGE_READY, STAGE_WARMING
from warmpool.heatmap import layer_order, usable_heat

log = logging.getLogger("warmpool.worker")


class WorkerRuntime:
    def __init__(self, config: ServeConfig, device: str, torch_start: TorchStart | None = None) -> None:
        self.config = config
        self.device = device
        self.torch_start = torch_start  # the first step, done before the bind (None: startup does it)
        self.metrics = WorkerMetrics()
        self.status = WorkerStatus(model_name=config.served_name)
        self.engine_gate = EngineGate()
        limits = config.limits
        self.scheduler = BatchScheduler(
            self.engine_gate, BatchSettings(limits.max_batch_size, config.sleep.drain_timeout_s), self.metrics)
        self.leases = WeightLeases()
        self.scheduler.weights_check = self.leases.check
        guard = config.guard
        probe = make_probe(device, guard.memory_capacity_bytes, guard.memory_account_pids)
        self.guard = TierGuard(probe, guard.thresholds, on_update=self.metrics.publish_guard)
        self.order: list[int] = []
        self.prompts: list[str] = []
        self.stop = asyncio.Event()
        self.exit_code = 0  # non-zero once serving has failed for good (a restart is the fix)
        #: tracing on only: the sink, and the cold start's steps until they are handed to it
        self.traces = TraceSink(config.tracing, device) if config.tracing.enabled else None
        self.recorder = ColdStartRecorder(self.metrics.process_start) if self.traces is not None else None

    def _refresh_engine_metrics(self) -> None:
        engine = self.status.engine
        if engine is not None:
            self.metrics.set_layers(engine.layers_resident(), engine.num_layers)
            self.metrics.set_heat(engine.layer_heat())

    # -- planning and running warm-up --------------------------------------------------
    def plan(self, tier: Tier, engine: Engine) -> WarmupPlan:
        return plan_for_tier(tier, self.config.warmup, self.order, engine.max_context)

    def _on_layer(self, resident: int, total: int, index: int) -> None:
        self.metrics.mark_phase("first_layer_ready")
        if self.recorder is not None:
            self.recorder.layer(index)
        self.metrics.set_layers(resident, total)
        log.info("layer %d loaded (%d/%d resident)", index, resident, total)

    def _on_prefill(self, bucket: int) -> None:
        self.metrics.warmup_prefill_done(bucket)
        settled_after = self.status.progress.settled.get(bucket)
        if settled_after is not None:
            self.metrics.bucket_settled(bucket, settled_after)
        if self.recorder is not None:
            self.recorder.prefill(bucket)

    def _stricter_than(self, plan: WarmupPlan, deadline: float | None) -> Callable[[], bool]:
        def should_stop() -> bool:
            if deadline is not None and time.monotonic() > deadline:
                return True
            return self.guard.state.effective.strictness > plan.tier.strictness

        return should_stop

    def run_plan(
        self, engine: Engine, plan: WarmupPlan, deadline: float | None, layers_only: bool = False
    ) -> bool:
        """Run (the rest of) a plan; False if cut short by a stricter tier or the deadline."""
        self.status.plan = plan
        self.metrics.set_planned(plan.per_bucket(), self.status.progress.settled)
        if self.recorder is not None:
            self.recorder.tier = plan.tier.value
        step = (
            plan
            if not layers_only
            else WarmupPlan(plan.tier, (), 0, plan.resident_layers, plan.decode_tokens)
        )
        try:
            execute_plan(
                engine,
                step,
                self.prompts,
                self.status.progress,
                engine_lock=AwakeOnly(self.engine_gate, engine),
                on_layer=self._on_layer,
                on_prefill=self._on_prefill,
                should_stop=self._stricter_than(plan, deadline),
                kv_dir=self.config.kv_prefix_dir,
                on_kv_save_error=self.metrics.kv_prefix_save_failed,
            )
        except (WarmupStopped, EngineAsleep) as stopped:
            log.warning("warm-up at tier %s cut short: %s", plan.tier.value, stopped)
            return False
        finally:
            self._refresh_engine_metrics()
            if step.buckets:  # which buckets settled after how many prefills (the rest: at the ceiling)
                log.info("warm-up buckets at tier %s: %s", plan.tier.value,
                         self.status.progress.settle_report(plan))
        return True

    def startup(self) -> None:
        """Blocking: map, load in heat order, warm per tier, ready.  Raises on load failure."""
        config = self.config
        self.prompts = load_prompts(config.warmup.prompts_file)
        tokenizer = (self.torch_start or start_torch(config)).tokenizer
        from warmpool_worker.builtin.engine import load_engine  # the engine: after torch's thread sizing

        started = time.monotonic()
        imported_at = time.time()
        self.metrics.mark_phase("imports_done", imported_at)
        if self.recorder is not None:
            self.recorder.imports_done(imported_at)
        engine: Engine = load_engine(config.model, self.device, config.dtype, config.model_name,
                                     partial_cache=config.partial_cache, tokenizer=tokenizer,
                                     kv_cache_bytes=config.limits.kv_cache_bytes,
                                     chunk_tokens=config.limits.prefill_chunk_tokens)
        mapped_at = time.time()
        self.metrics.mark_phase("weights_mapped", mapped_at)
        if self.recorder is not None:
            self.recorder.weights_mapped(mapped_at)
        log.info(
            "weights mapped: %s (%d layers, context %d, device %s, digest %s) in %.2fs",
            engine.model_name,
            engine.num_layers,
            engine.max_context,
            engine.device,
            engine.model_digest,
            time.monotonic() - started,
        )
        self.status.model_name = engine.model_name
        self._lease_weights(engine)
        self.status.engine = engine
        if isinstance(engine, BatchingEngine):
            self.scheduler.attach(engine)
        self.metrics.set_model(engine.model_digest, engine.num_layers)
        self.status.stage = STAGE_LOADING
        self.metrics.set_layers(engine.layers_resident(), engine.num_layers)
        self.order = self._heat_order(engine)
        deadline = time.monotonic() + config.warmup.timeout_s
        for _attempt in range(4):  # a stricter tier mid-way re-plans at it; bounded
            tier = self.guard.state.effective
            plan = self.plan(tier, engine)
            log.info("warm-up plan at tier %s: %s", tier.value, plan.describe())
            self.status.stage = STAGE_LOADING
            if not self.run_plan(engine, plan, deadline, layers_only=True):
                if time.monotonic() > deadline:
                    break
                continue
            self.metrics.mark_phase("weights_loaded")  # the first plan's layers; a re-plan's do not count
            self.status.stage = STAGE_WARMING
            if self.run_plan(engine, plan, deadline):
                self.status.warmup_tier = plan.tier
                self.metrics.set_warmup_tier(plan.tier)
                break
            if time.monotonic() > deadline:
                log.warning("warm-up timeout (%.0fs) reached: ready with what is warm", config.warmup.timeout_s)
                break
        self._check_prefill(engine)
        self._capture_graphs(engine)
        if self.status.unhealthy:  # a request met NaN/Inf logits while the warm-up ran
            raise NonFiniteLogitsError(self.status.error or f"model {engine.model_name!r}: non-finite logits")
        self.metrics.mark_phase("warmup_done")
        self.status.stage = STAGE_READY
        self.metrics.set_ready(True)
        ready_at = time.time()
        self.metrics.mark_phase("ready", ready_at)
        if self.recorder is not None and self.traces is not None:
            self.recorder.ready(ready_at)
            self.traces.cold_start_done(self.recorder, engine.model_digest, ready_at)
            self.recorder = None  # handed over: a later top-up is not part of the cold start
        log.info(
            "ready: %d/%d layers resident, warm-up %s, %.2fs since process start",
            engine.layers_resident(),
            engine.num_layers,
            self.status.progress.describe(),
            time.time() - self.metrics.process_start,
        )

    def _check_prefill(self, engine: Engine) -> None:
        """No warm-up prefill ran (the paused tier, or a deadline before any): one token through
        every layer anyway, so non-finite logits fail the start instead of the first request."""
        progress = self.status.progress
        if any(progress.prefills.values()) or progress.kv_loaded:
            return
        log.info("no warm-up prefill at tier %s: a one-token check prefill before ready (it loads every layer)",
                 self.guard.state.effective.value)
        with self.engine_gate:
            engine.prefill(engine.encode(READINESS_CHECK_PROMPT)[:1] or [0])
        self._refresh_engine_metrics()

    def _lease_weights(self, engine: Engine) -> None:
        """Read leases on the weight files (`weight_leases`); where refused, say what that leaves."""
        checkpoint = getattr(engine, "checkpoint", None)
        if checkpoint is None or not hasattr(checkpoint, "descriptors"):
            return
        if getattr(checkpoint, "fill", None) is not None:
            log.info("weights are a node cache's partial view still filling: no read leases (its writer holds them)")
            return
        refused = self.leases.take(checkpoint.descriptors())
        for path, why in refused:
            log.warning("no read lease on %s (%s): a change in place to a layer already loaded would end the "
                        "process with SIGBUS instead of a clean exit", path, why)

    def weights_changing(self) -> None:
        """SIGIO: a leased weight file is being opened for writing or truncated.  Unready now,
        every request fails at the next batch step (the scheduler checks the leases), and the
        process exits for a restart; the change itself waits for that exit."""
        if not self.leases.held:
            return
        reason = self.leases.lease_broken()
        if self.status.stage != STAGE_FAILED:
            log.error("%s", reason)
            self.status.stage = STAGE_FAILED
            self.status.error = reason
        self._exit_if_failed()

    def _capture_graphs(self, engine: Engine) -> None:
        """CUDA graphs of the decode step, only after a FULL warm-up: graphs hold memory, so a
        truncated or paused tier (memory pressure) skips them. A no-op off CUDA."""
        if not self.config.graph_capture or self.status.warmup_tier != Tier.FULL:
            return
        if not isinstance(engine, GraphCapture):
            return
        started = time.time()
        timings = engine.capture_graphs()
        if self.recorder is not None and timings:
            self.recorder.graph_capture(started, time.time())
        if timings:
            log.info("captured CUDA graphs for decode batch buckets %s in %.3fs",
                     sorted(timings), sum(timings.values()))

    def _heat_order(self, engine: Engine) -> list[int]:
        heat = usable_heat(self.config.heat_map, engine.model_digest, engine.num_layers)
        order = layer_order(heat, engine.num_layers)
        log.info("layer load order (%s): %s", "heat map" if heat else "default: forward", order)
        return order

    def top_up(self) -> None:
        """After ready: deepen the warm-up if the tier relaxed (blocking; run in a thread)."""
        engine = self.status.engine
        if engine is None or self.status.stage != STAGE_READY:
            return
        if isinstance(engine, Sleepable) and engine.sleep_level is not None:
            return  # asleep: a top-up would load the weights sleep just released
        tier = self.guard.state.effective
        plan = self.plan(tier, engine)
        if self.status.progress.remaining(plan).is_empty():
            if (
                self.status.warmup_tier is not None
                and plan.tier.strictness < self.status.warmup_tier.strictness
            ):
                self.status.warmup_tier = plan.tier
                self.metrics.set_warmup_tier(plan.tier)
            return
        log.info("tier %s: topping up the warm-up: %s", tier.value, plan.describe())
        if self.run_plan(engine, plan, None):
            self.status.warmup_tier = plan.tier
            self.metrics.set_warmup_tier(plan.tier)

    def _exit_if_failed(self) -> bool:
        """After ready, a failure that no retry can fix (the weights changed under the mapping)
        sets STAGE_FAILED: unready, then exit non-zero so the pod restarts on the new files."""
        if self.status.stage != STAGE_FAILED:
            return False
        self.metrics.set_ready(False)
        log.error("worker failed after start-up, unready and exiting for a restart: %s", self.status.error)
        self.exit_code = 1
        self.stop.set()
        return True

    async def background(self) -> None:
        """Engine metrics refresh and warm-up top-ups, every guard interval."""
        while not self.stop.is_set():
            await asyncio.to_thread(self._refresh_engine_metrics)
            try:
                await asyncio.to_thread(self.top_up)
            except ModelLoadError as error:  # e.g. WeightsChangedError faulting in a layer
                self.status.stage = STAGE_FAILED
                self.status.error = str(error)
            if self._exit_if_failed():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), timeout=self.config.guard.interval_s)


async def serve_worker(config: ServeConfig) -> int:
    """The start-up order of the module docstring; the process's exit code."""
    torch_start = await asyncio.to_thread(start_torch, config)
    runtime = WorkerRuntime(config, torch_start.device, torch_start)
    listen = config.listen
    control = ControlEndpoint(runtime.guard, listen.control_token_file, runtime.traces)
    sleep = SleepController(runtime.status, runtime.metrics, runtime.scheduler, config.sleep.wake_timeout_s)
    server = WorkerServer(runtime.status, runtime.metrics, runtime.guard, runtime.scheduler, control, config.limits,
                          sleep, config.sleep.vllm_sleep_api, runtime.traces)
    started = await start_site(server.app(), listen.host, listen.port, log)
    if started is None:
        return 1
    runner, sockets = started
    log.info(
        "listening on %s (model %s, device %s)", sockets or f"{listen.host}:{listen.port}", config.model, runtime.device
    )
    stop_on_signals(runtime.stop)
    # Before any lease is taken: SIGIO's default action would end the process.
    asyncio.get_running_loop().add_signal_handler(signal.SIGIO, runtime.weights_changing)

    guard_task = asyncio.create_task(runtime.guard.run(runtime.stop, config.guard.interval_s))
    await asyncio.to_thread(runtime.guard.wait_first_tick, 10.0)
    exit_code = 0
    background: asyncio.Task[None] | None = None
    try:
        startup = asyncio.create_task(asyncio.to_thread(runtime.startup))
        stopper = asyncio.create_task(runtime.stop.wait())
        done, _ = await asyncio.wait({startup, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if startup in done:
            failure = startup.exception()
            if failure is not None:
                runtime.status.stage = STAGE_FAILED
                runtime.status.error = str(failure)
                if isinstance(failure, ModelLoadError | PromptsError | FileNotFoundError):
                    log.error("model load failed: %s", failure)
                else:
                    log.error("model load failed", exc_info=failure)
                exit_code = 1
            else:
                background = asyncio.create_task(runtime.background())
                await stopper
                exit_code = runtime.exit_code
        else:
            log.info("stop requested during start-up")
            startup.cancel()  # the thread finishes its current step; we exit without waiting
            exit_code = runtime.exit_code  # non-zero when the stop was a failure (weights changing)
    finally:
        runtime.stop.set()
        await asyncio.to_thread(runtime.scheduler.stop)
        await cancel_tasks((guard_task, background))
        await runner.cleanup()
        if runtime.traces is not None:
            await asyncio.to_thread(runtime.traces.shutdown)  # flush the spans still queued
    log.info("worker stopped (exit %d)", exit_code)
    return exit_code
