"""Pure figures of `warmpool bench wake`: memory breakdowns, per-variant quantiles, the targets.

No I/O and no timing here: a /proc smaps text or a list of runs in, numbers out, so the maths
is tested on its own (tests/unit/test_bench_wake.py).

Memory is split three ways per mapping of /proc/PID/smaps: the **anonymous** pages (heap,
torch's allocations, converted weight copies), the resident pages of the **weight files'**
mappings (on CPU in the checkpoint's dtype the weights *are* those pages), and the rest
(libraries, other files).  "What the model holds beyond its file mapping" is computed from
the checkpoint's headers, not from the measurement it judges: every tensor stored in another
dtype than the compute dtype is a converted copy of ``numel x compute element size`` bytes of
anonymous memory; a tensor already in the compute dtype is served from the mapping itself
(zero copy) and holds nothing beyond it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from warmpool_bench.stats import median, percentile, ratio

#: The compute dtypes the worker takes (--dtype) -> the safetensors name and bytes per element.
COMPUTE_DTYPES: dict[str, tuple[str, int]] = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}

#: The wake targets, as limits on the figures below.
WAKE_P95_LIMIT_S = 1.0
NEW_POD_SPEEDUP_MIN = 20.0
RELEASED_SHARE_MIN = 0.9
FIRST_OVER_STEADY_MAX = 1.2


@dataclass(frozen=True)
class MemoryBreakdown:
    anon_bytes: int
    weights_file_bytes: int  # resident pages of the weight files' mappings, less their private (COW) pages
    other_file_bytes: int

    def as_dict(self, suffix: str) -> dict[str, int]:
        return {f"anon_{suffix}_bytes": self.anon_bytes, f"weights_file_{suffix}_bytes": self.weights_file_bytes,
                f"other_file_{suffix}_bytes": self.other_file_bytes}


def parse_smaps(text: str, weight_paths: Iterable[str]) -> MemoryBreakdown:
    """Split a /proc/PID/smaps text into anonymous, weight-file and other file-backed resident bytes.

    A mapping's ``Anonymous`` pages count as anonymous wherever they are (a private file
    mapping's written pages are), its other resident pages as file-backed: the weight files'
    when the mapping's path is one of `weight_paths`.
    """
    weights = set(weight_paths)
    anon = weights_file = other_file = 0
    path: str | None = None
    rss = anonymous = 0

    def close() -> None:
        nonlocal anon, weights_file, other_file
        anon += anonymous
        file_backed = max(0, rss - anonymous)
        if path is not None and path in weights:
            weights_file += file_backed
        else:
            other_file += file_backed

    started = False
    for line in text.splitlines():
        head, _, rest = line.partition(":")
        if " " not in head and rest.strip().endswith("kB"):  # "Rss:   123 kB"
            value = int(rest.split()[0]) * 1024
            if head == "Rss":
                rss = value
            elif head == "Anonymous":
                anonymous = value
            continue
        fields = line.split(None, 5)
        if len(fields) >= 5 and "-" in fields[0]:  # a mapping's header: range perms offset dev inode [path]
            if started:
                close()
            started = True
            path = fields[5].strip() if len(fields) == 6 else None
            rss = anonymous = 0
    if started:
        close()
    return MemoryBreakdown(anon, weights_file, other_file)


def beyond_mapping_bytes(tensors: Iterable[tuple[str, Sequence[int]]], compute_dtype: str) -> int:
    """Bytes the engine holds outside the weight files' mapping: the converted copies.

    `tensors` are (safetensors dtype, shape) pairs; a tensor already in the compute dtype is
    served from the mapping (zero copy on CPU) and counts 0.
    """
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute dtype {compute_dtype!r} (one of {', '.join(COMPUTE_DTYPES)})")
    name, size = COMPUTE_DTYPES[compute_dtype]
    return sum(math.prod(shape) * size for dtype, shape in tensors if dtype != name)


def memory_figures(awake: MemoryBreakdown, asleep: MemoryBreakdown, beyond_mapping: int) -> dict[str, Any]:
    """What one sleep released, by kind, and its share of what the model held beyond the mapping."""
    anon_released = awake.anon_bytes - asleep.anon_bytes
    return {
        **awake.as_dict("awake"), **asleep.as_dict("asleep"),
        "anon_released_bytes": anon_released,
        "weights_file_released_bytes": awake.weights_file_bytes - asleep.weights_file_bytes,
        "beyond_mapping_bytes": beyond_mapping,
        # None when the model holds nothing beyond the mapping (zero copy): no share to judge
        "anon_released_share": ratio(anon_released, beyond_mapping),
    }


# -- over rounds ------------------------------------------------------------------------------
#: The figure every variant is compared on: the decision -> the first token served.
HEADLINE = "decision_to_first_token_s"


def summarise_runs(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """p50/p95 of the headline, medians of every other numeric field, over the runs that worked."""
    ok = [r for r in runs if "error" not in r]
    keys: list[str] = []
    for run in ok:
        keys += [k for k, v in run.items() if k not in keys and isinstance(v, int | float) and not isinstance(v, bool)]
    out: dict[str, Any] = {"runs_ok": len(ok), "runs": len(runs)}
    for key in keys:
        values = [r.get(key) for r in ok]
        out[key] = median(values)
    headline = [r.get(HEADLINE) for r in ok]
    out["p50_s"] = percentile(headline, 50)
    out["p95_s"] = percentile(headline, 95)
    out["max_s"] = max((float(v) for v in headline if v is not None), default=None)
    return out


def _target(value: float | None, limit: float, at_most: bool, text: str) -> dict[str, Any]:
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {"value": value, "target": text, "met": met}


def targets(summaries: Mapping[str, Mapping[str, Any]], *, judge_wake_p95: bool) -> dict[str, dict[str, Any]]:
    """The issue's targets for one model, each with its figure and met / missed (None: not measured).

    `summaries` maps a variant to `summarise_runs` of it.  The wake p95 limit (1 s) is the
    issue's for SmolLM2 only; for another model the figure is printed, not judged.
    """
    def s(variant: str, key: str) -> float | None:
        value = summaries.get(variant, {}).get(key)
        return None if value is None else float(value)

    out: dict[str, dict[str, Any]] = {}
    for level in (1, 2):
        wake = f"wake_l{level}"
        p95 = s(wake, "p95_s")
        out[f"wake p95, level {level}"] = (_target(p95, WAKE_P95_LIMIT_S, True, "<= 1 s") if judge_wake_p95
                                           else {"value": p95, "target": "(judged for SmolLM2 only)", "met": None})
        out[f"new pod ÷ wake, level {level} (p50 ÷ p50)"] = _target(
            ratio(s("new_pod", "p50_s"), s(wake, "p50_s")), NEW_POD_SPEEDUP_MIN, False, ">= 20x")
        out[f"first TTFT after wake ÷ steady, level {level}"] = _target(
            ratio(s(wake, "first_ttft_after_wake_s"), s(wake, "steady_ttft_s")), FIRST_OVER_STEADY_MAX, True,
            "<= 1.2")
        out[f"anon released ÷ held beyond the mapping, level {level} (converted copies)"] = _target(
            s(f"copies_wake_l{level}", "anon_released_share"), RELEASED_SHARE_MIN, False, ">= 90 %")
    return out


def side_figures(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """Ratios printed beside the targets (not judged)."""
    def s(variant: str, key: str) -> float | None:
        value = summaries.get(variant, {}).get(key)
        return None if value is None else float(value)

    out: dict[str, float | None] = {}
    for level in (1, 2):
        out[f"new_pod_over_wake_p95.l{level}"] = ratio(s("new_pod", "p95_s"), s(f"wake_l{level}", "p95_s"))
        out[f"fresh_process_over_wake.l{level}"] = ratio(s("fresh_process", "p50_s"), s(f"wake_l{level}", "p50_s"))
        out[f"new_pod_over_request_wake.l{level}"] = ratio(s("new_pod", "p50_s"),
                                                           s(f"request_wake_l{level}", "p50_s"))
        out[f"request_wake_ttft_over_steady.l{level}"] = ratio(s(f"request_wake_l{level}", HEADLINE),
                                                               s(f"request_wake_l{level}", "steady_ttft_s"))
        out[f"metric_released_share.copies_l{level}"] = ratio(s(f"copies_wake_l{level}", "released_bytes"),
                                                              s(f"copies_wake_l{level}", "beyond_mapping_bytes"))
    out["new_pod_over_fresh_process"] = ratio(s("new_pod", "p50_s"), s("fresh_process", "p50_s"))
    return out
