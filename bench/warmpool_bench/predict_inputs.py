"""The timings ``warmpool bench predict`` replays with, read from what this machine measured.

One place owns each figure: the replay reads them from the other benchmarks' results
files rather than copying numbers into code, and records where each came from.

- **Cold start** (a new pod): ``bench/results/wake.json``, model ``small`` (SmolLM2-135M,
  the model the service speed below is measured on), variant ``new_pod``: the WarmModel
  scaled from 0 to 1 on the local cluster, from the scale patch to the worker's warm
  ``/readyz`` (``readyz_s``): median for the replayed pods, p95 for the operator's lead time.
- **Wake** (a sleeping pod): the same file, variant ``wake_l1``: the ``POST /control/wake``
  call until it returns with the engine awake (``wake_call_s``), median and p95.
- **What a pod holds**, awake and asleep: the same variant's summary, the worker's anonymous memory
  plus the weight and other files it maps, measured awake and asleep at level 1 (on this CPU
  machine sleep releases little: the weights stay mapped; on a GPU it releases the weights and
  KV cache, not measured here).
- **Prefill speed**: ``bench/results/coldstart.json``, model ``small``, ``warmpool_full``,
  cold cache, median steady TTFT of a ``request_tokens``-token prompt: tokens ÷ seconds.
- **Decode speed and requests per pod at once**: ``bench/results/serve.json``, the built-in engine
  (server ``warmpool``, continuous batching): a single request's steady decode speed (concurrency
  1), and the aggregate steady speed at each concurrency measured (1, 2, 4, 8, 12, 16) over it: the
  batch's speed-up, linear between the measured levels, for batch sizes 1 up to the run's
  ``--max-batch-size`` (the requests a pod serves at once; more wait in its queue).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmpool_bench.stats import median, percentile

MODEL = "small"
#: The serve benchmark's server whose batch the replay's pods have: the built-in engine.
SERVE_SERVER = "warmpool"


class MeasuredInputError(ValueError):
    """A results file the replay needs is missing or lacks a figure; the message names which."""


@dataclass(frozen=True)
class Timing:
    median_s: float
    p95_s: float
    runs: int
    source: str
    loadavg_1m: float | None  # the machine's load while it was measured (these figures move with it)


@dataclass(frozen=True)
class BatchCurve:
    """How a pod decodes: a request alone, and the batch's speed-up at each batch size 1..slots."""

    decode_tokens_per_s: float
    speedups: tuple[float, ...]
    source: str


@dataclass(frozen=True)
class PodMemory:
    """Bytes one worker pod holds awake and asleep (what a sleeping pod still costs)."""

    awake_bytes: float
    asleep_bytes: float
    source: str


@dataclass(frozen=True)
class MeasuredInputs:
    cold_start: Timing
    wake: Timing
    prefill_tokens_per_s: float
    prefill_source: str
    batch: BatchCurve
    memory: PodMemory | None = None


def load_measured(results: Path) -> MeasuredInputs:
    """The figures from ``results``/wake.json and coldstart.json; :class:`MeasuredInputError` if absent."""
    wake = _read(results / "wake.json")
    cold = _read(results / "coldstart.json")
    variants = _get(wake, results / "wake.json", "models", MODEL, "variants")
    steady = _get(cold, results / "coldstart.json", "models", MODEL, "variants", "warmpool_full", "cold", "median",
                  "steady_ttft_s")
    tokens = _get(cold, results / "coldstart.json", "models", MODEL, "request_tokens")
    if not (isinstance(steady, float | int) and steady > 0 and isinstance(tokens, int) and tokens > 0):
        raise MeasuredInputError(f"{results / 'coldstart.json'}: {MODEL} steady TTFT {steady!r} or "
                                 f"request_tokens {tokens!r} is not a positive number")
    return MeasuredInputs(
        cold_start=_timing(variants, "new_pod", "readyz_s", results / "wake.json",
                           "new pod on the local cluster, scale patch -> warm /readyz"),
        wake=_timing(variants, "wake_l1", "wake_call_s", results / "wake.json",
                     "sleeping pod, POST /control/wake (level 1) -> awake; a sleeping pod still counts in "
                     "pod-hours: it holds its accelerator"),
        prefill_tokens_per_s=tokens / float(steady),
        prefill_source=f"{results.name}/coldstart.json: {MODEL} warmpool_full cold, {tokens} tokens ÷ median "
                       f"steady TTFT {float(steady):.3f} s",
        batch=batch_curve(_read(results / "serve.json"), results / "serve.json"),
        memory=pod_memory(variants, results / "wake.json"),
    )


