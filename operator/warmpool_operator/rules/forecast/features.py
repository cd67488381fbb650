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
  each weekday seen at least twice);
- with a *seasonal* series (:class:`Seasonal`: the history's coarse tier, 5 min steps kept for weeks,
  when the fine steps forecast at are kept for a day or so): the spans above are read off it, and
  ``day_ago`` (with the time of day) and ``week_ago`` (with the day of week) are its figure for the
  target's time one day and one week earlier, per forecast step; so a forecast at 10 s steps
  still knows the daily and weekly shape its own steps are too few to show;
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


DAY_S = 86400
WEEK_S = 7 * DAY_S


@dataclass(frozen=True)
class Seasonal:
    """A coarser series of the same figure (NaN where missing), for the daily and weekly parts."""

    values: FloatArray  # per coarse step (requests per coarse step, or its peak at that length)
    first_step: int  # the step index (unix time // step_s) of values[0]
    step_s: int

    @property
    def observed_s(self) -> int:
        """Seconds of it observed (its missing steps left out)."""
        return int(np.count_nonzero(~np.isnan(self.values))) * self.step_s

    def at(self, seconds: FloatArray, step_s: int) -> FloatArray:
        """Its figure for the coarse step holding each time (unix seconds), per ``step_s`` step; NaN
        where it holds none."""
        index = np.floor(seconds / self.step_s).astype(np.int64) - self.first_step
        held = (index >= 0) & (index < len(self.values))
        out = np.full(len(seconds), np.nan)
        out[held] = self.values[index[held]] * (step_s / self.step_s)
        return out


@dataclass(frozen=True)
class FeatureSet:
    """Which features a model uses; fixed when it is trained, reused at inference."""

    window: int
    long_window: int
    time_of_day: bool
    day_of_week: bool
    companion: bool = False  # count_* features from a companion series (see the module docstring)
    seasonal: bool = False  # day_ago / week_ago from a seasonal series (with time_of_day / day_of_week)

    @property
    def day_ago(self) -> bool:
        return self.seasonal and self.time_of_day

    @property
    def week_ago(self) -> bool:
        return self.seasonal and self.day_of_week

    @property
    def needs_seasonal(self) -> bool:
        return self.day_ago or self.week_ago

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
        if self.day_ago:
            names += ["day_ago"]
        if self.week_ago:
            names += ["week_ago"]
        return tuple(names)


def feature_set(config: FeatureConfig, history_steps: int, companion: bool = False,
                seasonal: Seasonal | None = None) -> FeatureSet:
    """The features a history of ``history_steps`` steps supports (``companion``: with count_* features;
    ``seasonal``: the time of day and day of week once either it or the history spans enough, with
    day_ago / week_ago beside them)."""
    span_s = max(history_steps * config.step_s, seasonal.observed_s if seasonal is not None else 0)
    time_of_day = span_s >= config.time_of_day_min_steps * config.step_s
    day_of_week = span_s >= config.day_of_week_min_steps * config.step_s
    return FeatureSet(window=config.window, long_window=config.long_window, time_of_day=time_of_day,
                      day_of_week=day_of_week, companion=companion,
                      seasonal=seasonal is not None and (time_of_day or day_of_week))


def feature_matrix(series: FloatArray, first_step: int, horizon: int, features: FeatureSet,
                   step_s: int, companion: FloatArray | None = None, seasonal: Seasonal | None = None) -> FloatArray:
    """One row per forecast origin ``end`` in ``window .. len(series)`` (row i: end = window + i).

    Row ``i`` describes ``series[:end]`` and the target step ``end - 1 + horizon``;
    ``first_step`` is the step index (unix time // step_s) of ``series[0]``.  ``companion``
    (the same steps as ``series``) is required exactly when ``features.companion``, ``seasonal``
    exactly when ``features.needs_seasonal``.
    """
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1 step, got {horizon}")
    if features.companion != (companion is not None) or (companion is not None and len(companion) != len(series)):
        raise ValueError(f"features {'need' if features.companion else 'take no'} companion series of "
                         f"{len(series)} steps, got {None if companion is None else len(companion)}")
    if features.needs_seasonal != (seasonal is not None):
        raise ValueError(f"features {'need' if features.needs_seasonal else 'take no'} seasonal series")
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
    if seasonal is not None:  # the target's time a day (and a week) earlier: long closed, never ahead of now
        columns += [seasonal.at(target_seconds - lag, step_s)[:, None]
                    for lag, wanted in ((DAY_S, features.day_ago), (WEEK_S, features.week_ago)) if wanted]
    return np.hstack(columns).astype(np.float64)


def training_rows(series: FloatArray, first_step: int, horizon: int, features: FeatureSet, step_s: int,
                  max_rows: int, companion: FloatArray | None = None,
                  seasonal: Seasonal | None = None) -> tuple[FloatArray, FloatArray]:
    """(X, y) for every origin whose target (in ``series``) is observed, the most recent ``max_rows`` of them."""
    matrix = feature_matrix(series, first_step, horizon, features, step_s, companion, seasonal)
    usable = len(matrix) - horizon  # the last `horizon` origins have no target yet
    if usable <= 0:
        return matrix[:0], np.empty(0, dtype=np.float64)
    x = matrix[:usable]
    targets = series[features.window - 1 + horizon: features.window - 1 + horizon + usable]
    keep = ~np.isnan(targets)
    x, y = x[keep], targets[keep]
    return x[-max_rows:], y[-max_rows:]


def latest_row(series: FloatArray, first_step: int, horizon: int, features: FeatureSet,
               step_s: int, companion: FloatArray | None = None, seasonal: Seasonal | None = None) -> FloatArray | None:
    """The row for a forecast made now (origin = len(series)); None when the history is shorter than a window."""
    keep = features.long_window + features.window
    tail = series[-keep:]
    matrix = feature_matrix(tail, first_step + len(series) - len(tail), horizon, features, step_s,
                            None if companion is None else companion[-keep:], seasonal)
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
