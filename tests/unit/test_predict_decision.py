"""The decision rule: ⌈p90 ÷ measured capacity⌉ within [minWarm, maxReplicas] and maxExtraReplicas above the
reactive count; no measured capacity, no action; lead time from the measured wake or cold-start p95; with an
autoscaler it is only a floor (and never ratchets)."""

from __future__ import annotations

import math

import pytest
from warmpool_operator.rules.forecast.decision import (
    DecisionInputs,
    LeadSource,
    PredictiveSpec,
    Target,
    decide,
    horizons,
    lead_time,
)

pytestmark = pytest.mark.unit


def _inputs(**changes: object) -> DecisionInputs:
    base: dict[str, object] = {"forecast_p90": 120.0, "step_s": 60, "capacity_rps": 1.0, "reactive_replicas": 1,
                               "min_warm": 1, "max_replicas": 10, "max_extra_replicas": 10,
                               "autoscaler_present": False}
    base.update(changes)
    return DecisionInputs(**base)  # type: ignore[arg-type]


def test_desired_is_the_ceiling_of_p90_over_capacity() -> None:
    assert decide(_inputs(forecast_p90=120.0)).replicas == 2  # 2 req/s at 1 req/s per pod
    assert decide(_inputs(forecast_p90=126.0)).replicas == 3  # 2.1 req/s
    assert decide(_inputs(forecast_p90=60.0 * 0.3 * 7, capacity_rps=0.3)).replicas == 7  # exact, despite floats
    decision = decide(_inputs(forecast_p90=240.0, capacity_rps=0.5))
    assert decision.predicted == 8 and decision.replicas == 8 and decision.acted
    assert "8 pods" in decision.reason and decision.target is Target.REPLICAS


def test_bounds_min_warm_max_replicas_and_max_extra() -> None:
    assert decide(_inputs(forecast_p90=0.0, min_warm=3, reactive_replicas=0)).replicas == 3
    held = decide(_inputs(forecast_p90=6000.0, max_replicas=10))
    assert held.predicted == 100 and held.replicas == 10 and "maxReplicas" in held.reason
    capped = decide(_inputs(forecast_p90=6000.0, reactive_replicas=3, max_extra_replicas=2))
    assert capped.replicas == 5 and "maxExtraReplicas" in capped.reason
    # Without an autoscaler, prediction never goes below what the reactive path asks for.
    kept = decide(_inputs(forecast_p90=60.0, reactive_replicas=4))
    assert kept.replicas == 4 and not kept.acted and "not more than the reactive 4" in kept.reason


@pytest.mark.parametrize("capacity", [None, 0.0, -1.0, math.nan, math.inf])
def test_unmeasured_capacity_sizes_nothing_but_a_forecast_request_still_asks_for_one_pod(
        capacity: float | None) -> None:
    decision = decide(_inputs(capacity_rps=capacity, reactive_replicas=3))
    assert decision.replicas == 3 and decision.predicted == 1 and not decision.acted  # never more than one pod
    assert "capacity not measured" in decision.reason and "one pod" in decision.reason
    floor = decide(_inputs(capacity_rps=capacity, reactive_replicas=3, autoscaler_present=True, min_warm=2))
    assert floor.replicas == 2 and floor.target is Target.FLOOR  # the autoscaler's floor is left at minWarm
    # A pool at zero (scale to zero after an operator restart: nothing served to measure) and a burst
    # forecast: one pod, ahead of it.
    from_zero = decide(_inputs(capacity_rps=capacity, reactive_replicas=0, min_warm=0, forecast_p90=6000.0))
    assert from_zero.replicas == 1 and from_zero.predicted == 1 and from_zero.acted
    # Less than one request forecast: nothing.
    quiet = decide(_inputs(capacity_rps=capacity, reactive_replicas=0, min_warm=0, forecast_p90=0.5))
    assert quiet.replicas == 0 and quiet.predicted is None and "no predictive action" in quiet.reason


@pytest.mark.parametrize("forecast", [None, math.nan, -5.0])
def test_no_usable_forecast_means_no_predictive_action(forecast: float | None) -> None:
    decision = decide(_inputs(forecast_p90=forecast, reactive_replicas=2))
    assert decision.replicas == 2 and not decision.acted and "no usable forecast" in decision.reason


def test_with_an_autoscaler_it_is_only_a_floor_and_never_ratchets() -> None:
    up = decide(_inputs(forecast_p90=300.0, reactive_replicas=2, autoscaler_present=True))
    assert up.target is Target.FLOOR and up.replicas == 5 and up.acted
    # The forecast falls while the autoscaler's own recommendation for the current rate is 2:
    # the floor falls with it (a floor of max(reactive, ...) would hold the pool where it is forever).
    down = decide(_inputs(forecast_p90=60.0, reactive_replicas=2, autoscaler_present=True))
    assert down.replicas == 1 and not down.acted
    assert "not more than the reactive 2" in down.reason


def test_lead_time_is_the_measured_wake_or_cold_start_p95() -> None:
    spec = PredictiveSpec(enabled=True, horizon_seconds=240)
    assert lead_time(spec, 40.0, 0.8, sleeping_pods=2) == lead_time(spec, 12.0, 0.8, sleeping_pods=1)
    assert lead_time(spec, 40.0, 0.8, sleeping_pods=2).source is LeadSource.WAKE
    assert lead_time(spec, 40.0, 0.8, sleeping_pods=2).seconds == 0.8
    cold = lead_time(spec, 40.0, 0.8, sleeping_pods=0)
    assert (cold.seconds, cold.source) == (40.0, LeadSource.COLD_START)
    unmeasured_wake = lead_time(spec, 40.0, None, sleeping_pods=3)
    assert (unmeasured_wake.seconds, unmeasured_wake.source) == (40.0, LeadSource.COLD_START)
    nothing = lead_time(spec, None, None, sleeping_pods=0)
    assert (nothing.seconds, nothing.source) == (240.0, LeadSource.HORIZON)
    assert lead_time(spec, math.nan, None, 0).source is LeadSource.HORIZON


def test_horizons_cover_one_step_starting_one_lead_time_ahead() -> None:
    assert horizons(0.0, 60) == (1,)
    assert horizons(5.0, 60) == (1, 2)  # [5 s, 65 s) touches the next step and the one after
    assert horizons(60.0, 60) == (2,)
    assert horizons(90.0, 60) == (2, 3)
    with pytest.raises(ValueError, match="lead"):
        horizons(-1.0, 60)


def test_spec_bounds() -> None:
    with pytest.raises(ValueError, match="maxExtraReplicas"):
        PredictiveSpec(max_extra_replicas=-1)
    with pytest.raises(ValueError, match="horizonSeconds"):
        PredictiveSpec(horizon_seconds=0)
