"""Online evaluation: every candidate's forecasts are scored when their step is observed.

The score is the mean pinball (quantile) loss of the p50 and the p90 forecasts, the proper
score for quantiles: a p90 that is too low is charged 9x what a p90 too high by the same
amount is.  Candidates are compared on the same target steps only (the ones every
eligible candidate forecast within the recent window), so a model that joined late is
not judged on easier or harder steps than the baselines it is compared with.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from warmpool_operator.rules.forecast.baselines import QuantileForecast


def pinball(actual: float, predicted: float, quantile: float) -> float:
    """Pinball loss of one quantile forecast."""
    error = actual - predicted
    return max(quantile * error, (quantile - 1) * error)


def quantile_loss(actual: float, forecast: QuantileForecast) -> float:
    """Mean pinball loss of a p50/p90 forecast."""
    return (pinball(actual, forecast.p50, 0.5) + pinball(actual, forecast.p90, 0.9)) / 2


@dataclass(frozen=True)
class Standing:
    candidate: str
    loss: float  # mean loss over the common recent steps
    scored: int  # how many steps that mean is over


@dataclass
class Scoreboard:
    """Pending forecasts by target step, and each candidate's recent losses."""

    window: int = 60  # recent target steps kept per candidate
    min_scored: int = 5  # a candidate with fewer recent scores is not eligible
    pending: dict[int, dict[str, list[QuantileForecast]]] = field(default_factory=dict)
    losses: dict[str, deque[tuple[int, float]]] = field(default_factory=dict)

    def record(self, candidate: str, target_step: int, forecast: QuantileForecast) -> None:
        self.pending.setdefault(target_step, {}).setdefault(candidate, []).append(forecast)

    def observe(self, step: int, actual: float | None) -> None:
        """Score every forecast made for ``step``; an unobserved step scores nothing."""
        made = self.pending.pop(step, {})
        if actual is None:
            return
        for candidate, forecasts in made.items():
            loss = sum(quantile_loss(actual, f) for f in forecasts) / len(forecasts)
            self.losses.setdefault(candidate, deque(maxlen=self.window)).append((step, loss))

    def drop_before(self, step: int) -> None:
        """Forget pending forecasts for steps before ``step`` (they will never be observed now)."""
        for stale in [s for s in self.pending if s < step]:
            del self.pending[stale]

    def standings(self) -> list[Standing]:
        """Eligible candidates, best (lowest loss) first, over their common recent steps."""
        eligible = {c: dict(scores) for c, scores in self.losses.items() if len(scores) >= self.min_scored}
        if not eligible:
            return []
        common = set.intersection(*(set(scores) for scores in eligible.values()))
        if len(common) < self.min_scored:  # no common ground yet: each on its own recent steps
            return sorted((Standing(c, sum(s.values()) / len(s), len(s)) for c, s in eligible.items()),
                          key=lambda st: (st.loss, st.candidate))
        return sorted((Standing(c, _mean_over(s, common), len(common)) for c, s in eligible.items()),
                      key=lambda st: (st.loss, st.candidate))


def _mean_over(scores: Mapping[int, float], steps: set[int]) -> float:
    return sum(scores[s] for s in steps) / len(steps)
