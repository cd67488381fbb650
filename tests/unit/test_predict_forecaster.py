"""The forecaster: a short history gets a baseline and a reason (never an error), a real LightGBM model is
trained on one thread and retrained on schedule, and the candidate used is the best recent performer."""

from __future__ import annotations

import math

import numpy as np
import pytest
from warmpool_operator.rules.forecast.features import FeatureConfig
from warmpool_operator.rules.forecast.forecaster import Forecaster, ForecasterConfig
from warmpool_operator.rules.forecast.history import History, StepObservation
from warmpool_operator.rules.forecast.quantile_model import QuantileModelConfig, train

from tests.support.series import as_series

pytestmark = pytest.mark.unit

STEP0 = 29_000_000


def _history(counts: list[int | None]) -> History:
    history = History()
    for offset, count in enumerate(counts):
        history.record(STEP0 + offset, None if count is None else StepObservation(requests=count))
    return history


def _sawtooth(steps: int) -> list[int | None]:
    return [(i % 6) * 10 for i in range(steps)]  # 0, 10, ..., 50, 0, ...: the lags say exactly what comes next


def test_no_history_is_no_forecast_with_a_reason_not_an_error() -> None:
    forecaster = Forecaster()
    for history in (History(), _history([None, None])):
        prediction = forecaster.update(history, (1, 2))
        assert prediction.model is None and prediction.forecasts == () and prediction.p90 is None
        assert prediction.reason == "no observed steps yet"


def test_short_history_gets_a_baseline() -> None:
    forecaster = Forecaster()
    prediction = forecaster.update(_history([7]), (1, 2))
    assert prediction.model == "last_value"
    assert "no candidate scored" in prediction.reason
    assert [f.horizon for f in prediction.forecasts] == [1, 2] and prediction.p90 == 7.0
    assert "lightgbm" not in prediction.candidates and "seasonal_naive" not in prediction.candidates
    assert forecaster.model is None and "training rows" in forecaster.train_reason


def test_asking_for_lightgbm_before_it_can_forecast_falls_back_and_says_why() -> None:
    forecaster = Forecaster(ForecasterConfig(only="lightgbm"))
    prediction = forecaster.update(_history([5] * 20), (1,))
    assert prediction.model == "last_value"
    assert prediction.reason.startswith("lightgbm cannot forecast yet") and "training rows" in prediction.reason
    with pytest.raises(ValueError, match="unknown forecaster"):
        ForecasterConfig(only="prophet")


def test_a_real_lightgbm_model_learns_p50_and_p90_of_a_pattern() -> None:
    series = as_series(_sawtooth(120))
    outcome = train(series, STEP0, (1,), FeatureConfig(), QuantileModelConfig())
    model = outcome.model
    assert model is not None, outcome.reason
    assert model.horizons == frozenset({1}) and model.trained_rows == 120 - 15
    assert set(model.boosters) == {(1, 0.5), (1, 0.9)}
    for end in range(100, 112):  # every phase of the pattern: the next value is known from the lags
        forecast = model.predict(series[:end], STEP0, 1, 60)
        assert forecast is not None
        actual = series[end]
        assert forecast.p50 == pytest.approx(actual, abs=8.0)
        # p90 must follow the pattern too: a p90 stuck at the label's 90th percentile (50 here)
        # is what LightGBM's default start (boost_from_average) gave before it was turned off.
        assert actual - 1.0 <= forecast.p90 <= actual + 8.0


def test_lightgbm_too_few_rows_is_no_model_and_the_reason() -> None:
    outcome = train(as_series([1.0] * 30), STEP0, (1, 2), FeatureConfig(), QuantileModelConfig())
    assert outcome.model is None and "fewer than the 24 needed" in outcome.reason


def test_retraining_follows_the_schedule_and_the_horizons() -> None:
    forecaster = Forecaster(ForecasterConfig(retrain_every_steps=20))
    counts = _sawtooth(100)
    history = History()
    trained_at = []
    for offset, count in enumerate(counts):
        history.record(STEP0 + offset, StepObservation(requests=int(count or 0)))
        if forecaster.maybe_train(history, (1,)):
            trained_at.append(offset)
    # first model as soon as 24 rows exist (n steps give n - 15 rows one step ahead: n = 39), then every 20
    assert trained_at == [38, 58, 78, 98]
    assert forecaster.trainings == 4 and forecaster.cpu_train_s > 0
    assert forecaster.maybe_train(history, (1, 2))  # new horizons: retrain at once
    assert forecaster.model is not None and forecaster.model.horizons == frozenset({1, 2})
    assert not forecaster.maybe_train(history, (1, 2))


