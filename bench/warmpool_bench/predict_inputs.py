"""The timings ``warmpool bench predict`` replays with, read from what this machine measured.

One place owns each figure: the replay reads them from the other benchmarks' results
files rather than copying numbers into code, and records where each came from.

- **Cold start** (a new pod): ``bench/results/wake.json``, model ``small`` (SmolLM2-135M,
  the model the service speed below is measured on), variant ``new_pod``: the WarmModel
  scaled from 0 to 1 on the local cluster, from the scale patch to the worker's warm
  ``/readyz`` (``readyz_s``): median for the replayed pods, p95 for the operator's lead time.
- **Wake** (a sleeping pod): the same file, variant ``wake_l1``: the ``POST /control/wake``
  call until it returns with the engine awake (``wake_call_s``), median and p95.
- **Prefill speed**: ``bench/results/coldstart.json``, model ``small``, ``warmpool_full``,
  cold cache, median steady TTFT of a ``request_tokens``-token prompt: tokens ÷ seconds.
- **Decode speed** is not measured by any benchmark here; :data:`DERIVED_DECODE_TOKENS_PER_S`
  is derived (its comment says how) and the report says so.
- **Requests per pod at once**: 1.  The worker serialises generation behind one engine lock
  (``worker/warmpool_worker/builtin/completions.py``: requests beyond it wait in its queue), so a pod
  serves one request at a time; there is no batching to model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmpool_bench.stats import median, percentile

MODEL = "small"
#: From the coldstart run's warm-up (0.99 s for 32/128/512-token prefills + 3 x 4 decoded tokens):
#: (0.99 s - 672 tokens ÷ prefill speed) ÷ 12 tokens = 36 ms per token.  Derived, not measured directly.
DERIVED_DECODE_TOKENS_PER_S = 28.0
#: The worker serves one request at a time (see the module docstring).
REQUESTS_PER_POD = 1


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
class MeasuredInputs:
    cold_start: Timing
    wake: Timing
    prefill_tokens_per_s: float
    prefill_source: str


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
                     "sleeping pod, POST /control/wake (level 1) -> awake; a sleeping pod is not counted in pod-hours"),
        prefill_tokens_per_s=tokens / float(steady),
        prefill_source=f"{results.name}/coldstart.json: {MODEL} warmpool_full cold, {tokens} tokens ÷ median "
                       f"steady TTFT {float(steady):.3f} s",
    )


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
                                 "(run `warmpool bench wake` / `warmpool bench coldstart`, or pass the timings "
                                 "as flags)") from None
    except json.JSONDecodeError as error:
        raise MeasuredInputError(f"{path}: not JSON: {error}") from None


def _get(document: Any, path: Path, *keys: str) -> Any:
    for depth, key in enumerate(keys):
        if not isinstance(document, dict) or key not in document:
            raise MeasuredInputError(f"{path}: no {'.'.join(keys[:depth + 1])}")
        document = document[key]
    return document
