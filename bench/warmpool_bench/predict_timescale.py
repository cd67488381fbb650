"""The forecast's time scale read off the traffic itself (pure): its step and its horizon, for the
offline replay (`bench predict`).  The live operator still forecasts at ``--predict-step-seconds``:
a step chosen here would need its stored history resampled first.

A step longer than the bursts averages them away (a 60 s step over 10-30 s bursts holds pods for
the whole minute); a step shorter than the data's resolution forecasts noise.  So:

- **Bursts** are the spells when arrivals run well above the traffic's mean rate: maximal runs of
  ``bin_s`` bins whose count is at least :attr:`TimescaleConfig.burst_factor` times the mean per
  bin (and at least two requests), quiet gaps up to ``merge_gap_s`` inside one burst.
- **Step** = the longest allowed step no longer than half the typical burst (the median burst
  duration weighted by the requests each burst carries: the burst a request typically arrives in,
  not the many one-second blips), so a typical burst fills at least one whole step (its rate is
  seen, not diluted), and never below ``min_step_s``
  (the resolution of the counters: the operator's scrape interval).  Allowed steps divide a minute,
  so they also divide the history's hour slots.  No bursts at all: the longest allowed step.
- **Horizon**: the forecast steps covering ``[now + lead, now + lead + step)`` for the pool's p95
  cold start (``warmpool_operator.rules.forecast.decision.horizons``): what is forecast is what
  capacity asked for now meets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from warmpool_operator.rules.forecast.decision import horizons

#: Steps a history may use: each divides a minute (and so an hour slot).
ALLOWED_STEPS_S = (5, 10, 15, 20, 30, 60)


@dataclass(frozen=True)
class TimescaleConfig:
    bin_s: float = 1.0
    burst_factor: float = 2.0
    merge_gap_s: float = 2.0
    min_step_s: int = 5

    def __post_init__(self) -> None:
        if not (self.bin_s > 0 and self.burst_factor > 0 and self.merge_gap_s >= 0):
            raise ValueError(f"bin_s and burst_factor must be > 0 and merge_gap_s >= 0, got {self}")
        if self.min_step_s not in ALLOWED_STEPS_S:
            raise ValueError(f"min_step_s must be one of {ALLOWED_STEPS_S}, got {self.min_step_s}")


@dataclass(frozen=True)
class StepChoice:
    step_s: int
    bursts: int
    burst_p50_s: float | None
    burst_p90_s: float | None
    reason: str


@dataclass(frozen=True)
class Burst:
    seconds: float
    requests: int


def bursts(times: Sequence[float], config: TimescaleConfig = TimescaleConfig()) -> list[Burst]:
    """The bursts in ``times`` (arrival times, seconds, sorted): how long each lasted, what it carried."""
    if len(times) < 2:
        return []
    origin, span = times[0], times[-1] - times[0]
    bins = max(1, math.ceil(span / config.bin_s) + 1)
    counts = [0] * bins
    for t in times:
        counts[min(bins - 1, int((t - origin) // config.bin_s))] += 1
    threshold = max(2.0, config.burst_factor * len(times) / bins)
    runs: list[tuple[int, int]] = []  # [first, last] busy bins
    for index, count in enumerate(counts):
        if count < threshold:
            continue
        if runs and (index - runs[-1][1] - 1) * config.bin_s <= config.merge_gap_s:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return [Burst((last - first + 1) * config.bin_s, sum(counts[first:last + 1])) for first, last in runs]


def weighted_percentile(found: Sequence[Burst], q: float) -> float:
    """The burst duration below which ``q`` of the bursts' requests arrived."""
    ordered = sorted(found, key=lambda b: b.seconds)
    total, seen = sum(b.requests for b in ordered), 0
    for burst in ordered:
        seen += burst.requests
        if seen >= q * total:
            return burst.seconds
    return ordered[-1].seconds


def choose_step(times: Sequence[float], config: TimescaleConfig = TimescaleConfig()) -> StepChoice:
    """The history step for traffic arriving at ``times`` (see the module docstring)."""
    found = bursts(times, config)
    if not found:
        return StepChoice(ALLOWED_STEPS_S[-1], 0, None, None,
                          f"no bursts (no {config.bin_s:g} s with ≥ {config.burst_factor:g}x the mean rate): "
                          f"the longest step, {ALLOWED_STEPS_S[-1]} s")
    p50, p90 = weighted_percentile(found, 0.5), weighted_percentile(found, 0.9)
    fitting = [s for s in ALLOWED_STEPS_S if config.min_step_s <= s <= p50 / 2]
    step = max(fitting, default=config.min_step_s)
    why = ("the longest allowed step ≤ half the typical burst" if fitting
           else f"half the typical burst is below the counters' resolution: {config.min_step_s} s")
    return StepChoice(step, len(found), p50, p90,
                      f"{len(found)} bursts; a request's typical burst lasts {p50:g} s (p90 {p90:g} s): "
                      f"{step} s steps ({why})")


def horizon_steps(cold_start_p95_s: float, step_s: int) -> tuple[int, ...]:
    """The steps ahead to forecast: those covering one p95 cold start from now, and one step beyond."""
    return horizons(cold_start_p95_s, step_s)
