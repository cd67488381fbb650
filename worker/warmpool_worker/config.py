"""The worker's configuration: typed, frozen objects built once at the edge (the CLI).

`ServeConfig` (``warmpool worker serve``) and `SidecarConfig` (``warmpool worker sidecar``)
share three parts: where to listen (`ListenConfig`), the local tier guard (`GuardConfig`) and
the warm-up (`WarmupConfig`).  The start-up code takes these objects, never an
``argparse.Namespace``, so every field is typed and a misspelt one fails the type check.

Each object checks its values when it is built and raises `ConfigError` naming the flag a
person would change, so a bad value stops the command at once (exit 2 from the CLI) instead
of surfacing later as a busy loop or an odd failure in a pod.  Checks that need the model
(the dtype, a device that is absent) stay with the engine that knows the answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from warmpool_worker.defaults import (
    DEFAULT_CGROUP_ROOT,
    DEFAULT_CHARS_PER_TOKEN,
    DEFAULT_DECODE_TOKENS,
    DEFAULT_ENGINE_METRICS_PATH,
    DEFAULT_GUARD_INTERVAL_S,
    DEFAULT_HOST,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_LOST_AFTER,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_TOKENS_LIMIT,
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    DEFAULT_PROBE_TIMEOUT_S,
    DEFAULT_PROMPTS_PER_BUCKET,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_RETRIES,
    DEFAULT_RETRY_BACKOFF_S,
    DEFAULT_SLEEP_DRAIN_TIMEOUT_S,
    DEFAULT_WAKE_TIMEOUT_S,
)
from warmpool_worker.device import valid_device

if TYPE_CHECKING:  # only with --partial-cache is the module imported (the CLI builds it then)
    from warmpool_worker.partial_cache import PartialCacheConfig
from warmpool_worker.defaults import ENGINE_SLEEP_APIS
from warmpool_worker.tracing import TracingConfig

from warmpool.contract.api import DEFAULT_HOT_LAYER_PERCENT, DEFAULT_LENGTH_BUCKETS, DEFAULT_WARMUP_TIMEOUT_SECONDS
from warmpool.contract.http import DEFAULT_ENGINE_HEALTH_PATH, DEFAULT_WORKER_PORT
from warmpool.tiering import Thresholds

MemorySource = Literal["device", "engine-kv"]
PrefetchMode = Literal["read", "advise"]
MEMORY_SOURCES: tuple[MemorySource, ...] = ("device", "engine-kv")
PREFETCH_MODES: tuple[PrefetchMode, ...] = ("read", "advise")


class ConfigError(ValueError):
    """A setting the worker cannot run with; the message starts with the flag to change."""

    def __init__(self, flag: str, problem: str) -> None:
        super().__init__(f"{flag} {problem}")
        self.flag = flag


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(value: object, flag: str) -> None:
    if not _int(value) or not isinstance(value, int) or value < 1:
        raise ConfigError(flag, f"must be a positive integer, got {value!r}")


def _non_negative_int(value: object, flag: str) -> None:
    if not _int(value) or not isinstance(value, int) or value < 0:
        raise ConfigError(flag, f"must be an integer >= 0, got {value!r}")


def _positive_seconds(value: object, flag: str) -> None:
    if not _number(value) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(flag, f"must be a positive number of seconds, got {value!r}")


def _non_negative_seconds(value: object, flag: str) -> None:
    if not _number(value) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(flag, f"must be a number of seconds >= 0, got {value!r}")


def _percent(value: object, flag: str) -> None:
    if not _number(value) or not isinstance(value, int | float) or not 0 <= value <= 100:
        raise ConfigError(flag, f"must be a percentage within 0..100, got {value!r}")


def _optional_file(value: object, flag: str) -> None:
    if value is not None and not isinstance(value, Path):
        raise ConfigError(flag, f"must be a path, got {value!r}")


def _url_path(value: str, flag: str) -> None:
    if not value.startswith("/") or any(c.isspace() for c in value):
        raise ConfigError(flag, f"must be a URL path starting with '/', got {value!r}")


@dataclass(frozen=True)
class ListenConfig:
    """Where the worker's HTTP surface binds, and the token that guards its control endpoint."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_WORKER_PORT  # 0: any free port (tests)
    control_token_file: Path | None = None

    def __post_init__(self) -> None:
        if not self.host or any(c.isspace() for c in self.host):
            raise ConfigError("--host", f"must be an address to bind, got {self.host!r}")
        if not _int(self.port) or not 0 <= self.port <= 65535:
            raise ConfigError("--port", f"must be a port within 0..65535, got {self.port!r}")
        _optional_file(self.control_token_file, "--control-token-file")