def test_the_best_recent_performer_is_used_and_the_status_says_which() -> None:
    forecaster = Forecaster(ForecasterConfig(retrain_every_steps=30))
    history = History()
    prediction = None
    for offset, count in enumerate(_sawtooth(150)):
        history.record(STEP0 + offset, StepObservation(requests=int(count or 0)))
        prediction = forecaster.update(history, (1,))
    assert prediction is not None
    standings = forecaster.scoreboard.standings()
    assert standings[0].candidate == "lightgbm"  # the lags say it all; last value and EWMA cannot follow the drop
    assert prediction.model == "lightgbm" and prediction.reason.startswith("lowest recent quantile loss")
    assert prediction.recent_loss == pytest.approx(standings[0].loss)
    assert {"lightgbm", "last_value", "ewma"} <= set(prediction.candidates)
    assert forecaster.cpu_predict_s > 0


def test_baselines_only_never_imports_or_trains_lightgbm() -> None:
    forecaster = Forecaster(ForecasterConfig(use_model=False))
    history = _history(_sawtooth(80))
    prediction = forecaster.update(history, (1,))
    assert forecaster.trainings == 0 and forecaster.model is None
    assert prediction.model in {"last_value", "ewma"}


def test_missing_steps_are_not_scored_and_do_not_break_forecasts() -> None:
    counts: list[int | None] = [10] * 30 + [None, None] + [10] + [None, None] + [10] * 5
    forecaster = Forecaster()
    history = History()
    for offset, count in enumerate(counts):
        history.record(STEP0 + offset, None if count is None else StepObservation(requests=count))
        prediction = forecaster.update(history, (1,))
        assert prediction.p90 is not None and math.isfinite(prediction.p90)
    scored_steps = {step for losses in forecaster.scoreboard.losses.values() for step, _ in losses}
    assert not scored_steps & {STEP0 + 30, STEP0 + 31, STEP0 + 33, STEP0 + 34}
    assert np.isnan(as_series(history.rates())[33]) and history.rates()[32] == 10.0


def test_missing_or_garbage_metrics_mean_no_forecast_and_the_reason() -> None:
    forecaster = Forecaster()
    history = _history([10] * 30)
    assert forecaster.update(history, (1,)).p90 is not None
    history.record(history.end, None)
    history.record(history.end, None)
    assert forecaster.update(history, (1,)).p90 is not None  # two gaps: a scrape can fail
    history.record(history.end, None)
    prediction = forecaster.update(history, (1,))
    assert prediction.model is None and prediction.p90 is None and prediction.forecasts == ()
    assert "missing or unusable for the last 3 steps" in prediction.reason
    assert "reactive scaling only" in prediction.reason
    history.record(history.end, StepObservation(requests=10))  # metrics are back
    assert forecaster.update(history, (1,)).p90 is not None


def test_a_restart_from_the_stored_history_forecasts_as_the_running_one_would() -> None:
    from warmpool_operator.rules.forecast.history import dumps, loads

    history = _history([(i * 7) % 40 + (i // 10) for i in range(90)])
    running = Forecaster()
    running.maybe_train(history, (1, 2))
    before = running.predict(history, (1, 2))
    restarted = Forecaster()  # a new operator process: nothing in memory but what was stored
    restored = loads(dumps(history))
    restarted.maybe_train(restored, (1, 2))
    after = restarted.predict(restored, (1, 2))
    assert restarted.model is not None and running.model is not None
    assert after.candidates == before.candidates  # every baseline and the retrained LightGBM, exactly


def test_lightgbm_is_imported_only_when_a_model_is_trained() -> None:
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from warmpool_operator.rules.forecast.forecaster import Forecaster, ForecasterConfig\n"
        "from warmpool_operator.rules.forecast.history import History, StepObservation\n"
        "h = History()\n"
        "for i in range(60): h.record(29_000_000 + i, StepObservation(requests=i % 6))\n"
        "Forecaster(ForecasterConfig(use_model=False)).update(h, (1,))\n"
        "assert 'lightgbm' not in sys.modules, 'imported by the baselines'\n"
        "Forecaster().update(h, (1,))\n"
        "assert 'lightgbm' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
