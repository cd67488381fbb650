"""`warmpool worker serve|sidecar ...`: the worker's command line, the edge where settings are checked.

The flags are parsed here and turned into the frozen configuration objects of `config`
(`ServeConfig`, `SidecarConfig`); a value the worker cannot run with is refused here with an
error naming the flag (exit 2), and nothing below this module sees an ``argparse.Namespace``.
The start-up sequences themselves, and their order, are documented where they are
implemented: `runtime.serve` (built-in engine) and `sidecar.serve_sidecar`.

Only argparse and the standard library are imported before the arguments are parsed, so
``--help`` is instant; the configuration objects, aiohttp and the engine come after.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    ENGINE_SLEEP_APIS,
)

from warmpool.contract.api import (
    DEFAULT_HOT_LAYER_PERCENT,
    DEFAULT_HYSTERESIS_PERCENT,
    DEFAULT_LENGTH_BUCKETS,
    DEFAULT_PAUSE_AT_PERCENT,
    DEFAULT_TRUNCATE_AT_PERCENT,
    DEFAULT_WARMUP_TIMEOUT_SECONDS,
)
from warmpool.contract.http import DEFAULT_ENGINE_HEALTH_PATH, DEFAULT_WORKER_PORT
from warmpool.contract.pods import ENV_POD_IP, TERMINATION_MESSAGE_PATH
from warmpool.contract.telemetry import LOG_FORMAT_TEXT, LOG_FORMATS
from warmpool.logformat import add_log_level_flag, configure_logging

if TYPE_CHECKING:
    from warmpool_worker.config import GuardConfig, ListenConfig, ServeConfig, SidecarConfig, WarmupConfig
    from warmpool_worker.termination import LastError
    from warmpool_worker.tracing import TracingConfig

    from warmpool.tiering import Thresholds

LEARNED_BUCKETS_HELP = ("warm-up lengths learned from traffic (the operator's JSON file, spec.warmup.learnBuckets): "
                        "used instead of --buckets while the file is there and valid")


def _buckets(text: str) -> tuple[int, ...]:
    from warmpool_worker.warmup import parse_buckets

    try:
        return parse_buckets(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmpool worker", description="Run a warmpool worker.")
    commands = parser.add_subparsers(dest="command", required=True)
    shared = _shared_flags()
    _add_serve_parser(commands, shared)
    _add_sidecar_parser(commands, shared)
    return parser


def _shared_flags() -> argparse.ArgumentParser:
    """The flags both commands take, declared once (argparse's parent parser): where to listen,
    how to warm up, when to tier, and how to log."""
    flags = argparse.ArgumentParser(add_help=False)
    listen = flags.add_argument_group("listening")
    listen.add_argument("--host", default=os.environ.get(ENV_POD_IP) or DEFAULT_HOST,
                        help=f"address to bind (default: ${ENV_POD_IP}, else {DEFAULT_HOST})")
    listen.add_argument("--port", type=int, default=DEFAULT_WORKER_PORT, help="port to bind (0: any free port)")
    listen.add_argument("--control-token-file", type=Path, default=None,
                        help="bearer token for the /control endpoints")
    flags.add_argument("--device", default="auto",
                       help="auto | cpu | cuda | cuda:N (auto: cuda if available); serve runs the engine there, "
                            "sidecar probes that device's memory")
    flags.add_argument("--heat-map", type=Path, default=None,
                       help="heat map JSON (the hottest layers load, or are prefetched, first)")
    warmup = flags.add_argument_group("warm-up")
    warmup.add_argument("--prompts", type=Path, default=None, help="warm-up prompts file (JSON list or text)")
    warmup.add_argument("--buckets", type=_buckets, default=DEFAULT_LENGTH_BUCKETS,
                        help="warm-up prompt lengths in tokens")
    warmup.add_argument("--prompts-per-bucket", type=int, default=DEFAULT_PROMPTS_PER_BUCKET,
                        help="warm-up prompts per bucket")
    warmup.add_argument("--learned-buckets", type=Path, default=None, help=LEARNED_BUCKETS_HELP)
    warmup.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE_TOKENS,
                        help="tokens decoded per warm-up prompt")
    warmup.add_argument("--warmup-timeout", type=float, default=float(DEFAULT_WARMUP_TIMEOUT_SECONDS),
                        help="seconds of warm-up before ready with what is warm")
    tiers = flags.add_argument_group("memory tiers")
    tiers.add_argument("--tier-thresholds", default=None, help="'truncate,pause[,hysteresis]' in percent")
    tiers.add_argument("--truncate-at", type=float, default=None, help=f"default {DEFAULT_TRUNCATE_AT_PERCENT}")
    tiers.add_argument("--pause-at", type=float, default=None, help=f"default {DEFAULT_PAUSE_AT_PERCENT}")
    tiers.add_argument("--hysteresis", type=float, default=None, help=f"default {DEFAULT_HYSTERESIS_PERCENT}")
    tiers.add_argument("--hot-layer-percent", type=float, default=DEFAULT_HOT_LAYER_PERCENT,
                       help="share of layers kept (or prefetched) when truncated")
    tiers.add_argument("--memory-capacity-bytes", type=int, default=None,
                       help="measure against this capacity: used = this process tree's real usage "
                            "(+ --memory-account-pid)")
    tiers.add_argument("--memory-account-pid", type=int, action="append", default=[],
                       help="also count this process (and its children, e.g. the engine) against the capacity; "
                            "repeatable")
    tiers.add_argument("--guard-interval", type=float, default=DEFAULT_GUARD_INTERVAL_S,
                       help="seconds between memory readings")
    logs = flags.add_argument_group("logging")
    add_log_level_flag(logs)
    logs.add_argument("--log-format", choices=LOG_FORMATS, default=LOG_FORMAT_TEXT,
                      help="text, or json: one object per line, with trace_id/span_id while a span is active")
    logs.add_argument("--termination-message-path", type=Path, default=Path(TERMINATION_MESSAGE_PATH),
                      help="on a failed exit, the last error is written here when the file exists (the kubelet's "
                           "terminationMessagePath; default %(default)s)")
    return flags


def _add_serve_parser(commands: Any, shared: argparse.ArgumentParser) -> None:
    """`warmpool worker serve`: the built-in engine (see warmpool_worker.builtin.runtime)."""
    serve = commands.add_parser("serve", parents=[shared],
                                help="load, warm and serve a model with the built-in engine")
    serve.add_argument("--model", required=True, type=Path, help="model directory (HF layout, safetensors)")
    serve.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: per device/config)")
    serve.add_argument("--model-name", default=None, help="name served on /v1/models (default: directory name)")
    serve.add_argument(
        "--partial-cache", action="store_true",
        help="the model directory may be a node cache's partial view still filling: wait for each "
             "tensor's bytes before touching them (no effect on a directory without a fill progress record)",
    )
    serve.add_argument("--partial-cache-timeout", type=float, default=600.0,
                       help="seconds one --partial-cache wait may take before the load fails")
    serve.add_argument("--kv-prefix-dir", type=Path, default=None, help="persist/reload warm-prefix KV here")
    serve.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                       help="requests that may wait for room in the running batch; beyond it a request gets "
                            "429 + Retry-After")
    serve.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                       help="requests the engine runs together at most (continuous batching)")
    serve.add_argument("--kv-cache-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES,
                       help="KV-cache bytes the running batch may hold; taken as tokens come (a request joins "
                            "once its prompt's blocks are free; when they run out a running one is preempted)")
    serve.add_argument("--prefill-chunk-tokens", type=int, default=DEFAULT_PREFILL_CHUNK_TOKENS,
                       help="prompt tokens per prefill chunk: a prompt advances one chunk a batch step, beside "
                            "the decodes (a step feeds a few chunks at most)")
    serve.add_argument("--max-tokens-limit", type=int, default=DEFAULT_MAX_TOKENS_LIMIT,
                       help="largest max_tokens a request may ask for (above it: 400 naming max_tokens)")
    serve.add_argument("--wake-timeout", type=float, default=DEFAULT_WAKE_TIMEOUT_S,
                       help="seconds a completion waits for a sleeping engine to wake (then 503)")
    serve.add_argument("--sleep-drain-timeout", type=float, default=DEFAULT_SLEEP_DRAIN_TIMEOUT_S,
                       help="seconds a sleep waits for the running batch to drain (then 409, still awake)")
    serve.add_argument("--vllm-sleep-api", action="store_true",
                       help="also serve vLLM's unauthenticated dev-mode /sleep, /wake_up, /is_sleeping")
    serve.add_argument("--graph-capture", action=argparse.BooleanOptionalAction, default=True,
                       help="capture CUDA graphs of the decode step after a full warm-up (CUDA only; graphs "
                            "cost memory)")
    serve.add_argument("--threads", type=int, default=None,
                       help="torch intra-op threads (default: the container's CPU quota, cgroup v2 cpu.max, "
                            "capped by the CPUs this process may use; torch's own default is every core of the "
                            "node)")
    serve.add_argument("--cgroup-root", type=Path, default=Path(DEFAULT_CGROUP_ROOT),
                       help="where cgroup v2 is mounted")


def _add_sidecar_parser(commands: Any, shared: argparse.ArgumentParser) -> None:
    """`warmpool worker sidecar`: beside vLLM/SGLang/TGI (see warmpool_worker.sidecar.app)."""
    sc = commands.add_parser("sidecar", parents=[shared],
                             help="prefetch, warm and gate readiness of an external engine")
    sc.add_argument("--engine-url", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8000")
    sc.add_argument("--model-dir", type=Path, default=None, help="the engine's weights (prefetched in heat order)")
    sc.add_argument("--health-path", default=DEFAULT_ENGINE_HEALTH_PATH,
                    help=f"the engine's health path (default {DEFAULT_ENGINE_HEALTH_PATH})")
    sc.add_argument("--engine-metrics-path", default=DEFAULT_ENGINE_METRICS_PATH, help="the engine's Prometheus path")
    sc.add_argument("--served-model-name", default=None, help="model name for requests (default: /v1/models)")
    sc.add_argument("--api-key-file", type=Path, default=None, help="bearer token for the engine's API")
    sc.add_argument("--max-context", type=int, default=None,
                    help="engine context in tokens (default: /v1/models, else config.json)")
    sc.add_argument("--chars-per-token", type=float, default=DEFAULT_CHARS_PER_TOKEN,
                    help=f"prompt sizing without a tokenizer.json (default {DEFAULT_CHARS_PER_TOKEN:g})")
    sc.add_argument("--memory-source", choices=("device", "engine-kv"), default="device",
                    help="tier from the device's memory (probe chain) or the engine's KV-cache usage "
                    "(vLLM pre-allocates the GPU, so device-wide readings sit near 90%%)")
    sc.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                    help="page-cache prefetch of --model-dir (default on)")
    sc.add_argument("--prefetch-mode", choices=("read", "advise"), default="read",
                    help="read: fadvise + read (certain); advise: fadvise WILLNEED only (no copy)")
    sc.add_argument("--poll-interval", type=float, default=DEFAULT_POLL_INTERVAL_S,
                    help="seconds between engine health probes")
    sc.add_argument("--lost-after", type=int, default=DEFAULT_LOST_AFTER,
                    help="consecutive failed health probes that mean the engine is lost")
    sc.add_argument("--probe-timeout", type=float, default=DEFAULT_PROBE_TIMEOUT_S,
                    help="seconds per health/metrics probe")
    sc.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                    help="seconds per warm-up request")
    sc.add_argument("--retries", type=int, default=DEFAULT_RETRIES,
                    help="retries per warm-up request (5xx, garbage, refused)")
    sc.add_argument("--retry-backoff", type=float, default=DEFAULT_RETRY_BACKOFF_S,
                    help="first retry delay in seconds (doubles)")
    sc.add_argument("--engine-sleep-api", choices=ENGINE_SLEEP_APIS, default="auto",
                    help="the engine's sleep API: vllm, sglang, none, or auto (probe vLLM's GET /is_sleeping)")


# -- from flags to configuration objects (the one place a flag meets its field) -------------
def _thresholds(args: argparse.Namespace) -> Thresholds:
    from warmpool_worker.config import ConfigError

    from warmpool.tiering import ThresholdError, Thresholds

    try:
        base = Thresholds.parse(args.tier_thresholds) if args.tier_thresholds else Thresholds()
        return Thresholds(
            truncate_at=base.truncate_at if args.truncate_at is None else args.truncate_at,
            pause_at=base.pause_at if args.pause_at is None else args.pause_at,
            hysteresis=base.hysteresis if args.hysteresis is None else args.hysteresis,
        )
    except ThresholdError as error:
        raise ConfigError("--tier-thresholds/--truncate-at/--pause-at/--hysteresis:", str(error)) from None


def _listen(args: argparse.Namespace) -> ListenConfig:
    from warmpool_worker.config import ListenConfig

    return ListenConfig(host=args.host, port=args.port, control_token_file=args.control_token_file)


def _guard(args: argparse.Namespace) -> GuardConfig:
    from warmpool_worker.config import GuardConfig

    return GuardConfig(
        thresholds=_thresholds(args),
        memory_capacity_bytes=args.memory_capacity_bytes,
        memory_account_pids=tuple(args.memory_account_pid),
        interval_s=args.guard_interval,
    )


def _warmup(args: argparse.Namespace) -> WarmupConfig:
    from warmpool_worker.config import WarmupConfig
    from warmpool_worker.warmup import read_learned_buckets

    return WarmupConfig(
        buckets=read_learned_buckets(args.learned_buckets) or tuple(args.buckets),
        prompts_per_bucket=args.prompts_per_bucket,
        decode_tokens=args.decode_tokens,
        hot_layer_percent=args.hot_layer_percent,
        prompts_file=args.prompts,
        timeout_s=args.warmup_timeout,
    )


def _tracing() -> TracingConfig:
    """Tracing from the standard OTEL_* variables (on only when an OTLP endpoint is set)."""
    from warmpool_worker.config import ConfigError
    from warmpool_worker.tracing import TracingConfig, TracingConfigError

    try:
        return TracingConfig.from_env()
    except TracingConfigError as error:
        raise ConfigError("OTEL_* environment:", str(error)) from None


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """`warmpool worker serve`'s flags as a checked `ServeConfig` (raises `ConfigError`)."""
    from warmpool_worker.config import ServeConfig, ServingLimits, SleepConfig

    partial_cache = None
    if args.partial_cache:
        from warmpool_worker.partial_cache import PartialCacheConfig

        partial_cache = PartialCacheConfig(args.partial_cache_timeout)
    return ServeConfig(
        model=args.model,
        model_name=args.model_name,
        device=args.device,
        dtype=args.dtype,
        heat_map=args.heat_map,
        kv_prefix_dir=args.kv_prefix_dir,
        partial_cache=partial_cache,
        graph_capture=args.graph_capture,
        threads=args.threads,
        cgroup_root=args.cgroup_root,
        listen=_listen(args),
        guard=_guard(args),
        warmup=_warmup(args),
        limits=ServingLimits(max_queued_requests=args.max_queued_requests, max_tokens_limit=args.max_tokens_limit,
                             max_batch_size=args.max_batch_size, kv_cache_bytes=args.kv_cache_bytes,
                             prefill_chunk_tokens=args.prefill_chunk_tokens),
        sleep=SleepConfig(wake_timeout_s=args.wake_timeout, vllm_sleep_api=args.vllm_sleep_api,
                          drain_timeout_s=args.sleep_drain_timeout),
        tracing=_tracing(),
    )


def sidecar_config(args: argparse.Namespace) -> SidecarConfig:
    """`warmpool worker sidecar`'s flags as a checked `SidecarConfig` (raises `ConfigError`)."""
    from warmpool_worker.config import SidecarConfig

    return SidecarConfig(
        engine_url=args.engine_url,
        model_dir=args.model_dir,
        health_path=args.health_path,
        engine_metrics_path=args.engine_metrics_path,
        served_model_name=args.served_model_name,
        api_key_file=args.api_key_file,
        max_context=args.max_context,
        device=args.device,
        heat_map=args.heat_map,
        chars_per_token=args.chars_per_token,
        memory_source=args.memory_source,
        prefetch=args.prefetch,
        prefetch_mode=args.prefetch_mode,
        poll_interval_s=args.poll_interval,
        lost_after=args.lost_after,
        probe_timeout_s=args.probe_timeout,
        request_timeout_s=args.request_timeout,
        retries=args.retries,
        retry_backoff_s=args.retry_backoff,
        listen=_listen(args),
        guard=_guard(args),
        warmup=_warmup(args),
        engine_sleep_api=args.engine_sleep_api,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    from warmpool_worker.termination import LastError, write_termination_message

    # The last error logged becomes the container's termination message on a failed exit.
    last_error = LastError()
    logging.getLogger().addHandler(last_error)
    try:
        exit_code = _run(parser, args, last_error)
    except SystemExit as error:
        if error.code not in (0, None):
            write_termination_message(args.termination_message_path, last_error.message or f"exit {error.code}")
        raise
    except Exception as error:  # a crash: the exception is the last word
        write_termination_message(args.termination_message_path,
                                  last_error.message or f"{type(error).__name__}: {error}")
        raise
    if exit_code != 0:
        write_termination_message(args.termination_message_path,
                                  last_error.message or f"the worker exited with code {exit_code}")
    return exit_code


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, last_error: LastError) -> int:
    from warmpool_worker.config import ConfigError, SidecarConfig

    try:
        config = sidecar_config(args) if args.command == "sidecar" else serve_config(args)
    except ConfigError as error:
        last_error.message = f"invalid configuration: {error}"
        parser.error(str(error))  # exits 2, naming the flag
    import asyncio

    if isinstance(config, SidecarConfig):
        from warmpool_worker.sidecar.app import serve_sidecar

        return asyncio.run(serve_sidecar(config))
    from warmpool_worker.builtin.runtime import serve_worker

    return asyncio.run(serve_worker(config))
