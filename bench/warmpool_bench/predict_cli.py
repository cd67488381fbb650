"""The ``warmpool bench predict`` subcommand: its flags, and the run from flags to files."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO_ROOT / ".." / "shared" / "data" / "azure-llm-trace-2023" / "code.csv"


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _floats(text: str) -> tuple[float, ...]:
    return tuple(_positive_float(part) for part in text.split(",") if part.strip())


def add_predict_parser(commands: Any, results: Path) -> None:
    from warmpool_operator.rules.forecast.forecaster import CANDIDATES

    p = commands.add_parser("predict", help="no pre-warm vs reactive vs predictive scaling, replayed over a trace",
                            description="Offline replay of a request trace through a queueing model of the pool.")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="CSV with TIMESTAMP,ContextTokens,GeneratedTokens (default: the shared Azure code trace)")
    p.add_argument("--measured", type=Path, default=results,
                   help="folder holding wake.json, coldstart.json and serve.json, where the cold-start, wake, "
                        "prefill and decode (batch) timings are read from (default: the results folder)")
    p.add_argument("--cold-start", type=_positive_float, default=None,
                   help="replace the measured new-pod cold start (median and lead time), seconds")
    p.add_argument("--wake", type=_positive_float, default=None,
                   help="replace the measured wake time (median and lead time), seconds")
    p.add_argument("--extra-cold-starts", type=_floats, default=(),
                   help="more cold starts to replay for comparison, comma-separated (default: none)")
    p.add_argument("--prefill-tokens-per-s", type=_positive_float, default=None,
                   help="replace the measured per-pod prefill speed (SmolLM2-135M's steady TTFT in coldstart.json)")
    p.add_argument("--decode-tokens-per-s", type=_positive_float, default=None,
                   help="replace the measured decode speed of a request served alone (serve.json's built-in "
                        "engine at concurrency 1); the batch's measured speed-ups still apply")
    p.add_argument("--requests-per-pod", type=_positive_int, default=None,
                   help="serve at most this many requests at once per pod (default: the serve run's max batch; "
                        "1 replays pods that serve one request at a time)")
    p.add_argument("--min-warm", type=_non_negative_int, default=None,
                   help="pods the @minwarm policies keep warm (default 1; the other scaled policies start from "
                        "zero); with --live, pods reactive and predictive keep warm (default 0: both run from zero)")
    p.add_argument("--zero-after-idle", type=_positive_int, default=None,
                   help="with --live and --min-warm 0: the pools' scaleToZero.afterIdleSeconds (default: one "
                        "trace minute, compressed)")
    p.add_argument("--step-seconds", type=_positive_int, default=None, choices=(5, 10, 15, 20, 30, 60),
                   help="the forecast's step (default: chosen from the trace's bursts)")
    p.add_argument("--max-replicas", type=_positive_int, default=None,
                   help="most pods any policy may have (default 64 offline, 6 with --live)")
    p.add_argument("--max-extra-replicas", type=_non_negative_int, default=None,
                   help="predictive pods above the reactive count (default: up to maxReplicas; the default "
                        "cap of the library is also replayed for comparison)")
    p.add_argument("--fixed-replicas", type=_positive_int, default=None,
                   help="no pre-warm's fixed pool size (default: sized for the trace's busiest minute, "
                        "⌈the most service seconds arriving in one minute ÷ 60⌉; 3 pods with --live)")
    p.add_argument("--forecasters", default="auto," + ",".join(CANDIDATES),
                   help="predictive runs: auto (best recent performer) and/or " + ",".join(CANDIDATES))
    p.add_argument("--max-context", type=_positive_int, default=8192,
                   help="model context in tokens, the ceiling of learned buckets (default 8192: SmolLM2-135M)")
    p.add_argument("--repeat", type=_positive_int, default=1,
                   help="play the trace N times back to back (the output says so; default 1)")
    p.add_argument("--out", type=Path, default=results, help="results folder")
    p.add_argument("--name", default=None, help="results file stem (.json, .md, .png; default predict, or "
                                                  "predict-live with --live)")
    add_live_arguments(p)


def add_live_arguments(p: Any) -> None:
    """`--live` (predict_live.py): the trace's segment replayed against real pods on the local cluster."""
    from warmpool_bench.predict_live import POLICIES

    live = p.add_argument_group("live replay (--live)")
    live.add_argument("--live", action="store_true",
                      help="replay a segment of the trace against real pods (local cluster, the operator of this "
                           "checkout, the small real model), one WarmModel per policy, one after another")
    live.add_argument("--quick", action="store_true",
                      help="with --live: a smaller run (tiny random model, 6 trace minutes, 90 requests, short "
                           "buckets and prompts); any flag given still wins")
    live.add_argument("--segment-start", type=_non_negative_float, default=None,
                      help="segment start, trace minutes (default 12: two idle minutes, then the minute-14 burst; "
                           "minutes 0-11 seed the predictive pool's history)")
    live.add_argument("--segment-minutes", type=_positive_float, default=None, help="segment length (default 12)")
    live.add_argument("--compression", type=_positive_float, default=None,
                      help="time compression (default 6: a trace minute lasts 10 s, one --predict-step-seconds 10)")
    live.add_argument("--predict-step-seconds", type=_positive_int, default=None,
                      help="the operator's history step (default 10)")
    live.add_argument("--max-prompt", type=_positive_int, default=None, help="prompt cap, tokens (default 256)")
    live.add_argument("--max-generated", type=_positive_int, default=None, help="generation cap (default 8)")
    live.add_argument("--max-requests", type=_positive_int, default=None,
                      help="requests replayed over all policies (default 240); the segment is thinned to fit")
    live.add_argument("--max-wall", type=_positive_float, default=None,
                      help="seconds for the whole run (default 900); a policy that would not fit is skipped, said so")
    live.add_argument("--prime-seconds", type=_non_negative_float, default=None,
                      help="priming before each replay, seconds (default 20)")
    live.add_argument("--policies", default=",".join(POLICIES), help="live policies: " + ",".join(POLICIES))
    live.add_argument("--size", choices=("small", "tiny"), default=None,
                      help="model: small (SmolLM2-135M, `warmpool model fetch`) or tiny (random weights)")
    live.add_argument("--cluster", default=None,
                      help="a running local real-node cluster to use, by name (default: start one of the run's own)")
    live.add_argument("--work-dir", type=Path, default=None, help="bench artefacts (operator log)")


