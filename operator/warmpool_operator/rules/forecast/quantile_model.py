"""LightGBM quantile regression (p50 and p90) of a step's request count, one model per horizon.

Cost is bounded by construction: one thread (``num_threads=1``), at most ``rounds`` trees
of at most ``num_leaves`` leaves, at most ``max_rows`` training rows (the most recent).
The operator runs :func:`train` on a background thread; inference is a few hundred tree
walks.  ``lightgbm`` is imported inside :func:`train` so that importing this package
(and running every baseline) costs nothing when prediction is off.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from warmpool_operator.rules.forecast.baselines import QuantileForecast
from warmpool_operator.rules.forecast.features import (
    FeatureConfig,
    FeatureSet,
    FloatArray,
    Seasonal,
    feature_set,
    latest_row,
    training_rows,
)

QUANTILES = (0.5, 0.9)


@dataclass(frozen=True)
class QuantileModelConfig:
    rounds: int = 100
    num_leaves: int = 15
    learning_rate: float = 0.1
    min_child_samples: int = 5
    max_rows: int = 7 * 1440  # one retention's worth at 60 s
    min_rows: int = 24  # fewer and a tree model is fitting noise: stay with the baselines

    def params(self, alpha: float) -> dict[str, Any]:
        return {
            "objective": "quantile",
            "alpha": alpha,
            "num_leaves": self.num_leaves,
            "learning_rate": self.learning_rate,
            "min_child_samples": self.min_child_samples,
            # Starting from the label quantile can leave every gradient equal (all labels at or below
            # it): no split gains anything and the p90 model stays a constant.  Start from zero.
            "boost_from_average": False,
            "num_threads": 1,  # bounded CPU: one core at most, however many models
            "verbose": -1,
            "deterministic": True,
            "force_row_wise": True,
            "seed": 0,
        }


@dataclass
class QuantileModel:
    """Boosters keyed by (horizon, quantile), trained on ``features``."""

    features: FeatureSet
    boosters: dict[tuple[int, float], Any]
    trained_rows: int
    trained_end_step: int  # step index after the last step it was trained on

    @property
    def horizons(self) -> frozenset[int]:
        return frozenset(h for h, _ in self.boosters)

    def predict(self, series: FloatArray, first_step: int, horizon: int, step_s: int,
                companion: FloatArray | None = None, seasonal: Seasonal | None = None) -> QuantileForecast | None:
        """The forecast now; None when the model has no such horizon, or was trained with(out) a
        companion series and is now asked without (with) one, or with a seasonal one it is not given
        (one it was trained without is left out)."""
        if (horizon, QUANTILES[0]) not in self.boosters or self.features.companion != (companion is not None):
            return None
        if self.features.needs_seasonal and seasonal is None:
            return None
        row = latest_row(series, first_step, horizon, self.features, step_s, companion,
                         seasonal if self.features.needs_seasonal else None)
        if row is None:
            return None
        p50, p90 = (float(self.boosters[(horizon, q)].predict(row, num_threads=1)[0]) for q in QUANTILES)
        if not (math.isfinite(p50) and math.isfinite(p90)):
            return None
        p50 = max(0.0, p50)
        return QuantileForecast(horizon=horizon, p50=p50, p90=max(p50, p90))  # quantile models may cross


@dataclass(frozen=True)
class TrainOutcome:
    model: QuantileModel | None
    reason: str  # why there is no model, or what was trained


def train(series: FloatArray, first_step: int, horizons: Iterable[int], feature_config: FeatureConfig,
          config: QuantileModelConfig, companion: FloatArray | None = None,
          seasonal: Seasonal | None = None) -> TrainOutcome:
    """Train p50 and p90 models for each horizon on ``series`` (with ``companion``'s count_* features and
    ``seasonal``'s day_ago / week_ago when given); no model (with the reason) when too short."""
    features = feature_set(feature_config, int(np.count_nonzero(~np.isnan(series))), companion is not None, seasonal)
    used = seasonal if features.needs_seasonal else None
    data = {h: training_rows(series, first_step, h, features, feature_config.step_s, config.max_rows, companion, used)
            for h in sorted(set(horizons))}
    shortest = min((len(y) for _, y in data.values()), default=0)
    if shortest < config.min_rows:
        return TrainOutcome(None, f"{shortest} training rows, fewer than the {config.min_rows} needed")
    import lightgbm  # lazily: a few hundred ms of import, paid only when a model is trained

    boosters: dict[tuple[int, float], Any] = {}
    for horizon, (x, y) in data.items():
        dataset = lightgbm.Dataset(x, label=y, feature_name=list(features.names), free_raw_data=True,
                                   params={"verbose": -1, "num_threads": 1})
        for q in QUANTILES:
            boosters[(horizon, q)] = lightgbm.train(config.params(q), dataset, num_boost_round=config.rounds)
    model = QuantileModel(features=features, boosters=boosters, trained_rows=shortest,
                          trained_end_step=first_step + len(series))
    return TrainOutcome(model, f"trained on {shortest} rows, {len(features.names)} features")
