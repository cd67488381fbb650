"""Features over the 15-step window: each column is what its name says, missing steps are NaN (never 0),
training rows line up with their targets, inference builds the same row as training, and time of
day/week appear only once the history is long enough to learn them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from warmpool_operator.rules.forecast.features import (
    FeatureConfig,
    FeatureSet,
    feature_matrix,
    feature_set,
    latest_row,
    training_rows,
)

from tests.support.series import as_series

pytestmark = pytest.mark.unit

PLAIN = FeatureSet(window=15, long_window=60, time_of_day=False, day_of_week=False)


def _column(features: FeatureSet, row: np.ndarray, name: str) -> float:
    return float(row[features.names.index(name)])


def test_window_columns_are_lags_and_rolling_statistics() -> None:
    series = np.arange(30, dtype=np.float64)  # 0, 1, ..., 29
    matrix = feature_matrix(series, first_step=0, horizon=1, features=PLAIN, step_s=60)
    assert matrix.shape == (30 - 15 + 1, len(PLAIN.names))  # one row per origin end = 15 .. 30
    row = matrix[0]  # origin end = 15: series[:15] = 0..14 observed
    assert [_column(PLAIN, row, f"lag_{k}") for k in (1, 2, 15)] == [14.0, 13.0, 0.0]
    assert _column(PLAIN, row, "mean_15") == 7.0
    assert _column(PLAIN, row, "min_15") == 0.0 and _column(PLAIN, row, "max_15") == 14.0
    assert _column(PLAIN, row, "std_15") == pytest.approx(np.std(np.arange(15)))
    assert _column(PLAIN, row, "slope_15") == pytest.approx(14 / 15)
    assert _column(PLAIN, row, "mean_60") == 7.0  # fewer than 60 steps so far: the mean of what there is
    last = matrix[-1]  # origin end = 30
    assert _column(PLAIN, last, "lag_1") == 29.0 and _column(PLAIN, last, "mean_60") == pytest.approx(14.5)


def test_missing_steps_are_nan_and_skipped_by_the_statistics() -> None:
    series = as_series([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, None])
    (row,) = feature_matrix(series, 0, 1, PLAIN, 60)
    assert math.isnan(_column(PLAIN, row, "lag_1"))
    assert _column(PLAIN, row, "lag_2") == 1.0
    assert _column(PLAIN, row, "mean_15") == 1.0  # not 14/15: a missing step is not a zero
    all_missing = as_series([None] * 15)
    (row,) = feature_matrix(all_missing, 0, 1, PLAIN, 60)
    assert math.isnan(_column(PLAIN, row, "mean_15")) and math.isnan(_column(PLAIN, row, "mean_60"))


def test_training_rows_line_up_with_their_targets() -> None:
    series = np.arange(40, dtype=np.float64) * 2
    for horizon in (1, 3):
        x, y = training_rows(series, 0, horizon, PLAIN, 60, max_rows=1000)
        assert len(x) == len(y) == 40 - 15 - horizon + 1
        lag1 = x[:, PLAIN.names.index("lag_1")]
        # the target is `horizon` steps after the last observed one
        assert np.array_equal(y, lag1 + 2 * horizon)
    x, y = training_rows(series, 0, 1, PLAIN, 60, max_rows=5)
    assert len(y) == 5 and y[-1] == series[-1]  # the most recent rows are kept


def test_training_drops_rows_whose_target_is_missing() -> None:
    values: list[float | None] = [float(v) for v in range(30)]
    values[20] = None
    _x, y = training_rows(as_series(values), 0, 1, PLAIN, 60, max_rows=1000)
    assert len(y) == 30 - 15 - 1 and not np.isnan(y).any()


def test_short_history_gives_no_rows_not_an_error() -> None:
    assert feature_matrix(np.ones(5), 0, 1, PLAIN, 60).shape == (0, len(PLAIN.names))
    x, y = training_rows(np.ones(15), 0, 1, PLAIN, 60, max_rows=10)
    assert len(x) == len(y) == 0
    assert latest_row(np.ones(14), 0, 1, PLAIN, 60) is None
    with pytest.raises(ValueError, match="horizon"):
        feature_matrix(np.ones(20), 0, 0, PLAIN, 60)


def test_inference_row_is_the_training_row_for_the_same_origin() -> None:
    rng = np.random.default_rng(1)
    series = rng.poisson(20, 500).astype(np.float64)
    series[rng.choice(500, 30, replace=False)] = np.nan
    features = FeatureSet(window=15, long_window=60, time_of_day=True, day_of_week=True)
    full = feature_matrix(series, 28_000_000, 2, features, 60)
    latest = latest_row(series, 28_000_000, 2, features, 60)
    assert latest is not None
    np.testing.assert_allclose(latest[0], full[-1], equal_nan=True)


def test_time_features_only_with_enough_history() -> None:
    config = FeatureConfig()
    assert not feature_set(config, 1440).time_of_day  # one day cannot tell a daily pattern from noise
    two_days = feature_set(config, 2 * 1440)
    assert two_days.time_of_day and not two_days.day_of_week
    assert feature_set(config, 14 * 1440).day_of_week
    assert "tod_sin" in two_days.names and "dow_sin" not in two_days.names
    assert "tod_sin" not in feature_set(config, 100).names


def test_time_of_day_is_that_of_the_target_step() -> None:
    features = FeatureSet(window=15, long_window=60, time_of_day=True, day_of_week=False)
    day_start_step = 20_000 * 1440  # a UTC midnight, in 60 s steps
    # 15 steps observed ending one step before midnight; horizon 1 targets midnight itself.
    matrix = feature_matrix(np.ones(15), day_start_step - 15, 1, features, 60)
    assert _column(features, matrix[0], "tod_sin") == pytest.approx(0.0, abs=1e-9)
    assert _column(features, matrix[0], "tod_cos") == pytest.approx(1.0)


def test_config_refuses_a_window_that_cannot_work() -> None:
    with pytest.raises(ValueError, match="window"):
        FeatureConfig(window=1)
    with pytest.raises(ValueError, match="window"):
        FeatureConfig(window=30, long_window=20)
