"""The live operator forecasts at the bursts' time scale: the step is read off the history's own
counts (rules/forecast/timescale.py, the one owner bench predict imports too), the stored history is
resampled to it, the horizon is in that step, and a lower forecast releases pods after a few of
those steps, not minutes."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest
from warmpool_operator.api.types import parse_spec
from warmpool_operator.control.forecasting import (
    CHOOSE_MIN_S,
    ForecastRunner,
    PoolForecast,
    choose_forecast_step,
    limits_for,
)
from warmpool_operator.io.kube import Kube
from warmpool_operator.rules.forecast.history import MISSING, History, HistoryLimits, StepObservation, resampled
from warmpool_operator.rules.forecast.timescale import choose_step_from_counts, steps_over

pytestmark = pytest.mark.unit

EPOCH_STEP = 340_000_000  # a 5 s step index on a whole hour


def bursty_history(step_s: int, burst_steps: int, every_steps: int, hours: float = 1.0,
                   per_step: int = 20) -> History:
    """``hours`` of ``step_s`` steps: a burst of ``burst_steps`` at ``per_step`` requests each, one every
    ``every_steps``, a stray request halfway between."""
    history = History(limits=limits_for(step_s))
    for k in range(int(hours * 3600 // step_s)):
        phase = k % every_steps
        count = per_step if phase < burst_steps else (1 if phase == every_steps // 2 else 0)
        history.record(EPOCH_STEP + k, StepObservation(requests=count))
    return history


@pytest.mark.parametrize(("burst_steps", "wanted"), [(4, 10), (8, 20), (2, 5), (24, 60)])
def test_a_5s_history_forecasts_at_half_its_typical_burst(burst_steps: int, wanted: int) -> None:
    history = bursty_history(5, burst_steps, every_steps=144)  # bursts of 20 s, 40 s, 10 s, 120 s every 12 min
    choice = choose_forecast_step(history)
    assert choice.step_s == wanted and choice.burst_p50_s == 5 * burst_steps, choice
    assert f"{wanted} s steps" in choice.reason


def test_a_60s_history_can_only_forecast_at_60s_and_a_short_one_at_its_own_step() -> None:
    assert steps_over(60) == (60,) and steps_over(5) == (5, 10, 15, 20, 30, 60) and steps_over(2) == (2, 10, 20, 30, 60)
    assert choose_forecast_step(bursty_history(60, 1, every_steps=4, hours=3)).step_s == 60
    short = bursty_history(5, 4, every_steps=48, hours=(CHOOSE_MIN_S - 5) / 3600)
    choice = choose_forecast_step(short)
    assert choice.step_s == 5 and "too little" in choice.reason
    steady = choose_step_from_counts([3] * 720, 5)
    assert steady.step_s == 60 and steady.bursts == 0 and "no bursts" in steady.reason
    # Unobserved steps are no burst and do not lower the mean rate.
    assert choose_step_from_counts([None] * 600 + [0, 0, 9, 9, 9, 9, 0, 0] * 15, 5).step_s == 10


def test_a_resampled_history_sums_whole_groups_and_a_missing_step_makes_its_group_missing() -> None:
    history = History(limits=HistoryLimits(step_s=5, retention_s=5 * 100), start=7)  # 7 is mid-group at 10 s
    for step, count, peak in [(7, 9, None), (8, 2, 6), (9, 4, None), (10, 1, None), (12, 3, None), (13, 5, 8)]:
        history.record(step, StepObservation(requests=count, prompt_tokens=10 * count, peak_requests=peak))
    history.record(14, StepObservation(requests=7))  # step 11 was never recorded: missing
    at10 = resampled(history, 10)
    assert at10.limits.step_s == 10 and at10.start == 4 and at10.end == 7  # groups 4, 5, 6; step 7's partial one out
    assert at10.requests == [6, MISSING, 8] and at10.prompt_tokens == [60, MISSING, 80]
    # A group's peak: the busiest 5 s step's rate (its peak, else its count) over the 10 s.
    assert at10.peak_requests == [2 * 6, MISSING, 2 * 8]
    assert resampled(history, 5) is history
    for bad in (3, 15 // 2, 7):
        with pytest.raises(ValueError, match="resamples only to a multiple"):
            resampled(history, bad)
    assert len(resampled(History(limits=HistoryLimits(step_s=5, retention_s=500), start=3, requests=[1]), 10)) == 0


class _NoKube:
    """The runner's history store is never used in these tests (the history is set by hand)."""


