"""The forecast's time scale read off the traffic itself (pure): its step and its horizon.  One owner
for both users: the live operator (control/forecasting.py: request counts per history step) and the
offline replay (``bench predict``: arrival times).

A step longer than the bursts averages them away (a 60 s step over 10-30 s bursts holds pods for
the whole minute); a step shorter than the data's resolution forecasts noise.  So:

- **Bursts** are the spells when arrivals run well above the traffic's mean rate: maximal runs of
  ``bin_s`` bins whose count is at least :attr:`TimescaleConfig.burst_factor` times the mean per
  bin (and at least two requests), quiet gaps up to ``merge_gap_s`` inside one burst.  The replay
  bins arrival times by the second; the operator's bins are its history's steps (the counters'
  resolution), so it sees only bursts at least a history step long.
- **Step** = the longest allowed step no longer than half the typical burst (the median burst
  duration weighted by the requests each burst carries: the burst a request typically arrives in,
  not the many one-second blips), so a typical burst fills at least one whole step (its rate is
  seen, not diluted), and never below the shortest allowed one (the counters' resolution).
  Allowed steps divide a minute, so they also divide the history's hour slots; the operator's are
  whole multiples of its history step (a step it forecasts at is a sum of steps it holds).  No
  bursts at all: the longest allowed step.
- **Horizon**: the forecast steps covering ``[now + lead, now + lead + step)`` for the pool's p95
  cold start (:func:`~warmpool_operator.rules.forecast.decision.horizons`): what is forecast is
  what capacity asked for now meets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Steps a forecast may use: each divides a minute (and so an hour slot).
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


def bursts_in_counts(counts: Sequence[int | None], bin_s: float, burst_factor: float = 2.0,
                     merge_gap_s: float = 2.0) -> list[Burst]:
    """The bursts in per-bin request counts (None: a bin not observed; it is no burst, and does not
    lower the mean)."""
    if bin_s <= 0 or burst_factor <= 0 or merge_gap_s < 0:
        raise ValueError(f"need bin_s > 0, burst_factor > 0, merge_gap_s >= 0, got {bin_s}, {burst_factor}, "
                         f"{merge_gap_s}")
    known = [c for c in counts if c is not None]
    if not known:
        return []
    threshold = max(2.0, burst_factor * sum(known) / len(known))
    runs: list[tuple[int, int]] = []  # [first, last] busy bins
    for index, count in enumerate(counts):
        if count is None or count < threshold:
            continue
        if runs and (index - runs[-1][1] - 1) * bin_s <= merge_gap_s:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return [Burst((last - first + 1) * bin_s, sum(c or 0 for c in counts[first:last + 1])) for first, last in runs]


def bursts(times: Sequence[float], config: TimescaleConfig = TimescaleConfig()) -> list[Burst]:
    """The bursts in ``times`` (arrival times, seconds, sorted): how long each lasted, what it carried."""
    if len(times) < 2:
        return []
    origin, span = times[0], times[-1] - times[0]
    bins = max(1, math.ceil(span / config.bin_s) + 1)
    counts: list[int | None] = [0] * bins
    for t in times:
        index = min(bins - 1, int((t - origin) // config.bin_s))
        counts[index] = (counts[index] or 0) + 1
    return bursts_in_counts(counts, config.bin_s, config.burst_factor, config.merge_gap_s)


def weighted_percentile(found: Sequence[Burst], q: float) -> float:
    """The burst duration below which ``q`` of the bursts' requests arrived."""
    ordered = sorted(found, key=lambda b: b.seconds)
    total, seen = sum(b.requests for b in ordered), 0
    for burst in ordered:
        seen += burst.requests
        if seen >= q * total:
            return burst.seconds
    return ordered[-1].seconds


def step_for_bursts(found: Sequence[Burst], allowed: Sequence[int], what: str) -> StepChoice:
    """The longest of ``allowed`` steps no longer than half the typical burst (the shortest when
    none is; the longest when there are no bursts).  ``what`` names the bursts' threshold."""
    if not allowed or any(s < 1 for s in allowed):
        raise ValueError(f"allowed steps must be >= 1 s and at least one, got {list(allowed)}")
    ordered = sorted(set(allowed))
    if not found:
        return StepChoice(ordered[-1], 0, None, None, f"no bursts ({what}): the longest step, {ordered[-1]} s")
    p50, p90 = weighted_percentile(found, 0.5), weighted_percentile(found, 0.9)
    fitting = [s for s in ordered if s <= p50 / 2]
    step = max(fitting, default=ordered[0])
    why = ("the longest allowed step ≤ half the typical burst" if fitting
           else f"half the typical burst is below the counters' resolution: {ordered[0]} s")
    return StepChoice(step, len(found), p50, p90,
                      f"{len(found)} bursts; a request's typical burst lasts {p50:g} s (p90 {p90:g} s): "
                      f"{step} s steps ({why})")


def choose_step(times: Sequence[float], config: TimescaleConfig = TimescaleConfig()) -> StepChoice:
    """The forecast step for traffic arriving at ``times`` (the replay's choice)."""
    return step_for_bursts(bursts(times, config), [s for s in ALLOWED_STEPS_S if s >= config.min_step_s],
                           f"no {config.bin_s:g} s with ≥ {config.burst_factor:g}x the mean rate")


def steps_over(history_step_s: int) -> tuple[int, ...]:
    """The steps a history held at ``history_step_s`` can be forecast at: itself, and the allowed
    steps that are whole multiples of it (a 60 s history: 60 s only)."""
    if history_step_s < 1:
        raise ValueError(f"the history step must be >= 1 s, got {history_step_s}")
    return tuple(sorted({history_step_s, *(s for s in ALLOWED_STEPS_S
                                           if s > history_step_s and s % history_step_s == 0)}))


def choose_step_from_counts(counts: Sequence[int | None], history_step_s: int,
                            burst_factor: float = 2.0) -> StepChoice:
    """The forecast step for a history's per-step request counts (the operator's choice): bursts
    are runs of its steps, merged across one quiet step at most."""
    found = bursts_in_counts(counts, float(history_step_s), burst_factor, merge_gap_s=float(history_step_s))
    return step_for_bursts(found, steps_over(history_step_s),
                           f"no {history_step_s} s step with ≥ {burst_factor:g}x the mean rate")

