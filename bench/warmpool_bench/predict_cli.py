"""The ``warmpool bench predict`` subcommand: its flags, and the run from flags to files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from warmpool_bench.predict import (
    DERIVED_DECODE_TOKENS_PER_S,
    MEASURED_COLD_START_S,
    MEASURED_PREFILL_TOKENS_PER_S,
    SENSITIVITY_COLD_STARTS_S,
    PredictBenchSettings,
)

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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _floats(text: str) -> tuple[float, ...]:
    return tuple(_positive_float(part) for part in text.split(",") if part.strip())


def add_predict_parser(commands: Any, results: Path) -> None:
    from warmpool_operator.predict.forecaster import CANDIDATES

    p = commands.add_parser("predict", help="no pre-warm vs reactive vs predictive scaling, replayed over a trace",
                            description="Offline replay of a request trace through a queueing model of the pool.")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="CSV with TIMESTAMP,ContextTokens,GeneratedTokens (default: the shared Azure code trace)")
    p.add_argument("--cold-start", type=_positive_float, default=MEASURED_COLD_START_S,
                   help=f"pod cold start, seconds (default {MEASURED_COLD_START_S}: bench/results/coldstart.json, "
                        "synthetic ~1 GB model, warmpool_full, cold page cache, median ready_s)")
    p.add_argument("--extra-cold-starts", type=_floats, default=SENSITIVITY_COLD_STARTS_S,
                   help="more cold starts to replay for comparison, comma-separated (default 30,60; '' for none)")
    p.add_argument("--prefill-tokens-per-s", type=_positive_float, default=MEASURED_PREFILL_TOKENS_PER_S,
                   help=f"per-pod prefill speed (default {MEASURED_PREFILL_TOKENS_PER_S:g}: SmolLM2-135M's "
                        "steady TTFT at 128 tokens in bench/results/coldstart.json)")
    p.add_argument("--decode-tokens-per-s", type=_positive_float, default=DERIVED_DECODE_TOKENS_PER_S,
                   help=f"per-pod decode speed (default {DERIVED_DECODE_TOKENS_PER_S:g}: derived from that run's "
                        "warm-up time)")
    p.add_argument("--min-warm", type=_non_negative_int, default=1, help="pods kept warm by every policy")
    p.add_argument("--max-replicas", type=_positive_int, default=64, help="most pods any policy may have")
    p.add_argument("--max-extra-replicas", type=_non_negative_int, default=None,
                   help="predictive pods above the reactive count (default: up to maxReplicas; the default "
                        "cap of the library is also replayed for comparison)")
    p.add_argument("--idle-timeout", type=_positive_float, default=60.0, help="no pre-warm: idle pod stops after")
    p.add_argument("--forecasters", default="auto," + ",".join(CANDIDATES),
                   help="predictive runs: auto (best recent performer) and/or " + ",".join(CANDIDATES))
    p.add_argument("--max-context", type=_positive_int, default=8192,
                   help="model context in tokens, the ceiling of learned buckets (default 8192: SmolLM2-135M)")
    p.add_argument("--repeat", type=_positive_int, default=1,
                   help="play the trace N times back to back (the output says so; default 1)")
    p.add_argument("--out", type=Path, default=results, help="results folder")
    p.add_argument("--name", default="predict", help="results file stem (.json, .md, .png)")


def run_predict_command(args: argparse.Namespace) -> int:
    from warmpool_bench.predict import run_predict
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
        settings = PredictBenchSettings(
            cold_start_s=args.cold_start, extra_cold_starts_s=args.extra_cold_starts,
            prefill_tokens_per_s=args.prefill_tokens_per_s, decode_tokens_per_s=args.decode_tokens_per_s,
            min_warm=args.min_warm, max_replicas=args.max_replicas, max_extra_replicas=args.max_extra_replicas,
            idle_timeout_s=args.idle_timeout, forecasters=forecasters, max_context=args.max_context,
            repeat=args.repeat)
        result, chart = run_predict(trace, settings)
    except (TraceError, ValueError) as error:
        print(f"warmpool bench predict: {error}", file=sys.stderr)
        return 2
    png_path = args.out / f"{args.name}.png"
    result["chart"] = png_path.name
    json_path, md_path = write_results(result, args.out, args.name, render_predict(result))
    draw_chart(chart, png_path)
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path} and {png_path}")
    return 0