def _runner(history: History, executor: ThreadPoolExecutor) -> ForecastRunner:
    pokes: list[int] = []
    runner = ForecastRunner(cast(Kube, _NoKube()), {"metadata": {"name": "m", "namespace": "n", "uid": "u"}},
                            history.limits.step_s, executor, lambda: pokes.append(1))
    runner.history, runner.loaded = history, True
    # A still clock at the history's end: with the wall clock a pass that crossed a 5 s boundary closed
    # a step at today's index, years past the hand-made history, which then restarted from that one step.
    at_end = float(history.end * history.limits.step_s)
    runner.clock = lambda: at_end
    return runner


async def _settled(runner: ForecastRunner) -> None:
    for _ in range(200):  # bounded: 10 s at most
        if not runner._forecasting and runner.forecast is not None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no forecast within 10 s")


async def test_the_live_runner_forecasts_the_resampled_history_at_the_chosen_step() -> None:
    history = bursty_history(5, 4, every_steps=48)
    spec: Any = parse_spec({"model": {"pvc": {"claimName": "m"}},
                            "pool": {"replicas": 1, "minWarm": 0, "maxReplicas": 6,
                                     "predictive": {"enabled": True, "horizonSeconds": 7}}})
    with ThreadPoolExecutor(max_workers=1) as executor:
        runner = _runner(history, executor)
        runner.capacity.add(served=40.0, busy_seconds=10.0)  # 4 req/s per pod
        pool = PoolForecast(cast(Kube, _NoKube()), {}, 5, executor, lambda: None)
        pool.runner = runner
        runner._choose()
        assert runner.forecast_step_s == 10
        first = pool.step(spec, {}, [], cold_start_p95=None)  # asks for the horizons at 10 s steps
        assert runner.horizons == (1, 2)  # [now + 7 s, now + 17 s) at 10 s steps
        await _settled(runner)
        made = runner.forecast
        assert made is not None and made.step_s == 10 and made.prediction.last_step == history.end // 2 - 1
        out = pool.step(spec, {}, [], cold_start_p95=None)
        # stepSeconds is the history's resolution; the reason says the step forecast at, and why.
        assert out.forecast is not None and out.forecast.step_seconds == 5
        assert "bursts; a request's typical burst lasts 20 s (p90 20 s): 10 s steps" in str(out.forecast.reason)
        assert out.hold_s == 50.0  # five 10 s steps: pods go between 4-minute bursts, not after 5 minutes
        assert first.hold_s == 50.0
        # A 5 s step closing inside the 10 s one asks for no new forecast; the next 10 s one does.
        history.record(history.end, StepObservation(requests=0))
        runner._ask_forecast()
        assert not runner._forecasting
        history.record(history.end, StepObservation(requests=0))
        runner._ask_forecast()
        assert runner._forecasting
        await _settled(runner)
        assert runner.forecast.prediction.last_step == history.end // 2 - 1
        assert runner.current() is not None
        await runner.stop(save=False)


