"""The worker's Prometheus metrics (shared with the sidecar: same names, same meanings).

`WorkerMetrics` holds every series both modes export; `SidecarMetrics` adds the external
engine's and the prefetch's figures.  `WorkerMetrics.publish_guard` is the one place the
tier guard's state becomes series, for both modes.

Every name comes from `warmpool.contract`; the operator scrapes them with
`prometheus_client.parser`.  A dedicated CollectorRegistry (not the global one) keeps tests
and several workers in one process apart and exports nothing we did not declare.

A figure we do not have is *absent*, never 0: the memory series disappear when the probe
has no reading, so the operator sees Unknown rather than "0 % used".
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from warmpool_worker.engine_signals import EngineSignals, EngineSignalsCollector

from warmpool.contract.api import Tier
from warmpool.contract.files import TOKEN_LENGTH_EDGES
from warmpool.contract.metrics import (
    LABEL_BATCH,
    LABEL_BUCKET,
    LABEL_DIGEST,
    LABEL_LAYER,
    LABEL_LAYERS,
    LABEL_PHASE,
    LABEL_REASON,
    LABEL_SOURCE,
    LABEL_TIER,
    METRIC_BATCH_OVERTAKES,
    METRIC_BATCH_PREEMPTIONS,
    METRIC_BATCH_QUEUE_WAIT_SECONDS,
    METRIC_BATCH_WAITING,
    METRIC_DIRECTIVE_ACTIVE,
    METRIC_ENGINE_BATCH_FINISHED,
    METRIC_ENGINE_BATCH_SECONDS,
    METRIC_ENGINE_BUSY_SECONDS,
    METRIC_ENGINE_MEMORY_RATIO,
    METRIC_ENGINE_RESTARTS,
    METRIC_ENGINE_UP,
    METRIC_GENERATED_TOKENS,
    METRIC_GENERATION_TOKENS_PER_SECOND,
    METRIC_KV_BLOCKS_FREE,
    METRIC_KV_BLOCKS_RESERVED,
    METRIC_KV_BLOCKS_TOTAL,
    METRIC_KV_BLOCKS_USED,
    METRIC_KV_CACHE_TOKENS,
    METRIC_KV_PREFIX_SAVE_ERRORS,
    METRIC_LAYER_HEAT,
    METRIC_LAYERS_RESIDENT,
    METRIC_LAYERS_TOTAL,
    METRIC_LOCAL_TIER,
    METRIC_MEMORY_CAPACITY_BYTES,
    METRIC_MEMORY_USED_BYTES,
    METRIC_MEMORY_USED_RATIO,
    METRIC_MODEL_INFO,
    METRIC_NON_FINITE_LOGITS,
    METRIC_PHASE_DURATION,
    METRIC_PHASE_TIMESTAMP,
    METRIC_PREFETCH_FILE_ERRORS,
    METRIC_PREFETCH_READ_BYTES,
    METRIC_PREFETCH_RESIDENT_BYTES,
    METRIC_PREFETCH_TARGET_BYTES,
    METRIC_READY,
    METRIC_REQUEST_GENERATED_TOKENS,
    METRIC_REQUEST_PROMPT_TOKENS,
    METRIC_REQUESTS_CANCELLED,
    METRIC_REQUESTS_IN_FLIGHT,
    METRIC_REQUESTS_QUEUED,
    METRIC_REQUESTS_REJECTED,
    METRIC_REQUESTS_RUNNING,
    METRIC_REQUESTS_TOTAL,
    METRIC_SLEEP_CAPABLE,
    METRIC_SLEEP_LEVEL,
    METRIC_SLEEP_RELEASED_BYTES,
    METRIC_SLEEPS,
    METRIC_TIER,
    METRIC_TOKENS_AFTER_DISCONNECT,
    METRIC_TTFT,
    METRIC_WAKE_DURATION,
    METRIC_WAKES,
    METRIC_WAKES_ON_REQUEST,
    METRIC_WARMUP_ERRORS,
    METRIC_WARMUP_NEEDED,
    METRIC_WARMUP_PLANNED,
    METRIC_WARMUP_PREFILLS,
    METRIC_WARMUP_TIER,
    PHASES,
    batch_bucket,
)

if TYPE_CHECKING:
    from warmpool_worker.engine_api import KVBlockStats
    from warmpool_worker.guard import GuardState
    from warmpool_worker.prefetch import PrefetchReport

TOKENS_PER_SECOND_WINDOW = 10.0


#: TTFT buckets: from a warm tiny model on a GPU (ms) to a cold large one on a CPU (a minute).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: Wake takes ~0.1 s (level 1 on a small model) to seconds (level 2 re-reading large files).
WAKE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST

#: The memory source of a reading that is a ratio, not bytes (the sidecar's engine KV-cache
#: usage, scaled to the guard's byte-speaking probe): only its ratio series is exported.
ENGINE_KV_SOURCE = "engine_kv"


def process_start_time(proc: Path = Path("/proc")) -> float:
    """Unix time this process started, from the kernel (so interpreter start and imports count).

    /proc/self/stat field 22 is the start in clock ticks since boot, and /proc/uptime the seconds
    since boot now (to the hundredth): the start is that long before now.  (/proc/stat's ``btime``
    is the boot time in whole seconds: a start from it is early by up to a second.)  Falls back
    to now where /proc is not Linux's.
    """
    try:
        stat = (proc / "self" / "stat").read_text()
        # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        fields = stat[stat.rindex(")") + 2 :].split()
        start_ticks = int(fields[19])  # field 22 overall; fields[0] here is field 3
        now, uptime = time.time(), float((proc / "uptime").read_text().split()[0])
        return now - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class _SchedulingMetrics:
    """The built-in batch's scheduling figures (its queue, preemptions, overtakes): part of
    `WorkerMetrics`, which registers them (`_register_scheduling`) and is the batch's observer."""

    def _register_scheduling(self, r: CollectorRegistry) -> None:
        self.batch_waiting = Gauge(
            METRIC_BATCH_WAITING, "Requests waiting for the engine's running batch (preempted ones included)",
            registry=r,
        )
        self.batch_preemptions = Counter(
            METRIC_BATCH_PREEMPTIONS, "Running requests preempted (KV dropped, recomputed later) for lack of KV",
            registry=r,
        )
        self.batch_overtakes = Counter(
            METRIC_BATCH_OVERTAKES, "Requests that joined the batch ahead of one that arrived earlier", registry=r
        )
        self.batch_queue_wait = Counter(
            METRIC_BATCH_QUEUE_WAIT_SECONDS, "Seconds requests waited to join the batch", registry=r
        )

    def batch_admitted(self, waited_s: float, overtook: bool) -> None:
        self.batch_queue_wait.inc(max(0.0, waited_s))
        if overtook:
            self.batch_overtakes.inc()

    def batch_preempted(self) -> None:
        self.batch_preemptions.inc()


