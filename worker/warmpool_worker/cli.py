"""`warmpool worker serve|sidecar ...`: the worker's command line and start-up sequence.

Start-up order (cold start is the product, and the probes must tell the truth throughout):

1. bind the HTTP server first, so ``/livez`` and ``/metrics`` answer from the first second;
2. start the local tier guard and take one memory reading (the warm-up depth depends on it);
3. map the weights (``load_engine``: headers validated, nothing read yet) -> ``weights_mapped``;
4. load layers in heat order per the tier's plan, logging each -> ``first_layer_ready``;
5. warm up per the tier (prefill + short decode per bucket) -> ``warmup_done``;
6. ``/readyz`` turns 200 -> ``ready``.  Afterwards, if the tier relaxes, the warm-up is
   topped up to the deeper plan in the background (never undone when it tightens).

A load failure is logged, ``/readyz`` never turns 200, and the process exits non-zero.
Only argparse and the standard library are imported before arguments are parsed, so
``--help`` is instant; aiohttp and the engine come after.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmpool.contract import (
    DEFAULT_HOT_LAYER_PERCENT,
    DEFAULT_HYSTERESIS_PERCENT,
    DEFAULT_LENGTH_BUCKETS,
    DEFAULT_PAUSE_AT_PERCENT,
    DEFAULT_TRUNCATE_AT_PERCENT,
    DEFAULT_WORKER_PORT,
    ENV_POD_IP,
)

if TYPE_CHECKING:
    from warmpool.tiering import Thresholds

log = logging.getLogger("warmpool.worker")

DEFAULT_ENGINE_FACTORY = "warmpool_worker.engine:load_engine"


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _percent(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be a percentage 0..100, got {text}")
    return value


def _buckets(text: str) -> tuple[int, ...]:
    from warmpool_worker.warmup import parse_buckets

    try:
        return parse_buckets(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmpool worker", description="Run a warmpool worker.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="load, warm and serve a model with the built-in engine")
    serve.add_argument("--model", required=True, type=Path, help="model directory (HF layout, safetensors)")
    serve.add_argument(
        "--host",
        default=os.environ.get(ENV_POD_IP) or "127.0.0.1",
        help=f"address to bind (default: ${ENV_POD_IP}, else 127.0.0.1)",
    )
    serve.add_argument(
        "--port", type=int, default=DEFAULT_WORKER_PORT, help="port to bind (0: any free port)"
    )
    serve.add_argument(
        "--device", default="auto", help="auto | cpu | cuda | cuda:N (auto: cuda if available)"
    )
    serve.add_argument(
        "--dtype", default=None, help="bfloat16 | float16 | float32 (default: per device/config)"
    )
    serve.add_argument(
        "--model-name", default=None, help="name served on /v1/models (default: directory name)"
    )
    serve.add_argument(
        "--heat-map", type=Path, default=None, help="heat map JSON (hottest layers load first)"
    )
    serve.add_argument("--prompts", type=Path, default=None, help="warm-up prompts file (JSON list or text)")
    serve.add_argument(
        "--buckets", type=_buckets, default=DEFAULT_LENGTH_BUCKETS, help="warm-up prompt lengths in tokens"
    )
    serve.add_argument(
        "--prompts-per-bucket", type=_positive_int, default=2, help="warm-up prompts per bucket"
    )
    serve.add_argument(
        "--decode-tokens", type=_positive_int, default=4, help="tokens decoded per warm-up prompt"
    )
    serve.add_argument("--tier-thresholds", default=None, help="'truncate,pause[,hysteresis]' in percent")
    serve.add_argument(
        "--truncate-at", type=_percent, default=None, help=f"default {DEFAULT_TRUNCATE_AT_PERCENT}"
    )
    serve.add_argument("--pause-at", type=_percent, default=None, help=f"default {DEFAULT_PAUSE_AT_PERCENT}")
    serve.add_argument(
        "--hysteresis", type=_percent, default=None, help=f"default {DEFAULT_HYSTERESIS_PERCENT}"
    )
    serve.add_argument(
        "--hot-layer-percent",
        type=_percent,
        default=DEFAULT_HOT_LAYER_PERCENT,
        help="layers kept when truncated",
    )
    serve.add_argument(
        "--memory-capacity-bytes",
        type=_positive_int,
        default=None,
        help="measure against this capacity: used = this process tree's real usage (+ --memory-account-pid)",
    )
    serve.add_argument(
        "--memory-account-pid",
        type=_positive_int,
        action="append",
        default=[],
        help="also count this process (and its children) against the configured capacity; repeatable",
    )
    serve.add_argument("--guard-interval", type=float, default=0.5, help="seconds between memory readings")
    serve.add_argument("--control-token-file", type=Path, default=None, help="bearer token for /control/tier")
    serve.add_argument("--kv-prefix-dir", type=Path, default=None, help="persist/reload warm-prefix KV here")
    serve.add_argument(
        "--max-queued-requests",
        type=_positive_int,
        default=64,
        help="requests that may wait for the engine; beyond it a request gets 429 + Retry-After",
    )
    serve.add_argument(
        "--max-tokens-limit",
        type=_positive_int,
        default=4096,
        help="largest max_tokens a request may ask for (above it: 400 naming max_tokens)",
    )
    serve.add_argument(
        "--graph-capture",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="capture CUDA graphs of the decode step after a full warm-up (CUDA only; graphs cost memory)",
    )
    serve.add_argument(
        "--warmup-timeout", type=float, default=600.0, help="seconds of optional warm-up before ready anyway"
    )
    serve.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch intra-op threads (default: the container's CPU quota, cgroup v2 cpu.max, "
        "capped by the CPUs this process may use; torch's own default is every core of the node)",
    )
    serve.add_argument(
        "--cgroup-root", type=Path, default=Path("/sys/fs/cgroup"), help="where cgroup v2 is mounted"
    )
    serve.add_argument("--engine-factory", default=DEFAULT_ENGINE_FACTORY, help=argparse.SUPPRESS)
    serve.add_argument("--log-level", default="INFO", help="DEBUG | INFO | WARNING")

    _add_sidecar_parser(commands)
    return parser


def _add_sidecar_parser(commands: Any) -> None:
    """`warmpool worker sidecar`: beside vLLM/SGLang/TGI (see warmpool_worker.sidecar)."""
    sc = commands.add_parser("sidecar", help="prefetch, warm and gate readiness of an external engine")
    sc.add_argument("--engine-url", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8000")
    sc.add_argument("--model-dir", type=Path, default=None, help="the engine's weights (prefetched in heat order)")
    sc.add_argument("--health-path", default="/health", help="the engine's health path (default /health)")
    sc.add_argument("--engine-metrics-path", default="/metrics", help="the engine's Prometheus path")
    sc.add_argument("--served-model-name", default=None, help="model name for requests (default: /v1/models)")
    sc.add_argument("--api-key-file", type=Path, default=None, help="bearer token for the engine's API")
    sc.add_argument("--max-context", type=_positive_int, default=None,
                    help="engine context in tokens (default: /v1/models, else config.json)")
    sc.add_argument("--host", default=os.environ.get(ENV_POD_IP) or "127.0.0.1",
                    help=f"address to bind (default: ${ENV_POD_IP}, else 127.0.0.1)")
    sc.add_argument("--port", type=int, default=DEFAULT_WORKER_PORT, help="port to bind (0: any free port)")
    sc.add_argument("--device", default="auto", help="memory probe: auto | cpu | cuda | cuda:N")
    sc.add_argument("--heat-map", type=Path, default=None, help="heat map JSON (hottest layers prefetched first)")
    sc.add_argument("--prompts", type=Path, default=None, help="warm-up prompts file (JSON list or text)")
    sc.add_argument("--buckets", type=_buckets, default=DEFAULT_LENGTH_BUCKETS, help="warm-up lengths in tokens")
    sc.add_argument("--prompts-per-bucket", type=_positive_int, default=2, help="warm-up prompts per bucket")
    sc.add_argument("--decode-tokens", type=_positive_int, default=4, help="tokens decoded per warm-up prompt")
    sc.add_argument("--chars-per-token", type=float, default=None,
                    help="prompt sizing without a tokenizer.json (default 4)")
    sc.add_argument("--tier-thresholds", default=None, help="'truncate,pause[,hysteresis]' in percent")
    sc.add_argument("--truncate-at", type=_percent, default=None, help=f"default {DEFAULT_TRUNCATE_AT_PERCENT}")
    sc.add_argument("--pause-at", type=_percent, default=None, help=f"default {DEFAULT_PAUSE_AT_PERCENT}")
    sc.add_argument("--hysteresis", type=_percent, default=None, help=f"default {DEFAULT_HYSTERESIS_PERCENT}")
    sc.add_argument("--hot-layer-percent", type=_percent, default=DEFAULT_HOT_LAYER_PERCENT,
                    help="share of layers prefetched when truncated")
    sc.add_argument("--memory-source", choices=("device", "engine-kv"), default="device",
                    help="tier from the device's memory (probe chain) or the engine's KV-cache usage "
                    "(vLLM pre-allocates the GPU, so device-wide readings sit near 90%%)")
    sc.add_argument("--memory-capacity-bytes", type=_positive_int, default=None,
                    help="measure against this capacity (used = this process tree + --memory-account-pid)")
    sc.add_argument("--memory-account-pid", type=_positive_int, action="append", default=[],
                    help="count this process (e.g. the engine) against the capacity; repeatable")
    sc.add_argument("--guard-interval", type=float, default=0.5, help="seconds between memory readings")
    sc.add_argument("--control-token-file", type=Path, default=None, help="bearer token for /control/tier")
    sc.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                    help="page-cache prefetch of --model-dir (default on)")
    sc.add_argument("--prefetch-mode", choices=("read", "advise"), default="read",
                    help="read: fadvise + read (certain); advise: fadvise WILLNEED only (no copy)")
    sc.add_argument("--poll-interval", type=float, default=0.5, help="seconds between engine health probes")
    sc.add_argument("--lost-after", type=_positive_int, default=3,
                    help="consecutive failed health probes that mean the engine is lost")
    sc.add_argument("--probe-timeout", type=float, default=2.0, help="seconds per health/metrics probe")
    sc.add_argument("--request-timeout", type=float, default=120.0, help="seconds per warm-up request")
    sc.add_argument("--retries", type=int, default=3, help="retries per warm-up request (5xx, garbage, refused)")
    sc.add_argument("--retry-backoff", type=float, default=0.5, help="first retry delay in seconds (doubles)")
    sc.add_argument("--warmup-timeout", type=float, default=600.0,
                    help="seconds of warm-up before ready with what is warm (if any prompt passed)")
    sc.add_argument("--log-level", default="INFO", help="DEBUG | INFO | WARNING")


def thresholds_from(args: argparse.Namespace) -> Thresholds:
    from warmpool.tiering import Thresholds

    base = Thresholds.parse(args.tier_thresholds) if args.tier_thresholds else Thresholds()
    return Thresholds(
        truncate_at=base.truncate_at if args.truncate_at is None else args.truncate_at,
        pause_at=base.pause_at if args.pause_at is None else args.pause_at,
        hysteresis=base.hysteresis if args.hysteresis is None else args.hysteresis,
    )


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    torch: Any = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_factory(spec: str) -> Any:
    module_name, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module_name), attribute or "load_engine")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from warmpool.tiering import ThresholdError

    try:
        thresholds = thresholds_from(args)
    except ThresholdError as error:
        parser.error(str(error))
    import asyncio

    if args.command == "sidecar":
        from warmpool_worker.sidecar import serve_sidecar

        return asyncio.run(serve_sidecar(args, thresholds))
    from warmpool_worker.runtime import serve

    return asyncio.run(serve(args, thresholds))
