"""Honest baselines: last value, seasonal naive, EWMA, each with an empirical quantile band.

Each baseline makes a point forecast of the count at step ``end - 1 + horizon`` from
``series[:end]``.  Its p50/p90 are that point plus the 50th/90th percentile of its own recent
errors at the same horizon (actual minus forecast over the last ``residual_window`` origins
whose target is observed), so a baseline's band is as wide as it has recently been wrong,
and it competes with LightGBM's quantiles on the same pinball loss.  With fewer than
``MIN_RESIDUALS`` errors the band is the point itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from warmpool_operator.rules.forecast.features import FloatArray

MIN_RESIDUALS = 5


class Baseline(StrEnum):
    LAST_VALUE = "last_value"
    SEASONAL_NAIVE = "seasonal_naive"
    EWMA = "ewma"


@dataclass(frozen=True)
class QuantileForecast:
    """Forecast of the count in one step, ``horizon`` steps after the last observed one."""

    horizon: int
    p50: float
    p90: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.p50) and math.isfinite(self.p90) and 0 <= self.p50 <= self.p90):
            raise ValueError(f"need finite 0 <= p50 <= p90, got p50={self.p50} p90={self.p90}")


@dataclass(frozen=True)
class BaselineConfig:
    season_steps: int = 1440  # one day at 60 s
    ewma_alpha: float = 0.3
    residual_window: int = 120
    #: EWMA forgets all but (1 - alpha)^warmup of what came before its tail: compute it over a tail only.
    ewma_warmup_steps: int = 100


def point_forecasts(kind: Baseline, series: FloatArray, horizon: int, config: BaselineConfig) -> FloatArray:
    """``out[end]`` = the forecast made from ``series[:end]`` for step ``end - 1 + horizon`` (NaN: none).

    ``out`` has ``len(series) + 1`` entries; ``out[0]`` is always NaN (nothing observed).
    """
    n = len(series)
    out = np.full(n + 1, np.nan)
    if kind is Baseline.LAST_VALUE:
        out[1:] = _forward_fill(series)
    elif kind is Baseline.EWMA:
        out[1:] = _ewma(series, config.ewma_alpha)
    else:
        ends = np.arange(1, n + 1)
        source = ends - 1 + horizon - config.season_steps
        valid = (source >= 0) & (source < n)
        out[1:][valid] = series[source[valid]]
    return out


def forecast(kind: Baseline, series: FloatArray, horizon: int, config: BaselineConfig) -> QuantileForecast | None:
    """The baseline's forecast from the whole series, or None when it cannot make one."""
    keep = config.residual_window + horizon + (config.ewma_warmup_steps if kind is Baseline.EWMA else 0)
    if kind is Baseline.SEASONAL_NAIVE:
        keep += config.season_steps
    tail = series[-keep:]
    points = point_forecasts(kind, tail, horizon, config)
    point = points[-1]
    if not math.isfinite(point):
        return None
    n = len(tail)
    ends = np.arange(max(1, n - horizon - config.residual_window + 1), n - horizon + 1)
    residuals = tail[ends - 1 + horizon] - points[ends] if len(ends) else np.empty(0)
    residuals = residuals[np.isfinite(residuals)]
    if len(residuals) >= MIN_RESIDUALS:
        p50, p90 = point + float(np.quantile(residuals, 0.5)), point + float(np.quantile(residuals, 0.9))
    else:
        p50 = p90 = float(point)
    p50 = max(0.0, float(p50))
    return QuantileForecast(horizon=horizon, p50=p50, p90=max(p50, float(p90)))


def _forward_fill(series: FloatArray) -> FloatArray:
    index = np.where(np.isnan(series), 0, np.arange(len(series)))
    np.maximum.accumulate(index, out=index)
    filled = series[index]
    return np.asarray(filled, dtype=np.float64)


def _ewma(series: FloatArray, alpha: float) -> FloatArray:
    out = np.full(len(series), np.nan)
    level = math.nan
    for i, value in enumerate(series.tolist()):
        if not math.isnan(value):
            level = value if math.isnan(level) else alpha * value + (1 - alpha) * level
        out[i] = level
    return out