@dataclass(frozen=True)
class GuardConfig:
    """The local tier guard: thresholds, what memory it measures against, how often."""

    thresholds: Thresholds = field(default_factory=Thresholds)
    #: Measure against this capacity (used = this process tree + `memory_account_pids`).
    memory_capacity_bytes: int | None = None
    memory_account_pids: tuple[int, ...] = ()
    interval_s: float = DEFAULT_GUARD_INTERVAL_S

    def __post_init__(self) -> None:
        if self.memory_capacity_bytes is not None:
            _positive_int(self.memory_capacity_bytes, "--memory-capacity-bytes")
        for pid in self.memory_account_pids:
            _positive_int(pid, "--memory-account-pid")
        _positive_seconds(self.interval_s, "--guard-interval")


@dataclass(frozen=True)
class WarmupConfig:
    """The warm-up both modes run (`warmup.plan_for_tier` turns it into a plan per tier)."""

    buckets: tuple[int, ...] = DEFAULT_LENGTH_BUCKETS  # prompt lengths in tokens, shortest first
    prompts_per_bucket: int = DEFAULT_PROMPTS_PER_BUCKET
    decode_tokens: int = DEFAULT_DECODE_TOKENS
    hot_layer_percent: float = DEFAULT_HOT_LAYER_PERCENT  # layers kept when truncated
    prompts_file: Path | None = None  # None: the built-in representative prompts
    timeout_s: float = float(DEFAULT_WARMUP_TIMEOUT_SECONDS)  # then ready with what is warm

    def __post_init__(self) -> None:
        if (
            not self.buckets
            or not all(_int(b) and b > 0 for b in self.buckets)
            or list(self.buckets) != sorted(set(self.buckets))
        ):
            raise ConfigError(
                "--buckets", f"must be distinct positive token counts, shortest first, got {self.buckets!r}"
            )
        _positive_int(self.prompts_per_bucket, "--prompts-per-bucket")
        _positive_int(self.decode_tokens, "--decode-tokens")
        _percent(self.hot_layer_percent, "--hot-layer-percent")
        _optional_file(self.prompts_file, "--prompts")
        _positive_seconds(self.timeout_s, "--warmup-timeout")


@dataclass(frozen=True)
class ServingLimits:
    """Bounds of the request path and of the engine's running batch (`--max-queued-requests`,
    `--max-tokens-limit`, `--max-batch-size`, `--kv-cache-bytes`, `--prefill-chunk-tokens`)."""

    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS

    def __post_init__(self) -> None:
        _positive_int(self.max_queued_requests, "--max-queued-requests")
        _positive_int(self.max_tokens_limit, "--max-tokens-limit")
        _positive_int(self.max_batch_size, "--max-batch-size")
        _positive_int(self.kv_cache_bytes, "--kv-cache-bytes")
        _positive_int(self.prefill_chunk_tokens, "--prefill-chunk-tokens")


@dataclass(frozen=True)
class SleepConfig:
    """Engine sleep: how long a completion waits for a sleeping engine to wake
    (`--wake-timeout`), and whether vLLM's unauthenticated dev-mode sleep API is served too
    (`--vllm-sleep-api`, off by default: it is what VLLM_SERVER_DEV_MODE=1 turns on in vLLM,
    for standing in as a vLLM engine behind the sidecar)."""

    wake_timeout_s: float = DEFAULT_WAKE_TIMEOUT_S
    vllm_sleep_api: bool = False
    #: How long a sleep waits for the running batch to drain before it is refused (409).
    drain_timeout_s: float = DEFAULT_SLEEP_DRAIN_TIMEOUT_S

    def __post_init__(self) -> None:
        if isinstance(self.wake_timeout_s, bool) or not self.wake_timeout_s > 0:
            raise ConfigError("--wake-timeout", f"must be a positive number of seconds, got {self.wake_timeout_s!r}")
        _non_negative_seconds(self.drain_timeout_s, "--sleep-drain-timeout")


def _check_device(device: str) -> None:
    if not valid_device(device):
        raise ConfigError("--device", f"must be auto, cpu, cuda or cuda:N, got {device!r}")