def pod_memory(variants: Any, path: Path) -> PodMemory:
    """What a worker holds awake and asleep at level 1, from wake.json's ``wake_l1`` summary."""
    summary = _get(variants, path, "wake_l1", "summary")
    parts = ("anon", "weights_file", "other_file")
    held = {}
    for state in ("awake", "asleep"):
        values = [summary.get(f"{part}_{state}_bytes") for part in parts]
        if not all(isinstance(v, float | int) and v >= 0 for v in values):
            names = ", ".join(f"{part}_{state}_bytes" for part in parts)
            raise MeasuredInputError(f"{path}: {MODEL}/wake_l1 summary lacks a non-negative {names}")
        held[state] = float(sum(values))
    return PodMemory(held["awake"], held["asleep"],
                     f"{path.parent.name}/{path.name}: {MODEL} wake_l1 anonymous + mapped weight and other files, "
                     "awake and asleep (level 1)")


def batch_curve(serve: Any, path: Path) -> BatchCurve:
    """The built-in engine's decode speed alone and its batch's speed-up per batch size, from serve.json."""
    levels = _get(serve, path, "servers", SERVE_SERVER, "levels")
    slots = _get(serve, path, "settings", "max_batch")
    speeds: dict[int, float] = {}
    for level in levels.values() if isinstance(levels, dict) else ():
        concurrency, speed = level.get("concurrency"), level.get("steady_tok_s")
        if isinstance(concurrency, int) and isinstance(speed, float | int) and speed > 0:
            speeds[concurrency] = float(speed)
    if 1 not in speeds or not (isinstance(slots, int) and slots >= 1):
        raise MeasuredInputError(f"{path}: {SERVE_SERVER} needs a positive steady_tok_s at concurrency 1 and a "
                                 f"max_batch (got levels {sorted(speeds)}, max_batch {slots!r})")
    measured = sorted(speeds)
    speedups = []
    for size in range(1, slots + 1):
        below = max(c for c in measured if c <= size)
        above = min((c for c in measured if c >= size), default=below)  # past the last level: held, not extrapolated
        share = 0.0 if above == below else (size - below) / (above - below)
        speedups.append((speeds[below] + share * (speeds[above] - speeds[below])) / speeds[1])
    speedups[0] = 1.0
    return BatchCurve(speeds[1], tuple(speedups),
                      f"{path.parent.name}/{path.name}: {SERVE_SERVER} steady decode alone, and its speed-up at "
                      f"concurrency {', '.join(map(str, measured))} (linear between), batches up to {slots}")


def overridden_batch(batch: BatchCurve, decode_tokens_per_s: float | None, slots: int | None) -> BatchCurve:
    """``batch`` with a request's speed alone and the batch's size replaced where given (flags)."""
    notes = []
    if decode_tokens_per_s is not None:
        batch = BatchCurve(decode_tokens_per_s, batch.speedups, batch.source)
        notes.append("decode alone from --decode-tokens-per-s")
    if slots is not None:
        # Past the measured batch the speed-up is held, as between the last level and max_batch.
        speedups = tuple(batch.speedups[min(size, len(batch.speedups)) - 1] for size in range(1, slots + 1))
        batch = BatchCurve(batch.decode_tokens_per_s, speedups, batch.source)
        notes.append(f"at most {slots} at once from --requests-per-pod")
    return batch if not notes else BatchCurve(batch.decode_tokens_per_s, batch.speedups,
                                              f"{batch.source}; {'; '.join(notes)}")


def _timing(variants: Any, variant: str, field: str, path: Path, what: str) -> Timing:
    runs = _get(variants, path, variant, "runs")
    values = [r.get(field) for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []
    mid, high = median(values), percentile(values, 95)
    if mid is None or high is None or mid <= 0:
        raise MeasuredInputError(f"{path}: {MODEL}/{variant} has no positive {field!r} in its runs")
    load = _get(variants, path, variant, "summary").get("loadavg_1m")
    return Timing(mid, high, sum(v is not None for v in values),
                  f"{path.parent.name}/{path.name}: {MODEL} {variant} {field} ({what})",
                  float(load) if isinstance(load, float | int) else None)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise MeasuredInputError(f"{path}: cannot read the measured timings: {error.strerror or error} "
                                 "(run `warmpool bench wake` / `warmpool bench coldstart` / `warmpool bench serve`, "
                                 "or pass the timings as flags)") from None
    except json.JSONDecodeError as error:
        raise MeasuredInputError(f"{path}: not JSON: {error}") from None


def _get(document: Any, path: Path, *keys: str) -> Any:
    for depth, key in enumerate(keys):
        if not isinstance(document, dict) or key not in document:
            raise MeasuredInputError(f"{path}: no {'.'.join(keys[:depth + 1])}")
        document = document[key]
    return document