def run_predict_command(args: argparse.Namespace) -> int:
    if args.live:
        return run_live_command(args)
    if args.quick:
        print("warmpool bench predict: --quick goes with --live", file=sys.stderr)
        return 2
    from warmpool_bench.predict import run_predict, settings_from_measured
    from warmpool_bench.predict_inputs import MeasuredInputError, Timing, load_measured, overridden_batch
    from warmpool_bench.predict_report import draw_chart, render_predict
    from warmpool_bench.predict_trace import TraceError, load_trace, repeat
    from warmpool_bench.results import write_results

    forecasters = tuple(f.strip() for f in args.forecasters.split(",") if f.strip())
    if "auto" not in forecasters:
        print("warmpool bench predict: --forecasters must include auto (the targets are read from it)",
              file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace)
        if args.repeat > 1:
            trace = repeat(trace, args.repeat)
        measured = load_measured(args.measured)
        if args.cold_start is not None:
            measured = replace(measured, cold_start=Timing(args.cold_start, args.cold_start, 0, "--cold-start", None))
        if args.wake is not None:
            measured = replace(measured, wake=Timing(args.wake, args.wake, 0, "--wake", None))
        if args.prefill_tokens_per_s is not None:
            measured = replace(measured, prefill_tokens_per_s=args.prefill_tokens_per_s,
                               prefill_source="--prefill-tokens-per-s")
        measured = replace(measured, batch=overridden_batch(measured.batch, args.decode_tokens_per_s,
                                                            args.requests_per_pod))
        settings = settings_from_measured(
            measured, args.extra_cold_starts,
            min_warm=1 if args.min_warm is None else args.min_warm, max_replicas=args.max_replicas or 64,
            max_extra_replicas=args.max_extra_replicas,
            fixed_replicas=args.fixed_replicas, forecasters=forecasters, max_context=args.max_context,
            repeat=args.repeat, step_s=args.step_seconds)
        result, chart = run_predict(trace, settings)
    except (TraceError, MeasuredInputError, ValueError) as error:
        print(f"warmpool bench predict: {error}", file=sys.stderr)
        return 2
    name = args.name or "predict"
    png_path = args.out / f"{name}.png"
    result["chart"] = png_path.name
    json_path, md_path = write_results(result, args.out, name, render_predict(result), args.run)
    draw_chart(chart, png_path)
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path} and {png_path}")
    return 0