class _WarmupPrefillMetrics:
    """The warm-up's prefills per bucket (planned, needed once settled, done): part of
    `WorkerMetrics`, which registers them (`_register_warmup_prefills`)."""

    def _register_warmup_prefills(self, r: CollectorRegistry) -> None:
        self.warmup_prefills = Counter(
            METRIC_WARMUP_PREFILLS, "Warm-up prefills done per length bucket", [LABEL_BUCKET], registry=r
        )
        self.warmup_planned = Gauge(
            METRIC_WARMUP_PLANNED,
            "Warm-up prefills the current plan asks for per bucket",
            [LABEL_BUCKET],
            registry=r,
        )
        self.warmup_needed = Gauge(
            METRIC_WARMUP_NEEDED,
            "Warm-up prefills the current plan needs per bucket: a settled bucket's prefills until it settled",
            [LABEL_BUCKET],
            registry=r,
        )

    def set_planned(self, per_bucket: Mapping[int, int], settled: Mapping[int, int] | None = None) -> None:
        """A new plan's prompts per bucket; `settled`: bucket -> prefills after which it settled."""
        self.warmup_planned.clear()
        self.warmup_needed.clear()
        for bucket, count in per_bucket.items():
            self.warmup_planned.labels(str(bucket)).set(count)
            self.warmup_needed.labels(str(bucket)).set(min(count, (settled or {}).get(bucket, count)))

    def bucket_settled(self, bucket: int, prefills: int) -> None:
        """A bucket of the current plan settled after `prefills`: that is all it needs."""
        self.warmup_needed.labels(str(bucket)).set(prefills)

    def warmup_prefill_done(self, bucket: int) -> None:
        self.warmup_prefills.labels(str(bucket)).inc()


