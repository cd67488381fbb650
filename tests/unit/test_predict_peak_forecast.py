"""Forecasting the within-step peak: the count features beside the peak's own, the forecaster's target
(the peak by default, the count on request, the same when no peak is known), and a LightGBM model
trained with the companion features and retrained when peaks start arriving."""

from __future__ import annotations

import math

import numpy as np
import pytest
from warmpool_operator.rules.forecast.features import (
    FeatureConfig,
    feature_matrix,
    feature_set,
    latest_row,
    training_rows,
)
from warmpool_operator.rules.forecast.forecaster import TARGET_PEAK, TARGET_REQUESTS, Forecaster, ForecasterConfig
from warmpool_operator.rules.forecast.history import History, StepObservation

pytestmark = pytest.mark.unit

STEP0 = 29_000_000
CONFIG = FeatureConfig(window=3, long_window=4)


def test_companion_columns_are_the_counts_lag_mean_and_max_over_the_window() -> None:
    peaks = np.array([60.0, 120.0, 60.0, 180.0, 60.0])
    counts = np.array([10.0, 20.0, math.nan, 30.0, 6.0])
    features = feature_set(CONFIG, len(peaks), companion=True)
    assert features.names[-3:] == ("count_lag_1", "count_mean_3", "count_max_3")
    matrix = feature_matrix(peaks, STEP0, 1, features, 60, counts)
    assert matrix.shape == (3, len(features.names))
    # origins end = 3, 4, 5: count windows [10, 20, nan], [20, nan, 30], [nan, 30, 6]
    assert np.isnan(matrix[0, -3]) and matrix[1, -3] == 30.0 and matrix[2, -3] == 6.0
    assert list(matrix[:, -2]) == [15.0, 25.0, 18.0] and list(matrix[:, -1]) == [20.0, 30.0, 30.0]
    assert list(matrix[:, 0]) == [60.0, 180.0, 60.0]  # lag_1 is the peak series' own
    plain = feature_matrix(peaks, STEP0, 1, feature_set(CONFIG, len(peaks)), 60)
    assert np.array_equal(plain, matrix[:, :-3], equal_nan=True)  # the rest is what it was
    x, y = training_rows(peaks, STEP0, 1, features, 60, 100, counts)
    assert list(y) == [180.0, 60.0] and np.array_equal(x, matrix[:2], equal_nan=True)
    row = latest_row(peaks, STEP0, 1, features, 60, counts)
    assert row is not None and np.array_equal(row[0], matrix[-1], equal_nan=True)


def test_companion_is_required_exactly_when_the_features_use_it() -> None:
    series = np.arange(5.0)
    with pytest.raises(ValueError, match="need companion"):
        feature_matrix(series, STEP0, 1, feature_set(CONFIG, 5, companion=True), 60)
    with pytest.raises(ValueError, match="take no companion"):
        feature_matrix(series, STEP0, 1, feature_set(CONFIG, 5), 60, series)
    with pytest.raises(ValueError, match="companion series of 5 steps, got 4"):
        feature_matrix(series, STEP0, 1, feature_set(CONFIG, 5, companion=True), 60, series[:4])


def _bursty(steps: int, with_peaks: bool = True) -> History:
    """Counts 10, 20, 30 in turn; each step's burst runs at 6x its count (all of it in one 10 s sub-step)."""
    history = History()
    for k in range(steps):
        count = 10 * (k % 3 + 1)
        history.record(STEP0 + k, StepObservation(requests=count, peak_requests=6 * count if with_peaks else None))
    return history


def test_the_peak_is_forecast_by_default_and_the_count_on_request() -> None:
    history = _bursty(10)  # last step: count 10 (k=9), peak 60
    peak = Forecaster(ForecasterConfig(only="last_value", use_model=False)).update(history, (1,))
    count = Forecaster(ForecasterConfig(only="last_value", use_model=False, target=TARGET_REQUESTS)).update(
        history, (1,))
    assert peak.target == TARGET_PEAK and count.target == TARGET_REQUESTS
    assert peak.model == count.model == "last_value"
    # last value: the point is the last step's figure; its band is its recent errors (the same pattern x6)
    assert peak.forecasts[0].p50 == pytest.approx(6 * count.forecasts[0].p50)
    assert peak.p90 is not None and count.p90 is not None and peak.p90 == pytest.approx(6 * count.p90)


def test_without_peaks_the_peak_target_forecasts_exactly_the_count() -> None:
    history = _bursty(40, with_peaks=False)
    peak = Forecaster(ForecasterConfig(use_model=False)).update(history, (1, 2))
    count = Forecaster(ForecasterConfig(use_model=False, target=TARGET_REQUESTS)).update(history, (1, 2))
    assert peak.candidates == count.candidates and peak.model == count.model


def test_unknown_target_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown forecast target 'p99'"):
        ForecasterConfig(target="p99")


def test_lightgbm_learns_the_peak_with_the_count_features_and_retrains_when_peaks_begin() -> None:
    forecaster = Forecaster(ForecasterConfig(retrain_every_steps=1000))
    plain = _bursty(60, with_peaks=False)
    assert forecaster.maybe_train(plain, (1,))
    assert forecaster.model is not None and not forecaster.model.features.companion
    history = _bursty(60)
    assert forecaster.maybe_train(history, (1,))  # not due by schedule: the features changed
    model = forecaster.model
    assert model is not None and model.features.companion and "count_mean_15" in model.features.names
    assert not forecaster.maybe_train(history, (1,))  # and then not again until due
    prediction = forecaster.predict(history, (1,))
    made = prediction.candidates["lightgbm"][0]
    # the last step (k=59) had count 30, peak 180; the next (k=60) has count 10: its peak is 60, which the
    # lags say exactly (the p90 of so few rows is looser, never below the p50)
    assert made.p50 == pytest.approx(60.0, abs=5.0) and made.p90 >= made.p50