#: --live defaults, and --quick's (a flag given on the command line wins over both).
#: Prompts of 256 and 8 tokens generated, 240 requests: at the brief's 512 / 16 and 600 (186 per policy) the
#: pods of this 2-CPU machine (load ~5) served ~0.35 req/s each against 1.5 req/s offered, and each policy ran
#: 4 minutes (the queue never drained); bench/README.md has that run's figures.
LIVE_DEFAULTS: dict[str, Any] = {"segment_start": 12.0, "segment_minutes": 12.0, "compression": 6.0,
                                 "predict_step_seconds": 10, "max_prompt": 256, "max_generated": 8,
                                 "max_requests": 240, "max_wall": 900.0, "prime_seconds": 20.0, "size": "small",
                                 "max_replicas": 6, "fixed_replicas": 3}
QUICK: dict[str, Any] = {"segment_minutes": 6.0, "max_prompt": 64, "max_generated": 8, "max_requests": 90,
                         "prime_seconds": 15.0, "size": "tiny", "max_replicas": 3, "fixed_replicas": 2}


def run_live_command(args: argparse.Namespace) -> int:
    from warmpool_bench.predict_live import LiveSettings, run_live
    from warmpool_bench.predict_live_report import draw_live_chart, render_live
    from warmpool_bench.predict_live_segment import SegmentSpec
    from warmpool_bench.predict_trace import TraceError
    from warmpool_bench.results import write_results

    def value(name: str) -> Any:
        given = getattr(args, name)
        if given is not None:
            return given
        return QUICK.get(name, LIVE_DEFAULTS[name]) if args.quick else LIVE_DEFAULTS[name]

    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    try:
        segment = SegmentSpec(start_min=value("segment_start"), minutes=value("segment_minutes"),
                              compression=value("compression"), max_prompt=value("max_prompt"),
                              max_generated=value("max_generated"),
                              cap=max(1, value("max_requests") // max(1, len(policies))))
        extra: dict[str, Any] = {}
        if args.quick:
            extra["buckets"] = (16, 32)
        if args.work_dir is not None:
            extra["work_dir"] = args.work_dir
        settings = LiveSettings(trace=args.trace, segment=segment, step_s=value("predict_step_seconds"),
                                policies=policies, size=value("size"),
                                min_warm=0 if args.min_warm is None else args.min_warm,
                                zero_after_idle_s=args.zero_after_idle,
                                max_replicas=value("max_replicas"), fixed_replicas=value("fixed_replicas"),
                                prime_s=value("prime_seconds"), max_wall_s=value("max_wall"),
                                cluster=args.cluster, **extra)
        result, chart = run_live(settings)
    except (TraceError, ValueError) as error:  # SegmentError is a ValueError
        print(f"warmpool bench predict --live: {error}", file=sys.stderr)
        return 2
    name = args.name or "predict-live"
    png_path = args.out / f"{name}.png"
    result["chart"] = png_path.name
    json_path, md_path = write_results(result, args.out, name, render_live(result), args.run)
    draw_live_chart(chart, png_path)
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path} and {png_path}")
    return 0 if result["policies"] else 1