async def test_the_fast_loop_asks_for_the_last_seconds_arrivals_when_the_forecast_has_nothing_yet() -> None:
    from warmpool_operator.model import Sample
    from warmpool_operator.rules.forecast.fast_loop import fast_ask

    assert fast_ask(30.0, 1.0) == 3 and fast_ask(30.0, None) is None and fast_ask(0.0, 2.0) == 0
    assert fast_ask(10.0, 1.0, window_s=10.0) == 1  # exactly one pod's worth: one pod, not two
    spec: Any = parse_spec({"model": {"pvc": {"claimName": "m"}},
                            "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": 3,
                                     "predictive": {"enabled": True, "maxExtraReplicas": 1}}})
    now = [1000.0]
    with ThreadPoolExecutor(max_workers=1) as executor:
        runner = _runner(History(limits=limits_for(5)), executor)
        runner.clock = lambda: now[0]
        runner.capacity.add(served=40.0, busy_seconds=40.0)  # 1 req/s per pod
        pool = PoolForecast(cast(Kube, _NoKube()), {}, 5, executor, lambda: None)
        pool.runner = runner
        # Counters the pass reads: a baseline, then 50 requests in 8 s (6.25 req/s over the 10 s window).
        for at, total in ((1000.0, 0.0), (1004.0, 20.0), (1008.0, 50.0)):
            now[0] = at
            runner.accumulator.observe({"a": ("a", Sample(requests_total=total))}, at)
        assert runner.accumulator.arrivals_within(10.0, 1008.0) == 50.0
        assert runner.accumulator.arrivals_within(4.0, 1008.0) == 30.0  # the 20 at 1004 s are 4 s old
        out = pool.step(spec, {}, [], cold_start_p95=None)
        assert out.wanted == 3  # ⌈5 req/s ÷ 1⌉ = 5, held to maxReplicas 3 (a reactive ask: not maxExtraReplicas)
        assert out.forecast is not None and out.forecast.predicted_rate is None  # no forecast behind it
        assert "fast loop: 3 pods for 5 req/s over the last 10 s" in str(out.forecast.reason)
        # An autoscaler is the reactive loop: the operator's fast loop stays out of its way.
        hpa = {"metadata": {"managedFields": [{"manager": "kube-controller-manager", "subresource": "scale"}]}}
        assert pool.step(spec, hpa, [], cold_start_p95=None).wanted is None
        now[0] = 1100.0  # the burst is over: nothing in the window
        assert pool.step(spec, {}, [], cold_start_p95=None).wanted == 0
        await runner.stop(save=False)


def test_the_model_is_retrained_once_an_hour_at_any_step() -> None:
    from warmpool_operator.control.forecasting import forecaster_config

    # At 5 s steps, every 60 steps was twelve trainings an hour: most of the forecaster's CPU.
    assert {step: forecaster_config(step).retrain_every_steps for step in (5, 10, 60)} == {5: 720, 10: 360, 60: 60}


def test_a_default_operator_holds_its_history_at_the_shortest_step_its_scrapes_support() -> None:
    from warmpool_operator.app.cli import build_parser, config_from_args, config_warnings
    from warmpool_operator.settings import OperatorConfig, default_predict_step

    def configured(*flags: str) -> int:
        return config_from_args(build_parser().parse_args(["--namespace", "ns", *flags])).predict_step_seconds

    # Three scrapes a step (a step no scrape saw is missing, not zero): 30 s at the default 10 s scrape.
    assert OperatorConfig().predict_step_seconds == configured() == 30
    assert config_warnings(OperatorConfig().scrape_interval, 30) == []
    assert configured("--scrape-interval", "2") == 10 and configured("--scrape-interval", "3") == 10
    assert configured("--predict-step-seconds", "60") == 60 and configured("--scrape-interval", "30") == 90
    assert [default_predict_step(s) for s in (1, 5, 20)] == [5, 15, 60]
    # The fine steps keep 3.5 days; the coarse tier beside them four weeks (weekly features need two).
    limits = limits_for(30)
    assert limits.retention_s == 3.5 * 86400 and limits.coarse_step_s == 300 and limits.coarse_retention_s == 28 * 86400


async def test_a_default_operator_forecasts_30s_bursts_at_its_fine_step_not_a_minute() -> None:
    from warmpool_operator.settings import OperatorConfig

    step_s = OperatorConfig().predict_step_seconds
    history = bursty_history(step_s, burst_steps=1, every_steps=24, hours=2)  # a 30 s burst every 12 minutes
    spec: Any = parse_spec({"model": {"pvc": {"claimName": "m"}},
                            "pool": {"replicas": 1, "minWarm": 0, "maxReplicas": 6,
                                     "predictive": {"enabled": True, "horizonSeconds": 20}}})
    with ThreadPoolExecutor(max_workers=1) as executor:
        runner = _runner(history, executor)
        runner.capacity.add(served=40.0, busy_seconds=10.0)
        pool = PoolForecast(cast(Kube, _NoKube()), {}, step_s, executor, lambda: None)
        pool.runner = runner
        runner._choose()
        assert runner.forecast_step_s == 30 and "30 s steps" in runner.choice.reason
        pool.step(spec, {}, [], cold_start_p95=None)
        await _settled(runner)
        made = runner.forecast
        assert made is not None and made.step_s == 30 and made.prediction.last_step == history.end - 1
        out = pool.step(spec, {}, [], cold_start_p95=None)
        assert out.forecast is not None and out.forecast.step_seconds == 30
        assert out.hold_s == 150.0  # five 30 s steps, where a default operator held pods for five minutes
        await runner.stop(save=False)
