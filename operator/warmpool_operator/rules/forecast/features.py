"""Features for forecasting a step's request figure (its count, or its peak) from the steps before it.

The reference design: sliding windows of 15 minutes moved by 60 s.  For a forecast made
after step ``end - 1`` (the last one observed) of the count at step ``end - 1 + horizon``:

- ``lag_1 .. lag_W``: the last W counts (W = 15 steps);
- ``mean_W, std_W, min_W, max_W``: rolling statistics over those W steps;
- ``mean_L``: the mean over a longer window (L = 60 steps; fewer at the start of history);
- ``slope_W``: last minus first of the window, divided by W;
- ``tod_sin, tod_cos`` (time of day of the target step), only once the history spans
  ``time_of_day_min_steps`` (2 days by default: one day cannot tell a daily pattern from noise);
- ``dow_sin, dow_cos`` (day of week), only once it spans ``day_of_week_min_steps`` (14 days:
  each weekday seen at least twice).  With the default 7-day retention that never happens,
  so weekly features need a longer retention; this is deliberate, not an oversight;
- with a *companion* series (the step counts, when the series forecast is the steps' peaks):
  ``count_lag_1``, ``count_mean_W`` and ``count_max_W``, so the model sees the mean level the
  bursts ride on beside the bursts themselves.

Missing steps are NaN (LightGBM routes them); rolling statistics skip them.  One function
builds every row, so training and inference can never disagree on a feature.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class FeatureConfig:
    step_s: int = 60
    window: int = 15  # steps: 15 min at 60 s
    long_window: int = 60
    time_of_day_min_steps: int = 2 * 1440
    day_of_week_min_steps: int = 14 * 1440

    def __post_init__(self) -> None:
        if self.window < 2 or self.long_window < self.window:
            raise ValueError(f"window ({self.window}) must be >= 2 and <= long_window ({self.long_window})")


@dataclass(frozen=True)
class FeatureSet:
    """Which features a model uses; fixed when it is trained, reused at inference."""

    window: int
    long_window: int
    time_of_day: bool
    day_of_week: bool
    companion: bool = False  # count_* features from a companion series (see the module docstring)

    @property
    def names(self) -> tuple[str, ...]:
        names = [f"lag_{k}" for k in range(1, self.window + 1)]
        names += [f"mean_{self.window}", f"std_{self.window}", f"min_{self.window}", f"max_{self.window}",
                  f"mean_{self.long_window}", f"slope_{self.window}"]
        if self.time_of_day:
            names += ["tod_sin", "tod_cos"]
        if self.day_of_week:
            names += ["dow_sin", "dow_cos"]
        if self.companion:
            names += ["count_lag_1", f"count_mean_{self.window}", f"count_max_{self.window}"]
        return tuple(names)


def feature_set(config: FeatureConfig, history_steps: int, companion: bool = False) -> FeatureSet:
    """The features a history of ``history_steps`` steps supports (``companion``: with count_* features)."""
    return FeatureSet(window=config.window, long_window=config.long_window,
                      time_of_day=history_steps >= config.time_of_day_min_steps,
                      day_of_week=history_steps >= config.day_of_week_min_steps, companion=companion)


def feature_matrix(series: FloatArray, first_step: int, horizon: int, features: FeatureSet,
                   step_s: int, companion: FloatArray | None = None) -> FloatArray:
    """One row per forecast origin ``end`` in ``window .. len(series)`` (row i: end = window + i).

    Row ``i`` describes ``series[:end]`` and the target step ``end - 1 + horizon``;
    ``first_step`` is the step index (unix time // step_s) of ``series[0]``.  ``companion``
    (the same steps as ``series``) is required exactly when ``features.companion``.
    """
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1 step, got {horizon}")
    if features.companion != (companion is not None) or (companion is not None and len(companion) != len(series)):
        raise ValueError(f"features {'need' if features.companion else 'take no'} companion series of "
                         f"{len(series)} steps, got {None if companion is None else len(companion)}")
    w = features.window
    n = len(series)
    if n < w:
        return np.empty((0, len(features.names)), dtype=np.float64)
    windows = np.lib.stride_tricks.sliding_window_view(series, w)  # windows[i] = series[i : i + w]
    lags = windows[:, ::-1]
    with warnings.catch_warnings():  # a window of nothing but missing steps is NaN, as it should be
        warnings.simplefilter("ignore", category=RuntimeWarning)
        mean = np.nanmean(windows, axis=1)
        std = np.nanstd(windows, axis=1)
        low = np.nanmin(windows, axis=1)
        high = np.nanmax(windows, axis=1)
        if companion is not None:
            other = np.lib.stride_tricks.sliding_window_view(companion, w)
            other_columns = [other[:, -1:], np.nanmean(other, axis=1)[:, None], np.nanmax(other, axis=1)[:, None]]
    ends = np.arange(w, n + 1)
    long_mean = _trailing_mean(series, ends, features.long_window)
    slope = (windows[:, -1] - windows[:, 0]) / w
    columns = [lags, mean[:, None], std[:, None], low[:, None], high[:, None], long_mean[:, None], slope[:, None]]
    target_seconds = (first_step + ends - 1 + horizon).astype(np.float64) * step_s
    if features.time_of_day:
        angle = 2 * math.pi * (target_seconds % 86400) / 86400
        columns += [np.sin(angle)[:, None], np.cos(angle)[:, None]]
    if features.day_of_week:
        angle = 2 * math.pi * (target_seconds % (7 * 86400)) / (7 * 86400)
        columns += [np.sin(angle)[:, None], np.cos(angle)[:, None]]
    if companion is not None:
        columns += other_columns
    return np.hstack(columns).astype(np.float64)


def training_rows(series: FloatArray, first_step: int, horizon: int, features: FeatureSet, step_s: int,
                  max_rows: int, companion: FloatArray | None = None) -> tuple[FloatArray, FloatArray]:
    """(X, y) for every origin whose target (in ``series``) is observed, the most recent ``max_rows`` of them."""
    matrix = feature_matrix(series, first_step, horizon, features, step_s, companion)
    usable = len(matrix) - horizon  # the last `horizon` origins have no target yet
    if usable <= 0:
        return matrix[:0], np.empty(0, dtype=np.float64)
    x = matrix[:usable]
    targets = series[features.window - 1 + horizon: features.window - 1 + horizon + usable]
    keep = ~np.isnan(targets)
    x, y = x[keep], targets[keep]
    return x[-max_rows:], y[-max_rows:]


def latest_row(series: FloatArray, first_step: int, horizon: int, features: FeatureSet,
               step_s: int, companion: FloatArray | None = None) -> FloatArray | None:
    """The row for a forecast made now (origin = len(series)); None when the history is shorter than a window."""
    keep = features.long_window + features.window
    tail = series[-keep:]
    matrix = feature_matrix(tail, first_step + len(series) - len(tail), horizon, features, step_s,
                            None if companion is None else companion[-keep:])
    return matrix[-1:] if len(matrix) else None


def _trailing_mean(series: FloatArray, ends: npt.NDArray[np.int64], window: int) -> FloatArray:
    """Mean of the observed values in series[max(0, end - window) : end] for each end (NaN if none)."""
    observed = ~np.isnan(series)
    sums = np.concatenate(([0.0], np.cumsum(np.where(observed, series, 0.0))))
    counts = np.concatenate(([0], np.cumsum(observed)))
    starts = np.maximum(ends - window, 0)
    total, count = sums[ends] - sums[starts], counts[ends] - counts[starts]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)
