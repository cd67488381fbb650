"""The tier decision, shared by the worker's local guard and the operator.

Pure functions, no I/O, nothing heavy imported: both sides must reach the same tier from
the same memory figure, so the rule lives once, here.

Rule (percent = used_ratio * 100):

* ``None`` (missing, stale or garbage figure) -> ``Tier.UNKNOWN``: never read as 0 % used.
* enter ``paused`` at ``percent >= pause_at``; enter ``truncated`` at ``percent >= truncate_at``.
* leave a tier only when ``percent`` falls ``hysteresis`` points below that tier's *entry*
  threshold, so a level hovering at a threshold does not flap.  Leaving ``paused`` lands in
  ``truncated`` unless the level is also ``hysteresis`` below ``truncate_at`` (being paused
  implies the truncated condition held too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from warmpool.contract.api import (
    DEFAULT_HYSTERESIS_PERCENT,
    DEFAULT_PAUSE_AT_PERCENT,
    DEFAULT_TRUNCATE_AT_PERCENT,
    Tier,
)


class ThresholdError(ValueError):
    """Thresholds that cannot order the tiers (e.g. pause below truncate)."""


@dataclass(frozen=True)
class Thresholds:
    """Tier entry thresholds in percent of accelerator memory used, and the exit margin."""

    truncate_at: float = DEFAULT_TRUNCATE_AT_PERCENT
    pause_at: float = DEFAULT_PAUSE_AT_PERCENT
    hysteresis: float = DEFAULT_HYSTERESIS_PERCENT

    def __post_init__(self) -> None:
        values = (self.truncate_at, self.pause_at, self.hysteresis)
        if not all(math.isfinite(v) for v in values):
            raise ThresholdError(f"thresholds must be finite numbers, got {values}")
        if not 0 < self.truncate_at <= self.pause_at <= 100:
            raise ThresholdError(
                f"need 0 < truncate_at ({self.truncate_at}) <= pause_at ({self.pause_at}) <= 100"
            )
        if not 0 <= self.hysteresis < self.truncate_at:
            raise ThresholdError(
                f"need 0 <= hysteresis ({self.hysteresis}) < truncate_at ({self.truncate_at})"
            )

    @classmethod
    def parse(cls, text: str) -> Thresholds:
        """Parse ``"70,90,5"`` (truncate_at, pause_at[, hysteresis]) as given on a command line."""
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if len(parts) not in (2, 3):
            raise ThresholdError(f"expected 'truncate,pause[,hysteresis]' in percent, got {text!r}")
        try:
            numbers = [float(p) for p in parts]
        except ValueError as error:
            raise ThresholdError(f"not a number in {text!r}: {error}") from None
        if len(numbers) == 2:
            return cls(truncate_at=numbers[0], pause_at=numbers[1])
        return cls(truncate_at=numbers[0], pause_at=numbers[1], hysteresis=numbers[2])


def clean_ratio(value: object) -> float | None:
    """A used ratio fit to decide on, or None for garbage (non-number, NaN, infinite, negative).

    Ratios above 1 are kept: over-committed memory is real and means paused.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    ratio = float(value)
    if not math.isfinite(ratio) or ratio < 0:
        return None
    return ratio


def raw_tier(used_ratio: float, thresholds: Thresholds) -> Tier:
    """The tier of a level with no history (no hysteresis)."""
    percent = used_ratio * 100.0
    if percent >= thresholds.pause_at:
        return Tier.PAUSED
    if percent >= thresholds.truncate_at:
        return Tier.TRUNCATED
    return Tier.FULL


def decide_tier(used_ratio: float | None, previous: Tier, thresholds: Thresholds) -> Tier:
    """The tier for this memory level, given the tier in force before (hysteresis).

    ``previous`` of ``UNKNOWN`` carries no history: the level alone decides.
    """
    ratio = clean_ratio(used_ratio)
    if ratio is None:
        return Tier.UNKNOWN
    percent = ratio * 100.0
    if percent >= thresholds.pause_at:
        return Tier.PAUSED
    if previous is Tier.PAUSED and percent >= thresholds.pause_at - thresholds.hysteresis:
        return Tier.PAUSED
    if percent >= thresholds.truncate_at:
        return Tier.TRUNCATED
    if (
        previous in (Tier.PAUSED, Tier.TRUNCATED)
        and percent >= thresholds.truncate_at - thresholds.hysteresis
    ):
        return Tier.TRUNCATED
    return Tier.FULL


def stricter(a: Tier, b: Tier) -> Tier:
    """The stricter of two tiers; on a tie a known tier beats UNKNOWN (it says more)."""
    if a.strictness != b.strictness:
        return a if a.strictness > b.strictness else b
    return b if a is Tier.UNKNOWN else a