class WorkerMetrics(_SchedulingMetrics, _WarmupPrefillMetrics):
    """All the worker's series in one registry; methods named after what happened."""

    def __init__(self, process_start: float | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.process_start = process_start_time() if process_start is None else process_start
        self.phase_timestamp = Gauge(
            METRIC_PHASE_TIMESTAMP, "Unix time each cold-start phase was reached", [LABEL_PHASE], registry=r
        )
        self.phase_duration = Gauge(
            METRIC_PHASE_DURATION,
            "Seconds from process start to each cold-start phase",
            [LABEL_PHASE],
            registry=r,
        )
        self.ttft = Histogram(
            METRIC_TTFT, "Time to first token of served requests", buckets=TTFT_BUCKETS, registry=r
        )
        self.memory_ratio = Gauge(
            METRIC_MEMORY_USED_RATIO,
            "Accelerator memory used / capacity (absent when unknown)",
            [LABEL_SOURCE],
            registry=r,
        )
        self.memory_used = Gauge(
            METRIC_MEMORY_USED_BYTES, "Accelerator memory used", [LABEL_SOURCE], registry=r
        )
        self.memory_capacity = Gauge(
            METRIC_MEMORY_CAPACITY_BYTES, "Accelerator memory capacity", [LABEL_SOURCE], registry=r
        )
        self.tier = Gauge(
            METRIC_TIER, "Effective warm-up tier (1 for the active one)", [LABEL_TIER], registry=r
        )
        self.local_tier = Gauge(METRIC_LOCAL_TIER, "Tier the local guard decided", [LABEL_TIER], registry=r)
        self.warmup_tier = Gauge(METRIC_WARMUP_TIER, "Tier the last warm-up ran at", [LABEL_TIER], registry=r)
        self.directive_active = Gauge(
            METRIC_DIRECTIVE_ACTIVE, "1 while an operator directive holds", registry=r
        )
        self.layers_resident = Gauge(METRIC_LAYERS_RESIDENT, "Decoder layers materialised", registry=r)
        self.layers_total = Gauge(METRIC_LAYERS_TOTAL, "Decoder layers in the model", registry=r)
        self._register_warmup_prefills(r)
        self.layer_heat = Gauge(
            METRIC_LAYER_HEAT, "Per-layer heat (decayed access counts)", [LABEL_LAYER], registry=r
        )
        self.model_info = Gauge(
            METRIC_MODEL_INFO,
            "1 for the checkpoint this worker mapped (digest, decoder layers): keys the operator's heat map",
            [LABEL_DIGEST, LABEL_LAYERS],
            registry=r,
        )
        self.ready = Gauge(METRIC_READY, "1 when warm and serving", registry=r)
        self.generated_tokens = Counter(
            METRIC_GENERATED_TOKENS, "Tokens generated for served requests", registry=r
        )
        self.requests_total = Counter(
            METRIC_REQUESTS_TOTAL, "Completions received (counted on arrival, whatever their outcome)", registry=r
        )
        self.requests_in_flight = Gauge(
            METRIC_REQUESTS_IN_FLIGHT, "Completions received and not yet answered", registry=r
        )
        self.requests_queued = Gauge(
            METRIC_REQUESTS_QUEUED, "Requests admitted and waiting for the engine", registry=r
        )
        self.requests_rejected = Counter(
            METRIC_REQUESTS_REJECTED, "Requests refused before any work, by reason", [LABEL_REASON], registry=r
        )
        self.requests_cancelled = Counter(
            METRIC_REQUESTS_CANCELLED, "Requests whose client disconnected before the end", registry=r
        )
        self.tokens_after_disconnect = Counter(
            METRIC_TOKENS_AFTER_DISCONNECT,
            "Decode steps run after the client was seen gone (at most one per cancelled request)",
            registry=r,
        )
        self.kv_cache_tokens = Gauge(
            METRIC_KV_CACHE_TOKENS, "KV-cache token slots allocated for the requests in flight", registry=r
        )
        self.kv_prefix_save_errors = Counter(
            METRIC_KV_PREFIX_SAVE_ERRORS,
            "Warm-prefix KV files that could not be saved, by errno name",
            [LABEL_REASON],
            registry=r,
        )
        self.non_finite_logits = Counter(
            METRIC_NON_FINITE_LOGITS, "Requests and warm-up prefills whose logits held NaN/Inf", registry=r
        )
        self.sleep_level = Gauge(METRIC_SLEEP_LEVEL, "Sleep level of the engine, 0 when awake", registry=r)
        self.sleeps = Counter(METRIC_SLEEPS, "Times the engine was put to sleep", registry=r)
        self.wakes = Counter(METRIC_WAKES, "Times the engine was woken", registry=r)
        self.wake_duration = Histogram(
            METRIC_WAKE_DURATION, "Seconds from wake asked to awake (one-prompt check included)",
            buckets=WAKE_BUCKETS, registry=r,
        )
        self.sleep_released = Gauge(
            METRIC_SLEEP_RELEASED_BYTES, "Memory the last sleep released (measured)", registry=r
        )
        self.sleep_capable = Gauge(
            METRIC_SLEEP_CAPABLE, "1 when the engine has a sleep API, 0 when it has none", registry=r
        )
        self.wakes_on_request = Counter(
            METRIC_WAKES_ON_REQUEST, "Completions that found the engine asleep and woke it", registry=r
        )
        self.request_prompt_tokens = Histogram(
            METRIC_REQUEST_PROMPT_TOKENS, "Prompt tokens per served request",
            buckets=TOKEN_LENGTH_EDGES, registry=r,
        )
        self.request_generated_tokens = Histogram(
            METRIC_REQUEST_GENERATED_TOKENS, "Tokens generated per served request",
            buckets=TOKEN_LENGTH_EDGES, registry=r,
        )
        self.engine_busy = Counter(
            METRIC_ENGINE_BUSY_SECONDS, "Seconds the engine spent generating for served requests", registry=r
        )
        self.engine_batch_seconds = Counter(METRIC_ENGINE_BATCH_SECONDS, "Engine-busy seconds by the batch's size",
                                            [LABEL_BATCH], registry=r)
        self.engine_batch_finished = Counter(METRIC_ENGINE_BATCH_FINISHED, "Requests finished by the batch's size",
                                             [LABEL_BATCH], registry=r)
        self.requests_running = Gauge(
            METRIC_REQUESTS_RUNNING, "Requests in the engine's running batch", registry=r
        )
        self.kv_blocks_total = Gauge(METRIC_KV_BLOCKS_TOTAL, "KV-cache blocks the batch shares", registry=r)
        self.kv_blocks_used = Gauge(METRIC_KV_BLOCKS_USED, "KV-cache blocks holding K/V now", registry=r)
        self.kv_blocks_reserved = Gauge(
            METRIC_KV_BLOCKS_RESERVED, "KV-cache blocks reserved for running requests' next steps",
            registry=r,
        )
        self.kv_blocks_free = Gauge(
            METRIC_KV_BLOCKS_FREE, "KV-cache blocks a new request can still reserve", registry=r
        )
        self._register_scheduling(r)
        self.tokens_per_second = Gauge(
            METRIC_GENERATION_TOKENS_PER_SECOND,
            f"Tokens generated per second over the last {TOKENS_PER_SECOND_WINDOW:g} s", registry=r,
        )
        self._token_times = _TokenWindow(TOKENS_PER_SECOND_WINDOW)
        self.tokens_per_second.set_function(self._token_times.rate)
        self.ready.set(0)
        self.directive_active.set(0)
        self.sleep_level.set(0)
        self.sleep_capable.set(1)  # the built-in engine sleeps; the sidecar sets what it found
        self._phases: set[str] = set()
        self.mark_phase("process_start", self.process_start)

    # -- cold-start phases -------------------------------------------------------------
    def mark_phase(self, phase: str, at: float | None = None) -> None:
        """Record a phase once (the first time it is reached counts)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
        if phase in self._phases:
            return
        self._phases.add(phase)
        when = time.time() if at is None else at
        self.phase_timestamp.labels(phase).set(when)
        self.phase_duration.labels(phase).set(max(0.0, when - self.process_start))

    # -- memory and tiers --------------------------------------------------------------
    def set_memory(self, used_bytes: int | None, capacity_bytes: int | None, source: str | None) -> None:
        """A reading, or all None for "unknown" (the series are removed, never set to 0)."""
        for gauge in (self.memory_ratio, self.memory_used, self.memory_capacity):
            gauge.clear()  # a changed source must not leave the old series behind
        if used_bytes is None or capacity_bytes is None or source is None or capacity_bytes <= 0:
            return
        self.memory_used.labels(source).set(used_bytes)
        self.memory_capacity.labels(source).set(capacity_bytes)
        self.memory_ratio.labels(source).set(used_bytes / capacity_bytes)

    def publish_guard(self, state: GuardState) -> None:
        """The tier guard's update callback (both modes): its reading and tiers as series."""
        reading = state.reading
        if reading is None:
            self.set_memory(None, None, None)
        elif reading.source == ENGINE_KV_SOURCE:
            self.set_memory(None, None, None)  # a ratio, not bytes: only the ratio series
            self.memory_ratio.labels(reading.source).set(reading.ratio)
        else:
            self.set_memory(reading.used_bytes, reading.capacity_bytes, reading.source)
        self.set_tier(state.effective, state.local, state.directive is not None)

    @staticmethod
    def _set_tier(gauge: Gauge, tier: Tier) -> None:
        for each in Tier:
            gauge.labels(each.value).set(1 if each is tier else 0)

    def set_tier(self, effective: Tier, local: Tier, directive_active: bool) -> None:
        self._set_tier(self.tier, effective)
        self._set_tier(self.local_tier, local)
        self.directive_active.set(1 if directive_active else 0)

    def set_warmup_tier(self, tier: Tier) -> None:
        self._set_tier(self.warmup_tier, tier)

    # -- layers, warm-up, heat, requests -----------------------------------------------
    def set_model(self, digest: str, layers: int) -> None:
        self.model_info.clear()
        self.model_info.labels(digest, str(layers)).set(1)

    def set_layers(self, resident: int, total: int) -> None:
        self.layers_resident.set(resident)
        self.layers_total.set(total)

    def set_heat(self, heat: Mapping[int, float]) -> None:
        for layer, value in heat.items():
            self.layer_heat.labels(str(layer)).set(value)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def token_generated(self) -> None:
        self.generated_tokens.inc()

    def request_arrived(self) -> None:
        self.requests_total.inc()
        self.requests_in_flight.inc()

    def request_done(self) -> None:
        self.requests_in_flight.dec()

    def request_served(self, prompt_tokens: int, generated_tokens: int) -> None:
        """One request the engine worked on (cancelled ones too: they used the engine)."""
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generated_tokens.observe(generated_tokens)

    # -- the running batch (`batch_scheduler.BatchObserver`) ---------------------------------
    def set_batch(self, running: int, waiting: int) -> None:
        self.requests_running.set(running)
        self.batch_waiting.set(waiting)

    def engine_step(self, seconds: float, tokens: int, batch: int, finished: int) -> None:
        """One batch step of ``batch`` requests: its wall time is engine-busy time, once, whatever
        the batch size, and a point of the capacity curve at that size with the ``finished`` ones."""
        busy = max(0.0, seconds)
        self.engine_busy.inc(busy)
        self._token_times.add(tokens)
        label = str(batch_bucket(max(1, batch)))
        self.engine_batch_seconds.labels(label).inc(busy)
        if finished > 0:
            self.engine_batch_finished.labels(label).inc(finished)

    def set_kv_blocks(self, stats: KVBlockStats) -> None:
        self.kv_blocks_total.set(stats.total)
        self.kv_blocks_used.set(stats.used)
        self.kv_blocks_reserved.set(stats.reserved)
        self.kv_blocks_free.set(stats.free)

    def set_queued(self, waiting: int) -> None:
        self.requests_queued.set(waiting)

    def request_rejected(self, reason: str) -> None:
        self.requests_rejected.labels(reason).inc()

    def request_cancelled(self, steps_after_disconnect: int) -> None:
        self.requests_cancelled.inc()
        self.tokens_after_disconnect.inc(steps_after_disconnect)

    def set_kv_cache_tokens(self, slots: int) -> None:
        self.kv_cache_tokens.set(slots)

    def kv_prefix_save_failed(self, error: OSError) -> None:
        reason = errno.errorcode.get(error.errno or 0, "unknown")
        self.kv_prefix_save_errors.labels(reason).inc()

    def logits_non_finite(self) -> None:
        self.non_finite_logits.inc()

    def slept(self, level: int, released_bytes: int | None) -> None:
        """`released_bytes` None: not measurable here (the sidecar's engine): the series stays absent."""
        self.sleeps.inc()
        self.sleep_level.set(level)
        if released_bytes is not None:
            self.sleep_released.set(released_bytes)

    def woke(self, seconds: float, on_request: bool) -> None:
        self.wakes.inc()
        self.sleep_level.set(0)
        self.wake_duration.observe(seconds)
        if on_request:
            self.wakes_on_request.inc()

    def set_ready(self, ready: bool) -> None:
        self.ready.set(1 if ready else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _TokenWindow:
    """Tokens counted per step over a sliding window of wall time: the tokens/s gauge."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()

    def add(self, tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._steps.append((now, tokens))
            self._trim(now)

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(tokens for _, tokens in self._steps) / self.window_s


class SidecarMetrics(WorkerMetrics):
    """The worker's metrics (same names) plus the external engine's and the prefetch's figures."""

    def __init__(self, process_start: float | None = None) -> None:
        super().__init__(process_start)
        r = self.registry
        self.engine_up = Gauge(METRIC_ENGINE_UP, "1 while the engine answers its health endpoint", registry=r)
        self.engine_restarts = Counter(
            METRIC_ENGINE_RESTARTS, "Engine restarts or outages seen after it had answered", registry=r
        )
        self.warmup_errors = Counter(
            METRIC_WARMUP_ERRORS, "Failed warm-up requests to the engine", [LABEL_REASON], registry=r
        )
        self.engine_memory = Gauge(
            METRIC_ENGINE_MEMORY_RATIO,
            "The engine's own memory figure (vLLM KV-cache usage, 0..1; absent when unknown)",
            [LABEL_SOURCE],
            registry=r,
        )
        self.prefetch_target = Gauge(METRIC_PREFETCH_TARGET_BYTES, "Weight bytes the prefetch targets", registry=r)
        self.prefetch_read = Gauge(METRIC_PREFETCH_READ_BYTES, "Weight bytes the prefetch has read", registry=r)
        self.prefetch_resident = Gauge(
            METRIC_PREFETCH_RESIDENT_BYTES, "Target bytes resident in the page cache (mincore)", registry=r
        )
        self.prefetch_file_errors = Gauge(
            METRIC_PREFETCH_FILE_ERRORS, "Weight files the prefetch could not use", registry=r
        )
        self.engine_up.set(0)
        #: The engine's request figures replace the built-in worker's series of the same names
        #: (the sidecar serves no requests itself: a request counter stuck at 0 would read as
        #: "idle" and put a busy engine to sleep; an engine without the figure has none, and the
        #: operator never puts it to sleep).
        self.engine_signals = EngineSignalsCollector()
        self._replace_series(self.engine_signals)
        # The built-in engine's batch figures: the sidecar has no such batch to report (absent, not 0).
        for builtin_only in (self.engine_batch_seconds, self.engine_batch_finished, self.requests_running,
                             self.batch_waiting, self.batch_preemptions, self.batch_overtakes,
                             self.batch_queue_wait, self.kv_blocks_total, self.kv_blocks_used,
                             self.kv_blocks_reserved, self.kv_blocks_free, self.tokens_per_second):
            self.registry.unregister(builtin_only)

    def _replace_series(self, collector: EngineSignalsCollector) -> None:
        """Unregister every inherited metric whose name ``collector`` owns, then register it."""
        owned = {family.name for family in collector.describe()}
        for value in list(vars(self).values()):
            if isinstance(value, MetricWrapperBase) and any(f.name in owned for f in value.describe()):
                self.registry.unregister(value)
        self.registry.register(collector)

    def set_engine_signals(self, signals: EngineSignals) -> None:
        self.engine_signals.update(signals)

    def set_engine_memory(self, ratio: float | None, source: str | None) -> None:
        self.engine_memory.clear()  # unknown is absent, never 0
        if ratio is not None and source is not None:
            self.engine_memory.labels(source).set(ratio)

    def set_prefetch(self, report: PrefetchReport, file_errors: int) -> None:
        self.prefetch_target.set(report.target_bytes)
        self.prefetch_read.set(report.read_bytes)
        self.prefetch_file_errors.set(file_errors)
        if report.resident_after is not None:
            self.prefetch_resident.set(report.resident_after)