@dataclass(frozen=True)
class ServeConfig:
    """``warmpool worker serve``: the built-in engine loads, warms and serves one model."""

    model: Path  # model directory (HF layout, safetensors)
    model_name: str | None = None  # served on /v1/models; default: the directory's name
    device: str = "auto"  # auto | cpu | cuda | cuda:N (resolved at start-up)
    dtype: str | None = None  # None: per device and checkpoint (the engine checks the name)
    heat_map: Path | None = None
    kv_prefix_dir: Path | None = None  # persist / reload the warm-prefix KV here
    partial_cache: PartialCacheConfig | None = None  # the model may be a partial view still filling
    graph_capture: bool = True  # CUDA graphs of the decode step after a full warm-up
    threads: int | None = None  # torch intra-op threads; None: from the CPU quota
    cgroup_root: Path = Path(DEFAULT_CGROUP_ROOT)
    listen: ListenConfig = field(default_factory=ListenConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    limits: ServingLimits = field(default_factory=ServingLimits)
    sleep: SleepConfig = field(default_factory=SleepConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)  # from the OTEL_* variables

    def __post_init__(self) -> None:
        if not isinstance(self.model, Path) or not str(self.model):
            raise ConfigError("--model", f"must be a model directory, got {self.model!r}")
        if self.model_name is not None and not self.model_name.strip():
            raise ConfigError("--model-name", "must not be empty")
        _check_device(self.device)
        _optional_file(self.heat_map, "--heat-map")
        _optional_file(self.kv_prefix_dir, "--kv-prefix-dir")
        if self.threads is not None:
            _positive_int(self.threads, "--threads")
        if self.partial_cache is not None and not (
                math.isfinite(self.partial_cache.timeout_s) and self.partial_cache.timeout_s > 0):
            raise ConfigError("--partial-cache-timeout",
                              f"must be a positive number of seconds, got {self.partial_cache.timeout_s!r}")

    @property
    def served_name(self) -> str:
        """The model name before the engine has read the checkpoint."""
        return self.model_name or self.model.name


@dataclass(frozen=True)
class SidecarConfig:
    """``warmpool worker sidecar``: prefetch, warm and gate readiness of an external engine."""

    engine_url: str  # the engine's base URL, e.g. http://127.0.0.1:8000
    model_dir: Path | None = None  # the engine's weights (prefetched in heat order)
    health_path: str = DEFAULT_ENGINE_HEALTH_PATH
    engine_metrics_path: str = DEFAULT_ENGINE_METRICS_PATH
    served_model_name: str | None = None  # None: the engine's /v1/models
    api_key_file: Path | None = None
    max_context: int | None = None  # None: /v1/models, else config.json
    device: str = "auto"  # for the memory probe
    heat_map: Path | None = None
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN  # prompt sizing without a tokenizer.json
    memory_source: MemorySource = "device"
    prefetch: bool = True
    prefetch_mode: PrefetchMode = "read"
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    lost_after: int = DEFAULT_LOST_AFTER  # failed health probes in a row that mean "engine lost"
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    retries: int = DEFAULT_RETRIES  # per warm-up request
    retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S  # first retry delay (doubles)
    listen: ListenConfig = field(default_factory=ListenConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    engine_sleep_api: str = "auto"  # auto | vllm | sglang | none (sidecar.sleep's docstring)

    def __post_init__(self) -> None:
        if self.engine_sleep_api not in ENGINE_SLEEP_APIS:
            raise ConfigError("--engine-sleep-api",
                              f"must be one of {list(ENGINE_SLEEP_APIS)}, got {self.engine_sleep_api!r}")
        url = urlsplit(self.engine_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError("--engine-url", f"must be an http(s) URL with a host, got {self.engine_url!r}")
        _optional_file(self.model_dir, "--model-dir")
        _url_path(self.health_path, "--health-path")
        _url_path(self.engine_metrics_path, "--engine-metrics-path")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("--served-model-name", "must not be empty")
        _optional_file(self.api_key_file, "--api-key-file")
        if self.max_context is not None:
            _positive_int(self.max_context, "--max-context")
        _check_device(self.device)
        _optional_file(self.heat_map, "--heat-map")
        if not _number(self.chars_per_token) or self.chars_per_token <= 0:
            raise ConfigError("--chars-per-token", f"must be a positive number, got {self.chars_per_token!r}")
        if self.memory_source not in MEMORY_SOURCES:
            raise ConfigError("--memory-source", f"must be one of {list(MEMORY_SOURCES)}, got {self.memory_source!r}")
        if self.prefetch_mode not in PREFETCH_MODES:
            raise ConfigError("--prefetch-mode", f"must be one of {list(PREFETCH_MODES)}, got {self.prefetch_mode!r}")
        _positive_seconds(self.poll_interval_s, "--poll-interval")
        _positive_int(self.lost_after, "--lost-after")
        _positive_seconds(self.probe_timeout_s, "--probe-timeout")
        _positive_seconds(self.request_timeout_s, "--request-timeout")
        _non_negative_int(self.retries, "--retries")
        _non_negative_seconds(self.retry_backoff_s, "--retry-backoff")
