"""`warmpool bench tracing-imports`: what turning tracing on costs a worker in imports.

What the OpenTelemetry imports cost, measured.  Each figure is the wall time of
one set of imports in a fresh interpreter (timed inside the child, so interpreter start-up is
left out), repeated round-robin so that a busy moment on a shared machine hits every variant
alike; the headline is the median of the rounds:

- ``start_path``: the modules a `warmpool worker serve` process imports before it maps weights
  (the CLI, the runtime and the built-in engine, torch included) -- what every pod pays.
- ``start_path_plus_tracing``: the same, then the OpenTelemetry modules the worker's tracing
  imports when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (`warmpool_worker.tracing.WorkerTracing`).
- ``tracing_alone``: those OpenTelemetry modules in an otherwise empty interpreter.

With tracing off none of them is imported (tests/integration/test_tracing.py checks
``sys.modules``).  With it on, the worker imports them on its span-export thread after
``/readyz`` turns 200, so the figure is what a traced pod pays beside its start, not in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from warmpool_bench.stats import median, percentile

#: The worker's start path up to mapping weights (what `warmpool worker serve` imports first).
START_PATH: tuple[str, ...] = (
    "warmpool.cli",
    "warmpool_worker.cli",
    "warmpool_worker.builtin.runtime",
    "warmpool_worker.builtin.engine.llama",
)

#: What `warmpool_worker.tracing.WorkerTracing` imports when tracing is on.
TRACING: tuple[str, ...] = (
    "opentelemetry.trace",
    "opentelemetry.sdk.resources",
    "opentelemetry.sdk.trace",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk.trace.sampling",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.trace.propagation.tracecontext",
)

VARIANTS: dict[str, tuple[tuple[str, ...], ...]] = {
    # Each variant is a list of phases timed one after the other in the same child.
    "start_path": (START_PATH,),
    "start_path_plus_tracing": (START_PATH, TRACING),
    "tracing_alone": (TRACING,),
}

#: The child: imports each phase's modules and prints the seconds each phase took, as JSON.
_CHILD = """
import importlib, json, sys, time
phases = json.loads(sys.argv[1])
took = []
for modules in phases:
    start = time.perf_counter()
    for name in modules:
        importlib.import_module(name)
    took.append(time.perf_counter() - start)
loaded = sorted(m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry."))
print(json.dumps({"phases_s": took, "opentelemetry_modules": len(loaded)}))
"""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # A traced worker reads these; the bench measures imports only, so none may be set.
    for name in list(env):
        if name.startswith("OTEL_"):
            del env[name]
    return env


def time_variant(phases: Sequence[Sequence[str]], timeout_s: float = 120.0) -> dict[str, Any]:
    """One fresh interpreter importing `phases` in order; seconds per phase."""
    completed = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([list(p) for p in phases])],
        capture_output=True, text=True, timeout=timeout_s, env=_child_env(), check=False,
    )
    if completed.returncode != 0:
        return {"error": completed.stderr.strip()[-2000:] or f"exit {completed.returncode}"}
    parsed: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return parsed


def run_tracing_imports(rounds: int) -> dict[str, Any]:
    """`rounds` fresh interpreters per variant, round-robin, the order rotated each round."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    started = time.time()
    load_before = os.getloadavg()[0]
    names = list(VARIANTS)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            runs[name].append(time_variant(VARIANTS[name]))
    return {
        "benchmark": "tracing-imports",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": time.time() - started,
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "python": sys.version.split()[0],
        "rounds": rounds,
        "modules": {"start_path": list(START_PATH), "tracing": list(TRACING)},
        "runs": runs,
        "figures": figures(runs),
    }


def _phase(runs: Sequence[Mapping[str, Any]], index: int) -> list[float | None]:
    return [r["phases_s"][index] if "phases_s" in r else None for r in runs]


def figures(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, float | None]:
    """Medians (and p95s) in seconds, and the tracing imports as a share of the start path."""
    start = _phase(runs["start_path"], 0)
    added = _phase(runs["start_path_plus_tracing"], 1)
    alone = _phase(runs["tracing_alone"], 0)
    start_p50, added_p50 = median(start), median(added)
    return {
        "start_path_p50_s": start_p50,
        "start_path_p95_s": percentile(start, 95),
        "tracing_after_start_path_p50_s": added_p50,
        "tracing_after_start_path_p95_s": percentile(added, 95),
        "tracing_alone_p50_s": median(alone),
        "tracing_alone_p95_s": percentile(alone, 95),
        "tracing_share_of_start_path": (added_p50 / start_p50) if start_p50 and added_p50 is not None else None,
    }


def render_tracing_imports(result: Mapping[str, Any]) -> str:
    f = result["figures"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    failed = {name: sum("error" in r for r in runs) for name, runs in result["runs"].items()}
    share = f["tracing_share_of_start_path"]
    lines = [
        "# warmpool bench tracing-imports",
        "",
        f"Started {result['started']}; {result['cpus']} CPUs, load average {result['load_average_before']:.2f} "
        f"before / {result['load_average_after']:.2f} after; Python {result['python']}; "
        f"{result['rounds']} fresh interpreters per variant, round-robin; wall {result['wall_s']:.0f} s.",
        "",
        "Import time measured inside each fresh interpreter (interpreter start-up left out).",
        "",
        "| what | p50 ms | p95 ms |",
        "|---|---:|---:|",
        f"| worker start path ({', '.join(result['modules']['start_path'])}) | "
        f"{ms(f['start_path_p50_s'])} | {ms(f['start_path_p95_s'])} |",
        f"| OpenTelemetry imports, after the start path | {ms(f['tracing_after_start_path_p50_s'])} | "
        f"{ms(f['tracing_after_start_path_p95_s'])} |",
        f"| OpenTelemetry imports, alone | {ms(f['tracing_alone_p50_s'])} | {ms(f['tracing_alone_p95_s'])} |",
        "",
        f"Tracing's imports ÷ the start path's: {'-' if share is None else f'{share:.2f}'}. "
        "With tracing off none of them is imported; with it on, the worker imports them on its "
        "span-export thread after it is Ready, so they add nothing to time-to-ready.",
        "",
        f"Failed runs: {failed}.",
        "",
    ]
    return "\n".join(lines)
