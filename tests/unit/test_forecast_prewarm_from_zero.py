"""Pre-warm from zero, the parts a live operator relies on: a forecaster started over a
stored history scores the baselines on it at once (a restarted operator picks the one that fits, not
last value for its first steps), and with no capacity measured (a pool at zero has served nothing
since the operator started) a forecast burst still asks for one pod.  The live raise is
tests/integration/test_operator_prewarm_from_zero.py; waking sleepers before starting pods is
tests/unit/test_predict_wiring.py::test_the_forecast_wakes_sleeping_pods_first_and_keeps_them_awake."""

from __future__ import annotations

import pytest
from warmpool_operator.api.types import parse_spec
from warmpool_operator.control.forecasting import forecaster_config, limits_for
from warmpool_operator.rules import scaling
from warmpool_operator.rules.forecast.baselines import Baseline
from warmpool_operator.rules.forecast.forecaster import Forecaster
from warmpool_operator.rules.forecast.history import History, StepObservation

pytestmark = pytest.mark.unit

STEP_S = 10
DAY_STEPS = 86400 // STEP_S
BURST = 40  # requests in a burst step


def daily_history(burst_step: int, end: int) -> History:
    """Steps up to ``end`` (excluded) of a daily pattern: 20 s bursts every 2 min, none in the 2 min
    before ``burst_step``'s time of day, which starts one."""
    history = History(limits=limits_for(STEP_S))
    for step in range(end - history.limits.points, end):
        offset = (step - burst_step) % DAY_STEPS
        burst = offset % 12 in (0, 1) and offset < DAY_STEPS - 12
        history.record(step, StepObservation(requests=BURST if burst else 0))
    return history


def test_a_fresh_forecaster_over_a_stored_history_forecasts_the_burst_it_holds_yesterday() -> None:
    burst_step = 200_000_000
    history = daily_history(burst_step, end=burst_step - 1)  # the last step held: two before the burst
    forecaster = Forecaster(forecaster_config(STEP_S))
    made = forecaster.update(history, (2,))
    assert made.model == Baseline.SEASONAL_NAIVE.value, made.reason  # chosen on its first prediction
    assert "lowest recent quantile loss" in made.reason
    assert made.p90 == BURST  # the burst at step end - 1 + 2 = burst_step


def test_with_no_capacity_measured_a_burst_forecast_raises_a_pool_at_zero_to_one_pod() -> None:
    spec = parse_spec({"model": {"pvc": {"claimName": "m"}},
                       "pool": {"replicas": 1, "minWarm": 0, "maxReplicas": 3,
                                "scaleToZero": {"afterIdleSeconds": 60},
                                "predictive": {"enabled": True, "maxExtraReplicas": 2}}})
    made = scaling.predictive_decision(spec, float(BURST), STEP_S, None, autoscaler_present=False, at_zero=True)
    assert made.predicted == 1 and made.replicas == 1 and made.acted  # above the reactive count at zero: none
    assert "one pod, the least a request needs" in made.reason
    assert scaling.awake_wanted(spec, made) == 1
    assert scaling.with_prediction(spec, 0, made.predicted, at_zero=True) == 1
    assert scaling.with_prediction(spec, 0, None, at_zero=True) == 0
    # Out of zero the reactive count is spec.pool.replicas (1 here): the same forecast adds nothing.
    out = scaling.predictive_decision(spec, float(BURST), STEP_S, None, autoscaler_present=False)
    assert out.replicas == 1 and not out.acted
