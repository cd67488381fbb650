"""Pure figures: medians, percentiles and ratios over runs (no I/O, no timing).

Runs on a shared machine are noisy, so every headline figure is a median over fresh
processes and every target is a ratio of two medians measured in the same run.
A figure a run could not produce is ``None`` and is left out of the median, never
counted as zero.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def _clean(values: Iterable[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def median(values: Iterable[float | None]) -> float | None:
    """The median of the finite values; None when there are none."""
    xs = sorted(_clean(values))
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2.0


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """Percentile `q` (0..100) by linear interpolation between closest ranks (numpy's default)."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    xs = sorted(_clean(values))
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    rank = (len(xs) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(xs) - 1)
    return xs[low] + (xs[high] - xs[low]) * (rank - low)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or not denominator > 0:
        return None
    return numerator / denominator


def summarise(runs: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Median of every numeric field over the runs (fields missing from a run count as None)."""
    keys: list[str] = []
    for run in runs:
        for key, value in run.items():
            if key not in keys and (value is None or (isinstance(value, int | float) and not isinstance(value, bool))):
                keys.append(key)
    return {key: median(run.get(key) for run in runs) for key in keys}


def growth(points: Mapping[int, float | None]) -> dict[str, float | None]:
    """How a figure grows as N doubles: value(2N) / value(N) for each consecutive doubling present."""
    out: dict[str, float | None] = {}
    ns = sorted(points)
    for small, large in itertools.pairwise(ns):
        if large == 2 * small:
            out[f"{small}->{large}"] = ratio(points[large], points[small])
    return out
