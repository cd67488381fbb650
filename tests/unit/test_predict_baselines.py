"""Baselines (last value, seasonal naive, EWMA) and the online scoreboard that compares them with LightGBM."""

from __future__ import annotations

import math

import numpy as np
import pytest
from warmpool_operator.rules.forecast.baselines import (
    Baseline,
    BaselineConfig,
    QuantileForecast,
    forecast,
    point_forecasts,
)
from warmpool_operator.rules.forecast.evaluation import Scoreboard, pinball, quantile_loss

from tests.support.series import as_series

pytestmark = pytest.mark.unit

CONFIG = BaselineConfig(season_steps=4, ewma_alpha=0.5, residual_window=50)


def test_last_value_skips_missing_steps() -> None:
    series = as_series([3, None, None, 7, None])
    points = point_forecasts(Baseline.LAST_VALUE, series, 1, CONFIG)
    assert math.isnan(points[0])  # nothing observed yet
    assert points[1:].tolist() == [3.0, 3.0, 3.0, 7.0, 7.0]
    assert forecast(Baseline.LAST_VALUE, as_series([None, None]), 1, CONFIG) is None


def test_ewma_levels() -> None:
    series = as_series([4, 8, None, 0])
    points = point_forecasts(Baseline.EWMA, series, 1, CONFIG)
    assert points[1:].tolist() == [4.0, 6.0, 6.0, 3.0]  # alpha 0.5; a missing step leaves the level alone


def test_seasonal_naive_reads_one_season_back_for_the_target_step() -> None:
    series = as_series([10, 20, 30, 40, 11, 21])
    # origin end=6 (last observed index 5), horizon 1 -> target index 6 -> one season back: index 2
    assert forecast(Baseline.SEASONAL_NAIVE, series, 1, CONFIG) == QuantileForecast(1, 30.0, 30.0)
    assert forecast(Baseline.SEASONAL_NAIVE, series, 3, CONFIG) == QuantileForecast(3, 11.0, 11.0)
    # With less than a season of history there is nothing to read: no forecast, not an error.
    assert forecast(Baseline.SEASONAL_NAIVE, as_series([1, 2]), 1, CONFIG) is None
    assert forecast(Baseline.SEASONAL_NAIVE, as_series([1, 2]), 1, BaselineConfig()) is None


def test_band_is_as_wide_as_recent_errors() -> None:
    steady = forecast(Baseline.LAST_VALUE, np.full(40, 5.0), 1, CONFIG)
    assert steady == QuantileForecast(1, 5.0, 5.0)  # never wrong: no band
    rising = forecast(Baseline.LAST_VALUE, np.arange(40, dtype=np.float64), 2, CONFIG)
    assert rising is not None
    # last value 39 is always 2 short two steps ahead on a ramp: the band learns that
    assert rising.p50 == pytest.approx(41.0) and rising.p90 == pytest.approx(41.0)
    noisy = forecast(Baseline.LAST_VALUE, np.random.default_rng(0).normal(50, 5, 60), 1, CONFIG)
    assert noisy is not None and noisy.p90 > noisy.p50 >= 0
    assert isinstance(noisy.p50, float) and isinstance(noisy.p90, float)  # plain floats: they go into JSON


def test_too_few_errors_give_the_point_itself() -> None:
    assert forecast(Baseline.LAST_VALUE, as_series([1, 9, 2]), 1, CONFIG) == QuantileForecast(1, 2.0, 2.0)


def test_forecasts_are_never_negative_and_never_cross() -> None:
    falling = np.array([100.0, 50.0, 0.0] * 10)
    for kind in Baseline:
        f = forecast(kind, falling, 1, CONFIG)
        assert f is not None and 0 <= f.p50 <= f.p90
    with pytest.raises(ValueError, match="p50"):
        QuantileForecast(1, 5.0, 4.0)
    with pytest.raises(ValueError, match="finite"):
        QuantileForecast(1, math.nan, 4.0)


def test_pinball_charges_a_low_p90_nine_times_a_high_one() -> None:
    assert pinball(10, 8, 0.9) == pytest.approx(1.8)
    assert pinball(10, 12, 0.9) == pytest.approx(0.2)
    assert pinball(10, 10, 0.5) == 0.0
    assert quantile_loss(10, QuantileForecast(1, 10, 12)) == pytest.approx(0.1)


def test_scoreboard_compares_candidates_on_the_same_steps() -> None:
    board = Scoreboard(window=100, min_scored=3)
    for step in range(10):
        board.record("steady", step, QuantileForecast(1, 10, 10))
        if step >= 6:  # joins late, and is perfect on steps where the steady one is also perfect
            board.record("late", step, QuantileForecast(1, 10, 10))
        board.observe(step, 10.0 if step >= 6 else 0.0)
    standings = board.standings()
    assert [s.candidate for s in standings] == ["late", "steady"]  # tie on the common steps, then by name
    assert all(s.scored == 4 and s.loss == 0.0 for s in standings)  # steps 6..9 only, not steady's bad early ones


def test_scoreboard_eligibility_and_unobserved_steps() -> None:
    board = Scoreboard(window=100, min_scored=3)
    board.record("a", 1, QuantileForecast(1, 1, 2))
    board.record("a", 2, QuantileForecast(1, 1, 2))
    board.observe(1, 1.0)
    board.observe(2, None)  # a missing step scores nothing
    assert board.standings() == []  # one score is not enough to be judged
    board.record("a", 3, QuantileForecast(1, 1, 2))
    board.drop_before(4)
    assert board.pending == {}
