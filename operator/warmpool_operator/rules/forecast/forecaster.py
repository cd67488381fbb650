"""A WarmModel's forecaster: candidates, periodic retraining, and the best recent performer.

Candidates are the LightGBM quantile model (once trained) and the baselines.  Every step,
:meth:`Forecaster.predict` first scores the forecasts made earlier for the steps now
observed, then asks every candidate for the horizons wanted, and uses the candidate with
the lowest recent quantile loss (:mod:`.evaluation`).  A forecaster's first prediction scores
the baselines on the history it is given, as if they had forecast its last ``eval_window``
steps (:meth:`Forecaster.backtest`): an operator restarted over a stored history picks the
baseline that fits it at once, not after ``min_scored`` live steps of last value (a pool at
zero would miss the next burst meanwhile).  Before any candidate has enough scores, and
whenever the history is too short for the others, it uses a baseline (last value): a short
history gives a baseline's forecast and a reason, never an error.
When the last few steps are all missing (the workers' request metrics are gone or garbage),
there is no forecast at all, and the reason says why: the caller scales reactively.

:meth:`Forecaster.maybe_train` (re)trains the model every ``retrain_every_steps`` steps,
or at once when the horizons change; the operator calls it from a background thread
(the model is swapped in whole, so a concurrent :meth:`predict` sees the old or the new).
CPU time of both is counted (``thread_time``) so its cost per WarmModel can be reported.

**What is forecast** (``ForecasterConfig.target``): by default each step's *peak*
(:meth:`~.history.History.peak_rates`: the step's busiest sub-step rate, as requests per step),
because capacity sized for a step's mean queues the bursts inside it; where a history holds no
peak the step's count stands in, so such a history forecasts exactly as with ``target="requests"``
(the step's count).  When the history holds peaks, the LightGBM model also gets the counts as
companion features.  Every candidate forecasts, and is scored on, the same target.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from warmpool_operator.rules.forecast import baselines
from warmpool_operator.rules.forecast.baselines import Baseline, BaselineConfig, QuantileForecast
from warmpool_operator.rules.forecast.evaluation import Scoreboard
from warmpool_operator.rules.forecast.features import FeatureConfig, FloatArray, Seasonal
from warmpool_operator.rules.forecast.history import MISSING, History
from warmpool_operator.rules.forecast.quantile_model import QuantileModel, QuantileModelConfig, train

LIGHTGBM = "lightgbm"
CANDIDATES = (LIGHTGBM, *(b.value for b in Baseline))
TARGET_PEAK = "peak"
TARGET_REQUESTS = "requests"
TARGETS = (TARGET_PEAK, TARGET_REQUESTS)


@dataclass(frozen=True)
class ForecasterConfig:
    features: FeatureConfig = field(default_factory=FeatureConfig)
    model: QuantileModelConfig = field(default_factory=QuantileModelConfig)
    baselines: BaselineConfig = field(default_factory=BaselineConfig)
    retrain_every_steps: int = 60
    eval_window: int = 60
    min_scored: int = 5
    fallback: Baseline = Baseline.LAST_VALUE
    #: This many missing steps in a row at the end (metrics gone or garbage) and there is no forecast:
    #: a forecast from stale steps would hold capacity for traffic nobody has seen; reactive scaling only.
    max_recent_missing_steps: int = 3
    use_model: bool = True  # False: baselines only (no LightGBM import, no training)
    only: str | None = None  # use this candidate whenever it can forecast (a benchmark's per-forecaster run)
    target: str = TARGET_PEAK  # what is forecast per step (see the module docstring)

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"unknown forecast target {self.target!r}; known: {', '.join(TARGETS)}")
        if self.only is not None and self.only not in CANDIDATES:
            raise ValueError(f"unknown forecaster {self.only!r}; known: {', '.join(CANDIDATES)}")
        if self.retrain_every_steps < 1:
            raise ValueError(f"retrain_every_steps must be >= 1, got {self.retrain_every_steps}")


@dataclass(frozen=True)
class Prediction:
    """What the forecaster says after the step ``last_step`` (requests per step, not per second: the
    step's peak or its count, as ``target`` says)."""

    last_step: int
    model: str | None  # the candidate used; None when nothing has been observed
    reason: str
    forecasts: tuple[QuantileForecast, ...]  # the used candidate's, one per horizon asked
    candidates: Mapping[str, tuple[QuantileForecast, ...]]
    recent_loss: float | None  # the used candidate's recent quantile loss, when scored
    target: str = TARGET_REQUESTS  # what was forecast (ForecasterConfig.target)

    @property
    def p90(self) -> float | None:
        """The highest p90 over the horizons asked (what capacity must be ready for)."""
        return max((f.p90 for f in self.forecasts), default=None)

    @property
    def p50(self) -> float | None:
        return max((f.p50 for f in self.forecasts), default=None)


class Forecaster:
    """Forecasts for one WarmModel; keep one per WarmModel, fed the same growing history."""

    def __init__(self, config: ForecasterConfig | None = None) -> None:
        self.config = config or ForecasterConfig()
        self.scoreboard = Scoreboard(window=self.config.eval_window, min_scored=self.config.min_scored)
        self.model: QuantileModel | None = None
        self.train_reason = "not trained yet"
        self.trainings = 0
        self.cpu_train_s = 0.0
        self.cpu_predict_s = 0.0
        self._scored_until: int | None = None
        self._last_train_attempt: int | None = None
        self._attempted_horizons: frozenset[int] = frozenset()

    def wants_model(self) -> bool:
        return self.config.use_model and self.config.only in (None, LIGHTGBM)

    def maybe_train(self, history: History, horizons: Sequence[int], seasonal: Seasonal | None = None) -> bool:
        """Retrain if due (every ``retrain_every_steps``, or the horizons changed); True if it trained.
        ``seasonal``: the history's coarse tier (:meth:`seasonal`), for the daily and weekly features."""
        if not self.wants_model() or not len(history):
            return False
        wanted = frozenset(horizons)
        series, companion = self.series(history)
        model = self.model
        due = (self._last_train_attempt is None or wanted != self._attempted_horizons
               or history.end - self._last_train_attempt >= self.config.retrain_every_steps
               or (model is None and history.end > self._last_train_attempt)
               # peaks began (or stopped) arriving: the model's features no longer match what it is given
               or (model is not None and model.features.companion != (companion is not None)))
        if not due:
            return False
        started = time.thread_time()
        outcome = train(series, history.start, wanted, self.config.features, self.config.model, companion, seasonal)
        self.cpu_train_s += time.thread_time() - started
        self._last_train_attempt, self._attempted_horizons = history.end, wanted
        self.train_reason = outcome.reason
        if outcome.model is None:
            return False
        self.model = outcome.model
        self.trainings += 1
        return True

    def predict(self, history: History, horizons: Sequence[int], seasonal: Seasonal | None = None) -> Prediction:
        """Score what is now observed, forecast each horizon, and pick the candidate to use."""
        started = time.thread_time()
        try:
            return self._predict(history, tuple(sorted(set(horizons))), seasonal)
        finally:
            self.cpu_predict_s += time.thread_time() - started

    def series(self, history: History) -> tuple[FloatArray, FloatArray | None]:
        """The series forecast (the configured target, NaN where missing) and the companion counts (only
        when the target is the peak and the history holds some peak: otherwise the two are the same)."""
        # Vectorised (History.rates and peak_rates, element by element, were most of a prediction's cost).
        counts = np.asarray(history.requests, dtype=np.float64)
        missing = counts == MISSING
        rates = np.where(missing, np.nan, counts)
        if self.config.target == TARGET_REQUESTS:
            return rates, None
        peaks = np.asarray(history.peak_requests, dtype=np.float64)
        known = peaks != MISSING
        peak_rates = np.where(missing, np.nan, np.where(known, np.maximum(counts, peaks), counts))
        return peak_rates, rates if bool(known.any()) else None

    def seasonal(self, coarse: History | None) -> Seasonal | None:
        """The forecast figure over ``coarse`` (a history's coarse tier), for the daily and weekly features."""
        if coarse is None or not len(coarse):
            return None
        return Seasonal(self.series(coarse)[0], coarse.start, coarse.limits.step_s)

    def update(self, history: History, horizons: Sequence[int], seasonal: Seasonal | None = None) -> Prediction:
        """:meth:`maybe_train` then :meth:`predict` on the calling thread (a benchmark's loop)."""
        self.maybe_train(history, horizons, seasonal)
        return self.predict(history, horizons, seasonal)

    def _predict(self, history: History, horizons: tuple[int, ...], seasonal: Seasonal | None = None) -> Prediction:
        if not horizons or min(horizons) < 1:
            raise ValueError(f"horizons must be >= 1 step, got {horizons}")
        series, companion = self.series(history)
        if self._scored_until is None:
            self.backtest(series, history.start, horizons)
        self._score(history, series)
        last_step = history.end - 1
        target = self.config.target
        if not np.any(~np.isnan(series)):
            return Prediction(last_step, None, "no observed steps yet", (), {}, None, target)
        missing = _trailing_missing(series)
        if missing >= self.config.max_recent_missing_steps:
            return Prediction(last_step, None, f"request metrics missing or unusable for the last {missing} steps: "
                              "no forecast (reactive scaling only)", (), {}, None, target)
        offered = self._candidates(series, history.start, horizons, companion, seasonal)
        for name, forecasts in offered.items():
            for forecast in forecasts:
                self.scoreboard.record(name, last_step + forecast.horizon, forecast)
        name, reason = self._choose(offered)
        loss = next((s.loss for s in self.scoreboard.standings() if s.candidate == name), None)
        return Prediction(last_step, name, reason, offered.get(name, ()), offered, loss, target)

    def backtest(self, series: FloatArray, first_step: int, horizons: tuple[int, ...]) -> None:
        """Record what each baseline would have forecast for the series' last ``eval_window`` steps
        (the next :meth:`_score` scores them).  Baselines only: they are cheap and need no training."""
        if self.config.only is not None:
            return  # one candidate asked for: nothing to choose between
        end = first_step + len(series)
        for made_after in range(max(first_step, end - self.config.eval_window - max(horizons)), end):
            past = series[:made_after - first_step + 1]
            for kind in Baseline:
                for horizon in horizons:
                    target = made_after + horizon
                    if not end - self.config.eval_window <= target < end:
                        continue
                    forecast = baselines.forecast(kind, past, horizon, self.config.baselines)
                    if forecast is not None:
                        self.scoreboard.record(kind.value, target, forecast)

    def _score(self, history: History, series: FloatArray) -> None:
        start = history.start if self._scored_until is None else max(self._scored_until, history.start)
        for step in range(start, history.end):
            value = float(series[step - history.start])
            self.scoreboard.observe(step, None if np.isnan(value) else value)
        self._scored_until = history.end
        self.scoreboard.drop_before(history.start)

    def _candidates(self, series: FloatArray, first_step: int, horizons: tuple[int, ...],
                    companion: FloatArray | None = None,
                    seasonal: Seasonal | None = None) -> dict[str, tuple[QuantileForecast, ...]]:
        offered: dict[str, tuple[QuantileForecast, ...]] = {}
        model = self.model  # one read: a background retrain may swap it
        if model is not None and self.wants_model():
            made = [model.predict(series, first_step, h, self.config.features.step_s, companion, seasonal)
                    for h in horizons]
            if all(f is not None for f in made):
                offered[LIGHTGBM] = tuple(f for f in made if f is not None)
        for kind in Baseline:
            made = [baselines.forecast(kind, series, h, self.config.baselines) for h in horizons]
            if all(f is not None for f in made):
                offered[kind.value] = tuple(f for f in made if f is not None)
        return offered

    def _choose(self, offered: Mapping[str, tuple[QuantileForecast, ...]]) -> tuple[str, str]:
        fallback = self.config.fallback.value
        only = self.config.only
        if only is not None:
            if only in offered:
                return only, f"{only} (the forecaster asked for)"
            why = self.train_reason if only == LIGHTGBM else "not enough history for it"
            return fallback, f"{only} cannot forecast yet ({why}): {fallback} meanwhile"
        standings = [s for s in self.scoreboard.standings() if s.candidate in offered]
        if standings:
            best = standings[0]
            others = ", ".join(f"{s.candidate} {s.loss:.3g}" for s in standings[1:])
            return best.candidate, (f"lowest recent quantile loss {best.loss:.3g} over {best.scored} steps"
                                    + (f" (then {others})" if others else ""))
        return fallback, f"no candidate scored on {self.config.min_scored} steps yet: {fallback}"


def _trailing_missing(series: FloatArray) -> int:
    observed = np.flatnonzero(~np.isnan(series))
    return len(series) - 1 - int(observed[-1]) if len(observed) else len(series)
