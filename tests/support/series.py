"""Forecast series for tests: counts with gaps, as the forecaster's arrays hold them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from warmpool_operator.rules.forecast.features import FloatArray


def as_series(values: Sequence[float | None]) -> FloatArray:
    """Counts with None as NaN."""
    return np.array([math.nan if v is None else float(v) for v in values], dtype=np.float64)
