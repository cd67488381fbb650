"""Demand prediction wired into the operator (#16): history steps from the workers' counters
(deltas, resets, garbage, missing), the measured per-pod capacity, the scaling rule with a
forecast, waking before starting, the Predictive condition and status.forecast, the scrape of
the new series, the API's new fields and the worker's learned warm-up lengths."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from warmpool_operator.api.types import InvalidWarmModel, parse_spec
from warmpool_operator.control.forecasting import copy_history, forecaster_config, limits_for
from warmpool_operator.io.worker_metrics import parse_metrics
from warmpool_operator.model import Sample, Target
from warmpool_operator.rules import builders, scaling
from warmpool_operator.rules.builders import CONFIG_MOUNT_PATH, CONFIGMAP_KEY_LEARNED_BUCKETS
from warmpool_operator.rules.forecast import report as ps
from warmpool_operator.rules.forecast.baselines import QuantileForecast
from warmpool_operator.rules.forecast.decision import LeadSource, LeadTime
from warmpool_operator.rules.forecast.decision import Target as DecisionTarget
from warmpool_operator.rules.forecast.forecaster import Prediction
from warmpool_operator.rules.forecast.history import History
from warmpool_operator.rules.forecast.lengths import BIN_COUNT, bin_index
from warmpool_operator.rules.forecast.steps import (
    PROMPT_BOUNDS,
    CapacityMeter,
    StepAccumulator,
    counter_delta,
    prompt_bins,
)
from warmpool_operator.rules.sleep_wake import WHY_FORECAST, Policy, SleepPod, plan
from warmpool_worker.warmup import read_learned_buckets

from warmpool.contract.files import LEARNED_BUCKETS_FORMAT, TOKEN_LENGTH_EDGES
from warmpool.contract.metrics import METRIC_ENGINE_BUSY_SECONDS, METRIC_REQUEST_PROMPT_TOKENS, METRIC_REQUESTS_TOTAL

pytestmark = pytest.mark.unit

STEP = 10


def sample(requests: float | None, *, served: float | None = None, busy: float | None = None,
           lengths: dict[int, float] | None = None) -> Sample:
    """A worker's sample with these cumulative counters (``lengths``: prompt length -> requests)."""
    buckets: dict[float, float] = {}
    if lengths is not None:
        running = 0.0
        per_bin = [0.0] * BIN_COUNT
        for length, count in lengths.items():
            per_bin[bin_index(length)] += count
        for bound, count in zip(PROMPT_BOUNDS, per_bin, strict=True):
            running += count
            buckets[bound] = running
    return Sample(requests_total=requests, prompt_count=served, busy_seconds=busy, prompt_buckets=buckets)


def feed(acc: StepAccumulator, at: float, **pods: Sample | None) -> list[Any]:
    return acc.observe({uid: (uid, s) for uid, s in pods.items()}, at)


# --------------------------------------------------------------------------- history steps from counters


def test_steps_are_deltas_summed_over_pods_and_the_first_step_is_missing() -> None:
    acc = StepAccumulator(STEP)
    assert feed(acc, 5.0, a=sample(1000.0), b=sample(50.0)) == []  # baselines: totals from before we watched
    closed = feed(acc, 12.0, a=sample(1004.0), b=sample(51.0))
    assert [c.step for c in closed] == [0] and closed[0].observation is None  # the partial first step:
    assert closed[0].problem is None  # missing, and no fault of the metrics
    feed(acc, 15.0, a=sample(1010.0), b=sample(53.0))
    closed = feed(acc, 21.0, a=sample(1010.0), b=sample(53.0))
    assert closed[0].step == 1 and closed[0].observation is not None
    assert closed[0].observation.requests == (1010 - 1000) + (53 - 50)
    # A step with no traffic is a real zero, not missing.
    closed = feed(acc, 31.0, a=sample(1010.0), b=sample(53.0))
    assert closed[0].observation is not None and closed[0].observation.requests == 0


def test_a_step_records_its_busiest_sub_step_scaled_to_the_step() -> None:
    acc = StepAccumulator(60)  # 60 s steps: six 10 s sub-steps
    feed(acc, 5.0, a=sample(0.0), b=sample(0.0))  # baselines in the partial first step
    feed(acc, 61.0, a=sample(0.0), b=sample(0.0))
    # Scraped every 10 s: a burst of 9 (7 + 2 over the two pods) in one 10 s sub-step, 1 in another.
    feed(acc, 71.0, a=sample(7.0), b=sample(2.0))
    feed(acc, 81.0, a=sample(8.0), b=sample(2.0))
    closed = feed(acc, 121.0, a=sample(8.0), b=sample(2.0))
    observation = closed[0].observation
    assert observation is not None and observation.requests == 10
    assert observation.peak_requests == 9 * 6  # the busiest 10 s at that pace for the whole step
    # Scraped every 30 s: a 30 s delta is a 30 s sub-step, not a 10 s one (no tripled peak).
    feed(acc, 151.0, a=sample(14.0), b=sample(2.0))
    closed = feed(acc, 181.0, a=sample(14.0), b=sample(2.0))
    observation = closed[0].observation
    assert observation is not None and observation.requests == 6 and observation.peak_requests == 6 * 2


def test_the_same_sample_seen_by_two_passes_counts_once() -> None:
    acc = StepAccumulator(STEP)
    first, second = sample(10.0), sample(14.0)
    feed(acc, 1.0, a=first)
    feed(acc, 11.0, a=second)
    feed(acc, 12.0, a=second)  # a pass on an event: no new scrape
    closed = feed(acc, 21.0, a=second)
    assert closed[0].observation is not None and closed[0].observation.requests == 4


def test_a_counter_reset_counts_from_zero() -> None:
    acc = StepAccumulator(STEP)
    feed(acc, 1.0, a=sample(500.0, served=500.0, busy=50.0, lengths={100: 500}))
    feed(acc, 11.0, a=sample(510.0, served=510.0, busy=51.0, lengths={100: 510}))
    # The worker restarted: every counter starts again from zero, and 3 requests came since.
    feed(acc, 15.0, a=sample(3.0, served=3.0, busy=0.3, lengths={2000: 3}))
    closed = feed(acc, 21.0, a=sample(3.0, served=3.0, busy=0.3, lengths={2000: 3}))
    observation = closed[0].observation
    assert observation is not None and observation.requests == 10 + 3
    assert observation.prompt_lengths[bin_index(100)] == 10 and observation.prompt_lengths[bin_index(2000)] == 3
    assert closed[0].served == pytest.approx(13.0) and closed[0].busy_seconds == pytest.approx(1.3)
    assert counter_delta(10.0, 4.0) == 4.0 and counter_delta(4.0, 10.0) == 6.0 and counter_delta(None, 1.0) is None


def test_a_step_at_zero_with_no_pod_is_a_zero_and_any_other_pass_makes_it_missing() -> None:
    """A pool at zero keeps a history (and so a forecast, which may raise it ahead of a burst)."""
    acc = StepAccumulator(STEP)
    acc.observe({}, 1.0, at_zero=True)  # the partial first step: missing whatever it saw
    closed = acc.observe({}, 11.0, at_zero=True)
    assert closed[0].step == 0 and closed[0].observation is None and closed[0].problem is None
    acc.observe({}, 15.0, at_zero=True)
    closed = acc.observe({}, 21.0, at_zero=True)
    assert closed[0].step == 1 and closed[0].observation is not None and closed[0].observation.requests == 0
    assert closed[0].problem is None
    # One pass of the step not at zero (the pool just left it, its pod not running yet): missing.
    acc.observe({}, 25.0, at_zero=False)
    closed = acc.observe({}, 31.0, at_zero=True)
    assert closed[0].step == 2 and closed[0].observation is None and closed[0].problem
    # At zero with its pods still running (settling): they are counted as usual.
    acc.observe({"a": ("a", sample(7.0))}, 35.0, at_zero=True)
    acc.observe({"a": ("a", sample(9.0))}, 38.0, at_zero=True)
    closed = acc.observe({}, 41.0, at_zero=True)
    assert closed[0].step == 3 and closed[0].observation is not None and closed[0].observation.requests == 2


def test_missing_or_garbage_request_metrics_make_a_missing_step_that_says_why() -> None:
    acc = StepAccumulator(STEP)
    feed(acc, 1.0, a=sample(None), b=Sample(error="garbage: no warmpool metrics in the body"), c=None)
    feed(acc, 11.0, a=sample(None), b=Sample(error="timeout"), c=None)
    closed = feed(acc, 21.0, a=sample(None), b=Sample(error="timeout"), c=None)
    assert closed[0].observation is None
    assert closed[0].problem == ("a: no warmpool_requests_total; b: metrics unreadable (timeout); "
                                 "c: no metrics read from it")
    # A counter that jumps beyond any engine's rate is garbage: dropped, and the pod re-baselined.
    acc = StepAccumulator(STEP)
    feed(acc, 1.0, a=sample(10.0))
    feed(acc, 11.0, a=sample(10.0))
    feed(acc, 15.0, a=sample(1e15))
    feed(acc, 17.0, a=sample(1e15 + 2))
    closed = feed(acc, 21.0, a=sample(1e15 + 2))
    assert closed[0].observation is not None and closed[0].observation.requests == 2
    assert "garbage" in (closed[0].problem or "")


def test_a_prompt_histogram_with_other_bounds_or_falling_counts_is_not_used() -> None:
    good = sample(1.0, lengths={100: 2, 5000: 1}).prompt_buckets
    bins = prompt_bins(good)
    assert bins is not None and sum(bins) == 3 and bins[bin_index(5000)] == 1
    assert prompt_bins({16.0: 1.0, math.inf: 2.0}) is None  # not the contract's bounds
    falling = dict(good)
    falling[math.inf] = 0.0
    assert prompt_bins(falling) is None
    acc = StepAccumulator(STEP)
    feed(acc, 1.0, a=Sample(requests_total=0.0, prompt_buckets={16.0: 1.0, math.inf: 1.0}))
    feed(acc, 11.0, a=Sample(requests_total=0.0, prompt_buckets={16.0: 1.0, math.inf: 1.0}))
    later = Sample(requests_total=5.0, prompt_buckets={16.0: 3.0, math.inf: 5.0})
    feed(acc, 15.0, a=later)
    closed = feed(acc, 21.0, a=later)
    assert closed[0].observation is not None and closed[0].observation.requests == 5
    assert closed[0].observation.prompt_lengths == ()  # lengths unknown, the count still holds


def test_steps_go_into_the_history_and_a_gap_is_held_as_missing() -> None:
    history = History(limits=limits_for(STEP))
    acc = StepAccumulator(STEP)
    feed(acc, 1.0, a=sample(0.0))
    for at, total in ((11.0, 4.0), (21.0, 9.0), (51.0, 12.0)):
        for closed in feed(acc, at, a=sample(total)):
            history.record(closed.step, closed.observation)
    # steps 0 (partial: missing), 1 (4 requests), 2 (5: closed at 51 s), then 3 and 4 had no pass: missing
    assert history.rates()[:3] == [None, 4.0, 5.0]
    copy = copy_history(history)
    history.record(history.end, None)
    assert len(copy) == len(history) - 1  # the forecasting thread's copy does not move


def test_capacity_is_served_over_busy_seconds_and_idle_steps_keep_the_last_figure() -> None:
    meter = CapacityMeter(window=3)
    assert meter.capacity_rps() is None
    meter.add(2.0, 0.2)
    assert meter.capacity_rps() is None  # too little work seen to mean anything
    meter.add(8.0, 1.8)
    assert meter.capacity_rps() == pytest.approx(10.0 / 2.0)
    for _ in range(10):
        meter.add(0.0, 0.0)  # idle: no news
    assert meter.capacity_rps() == pytest.approx(5.0)
    for _ in range(3):
        meter.add(4.0, 2.0)
    assert meter.capacity_rps() == pytest.approx(2.0)  # the window holds the newest busy steps only


def test_step_lengths_scale_with_the_step() -> None:
    config = forecaster_config(2)
    assert config.features.step_s == 2 and config.baselines.season_steps == 43200
    assert limits_for(60).retention_s == 7 * 86400 and limits_for(2).points == limits_for(60).points


# --------------------------------------------------------------------------- the scaling rule


def spec(**pool: Any) -> Any:
    return parse_spec({"model": {"pvc": {"claimName": "m"}}, "pool": {"replicas": 1, "minWarm": 1,
                                                                      "maxReplicas": 6, **pool}})


def test_the_forecast_raises_the_pool_to_p90_over_capacity_within_the_bounds() -> None:
    wm = spec(predictive={"enabled": True, "maxExtraReplicas": 2})
    # p90 of 240 requests per 60 s step = 4 req/s; a pod serves 1.5 req/s while busy -> 3 pods.
    decision = scaling.predictive_decision(wm, 240.0, 60, 1.5, autoscaler_present=False)
    assert decision.predicted == 3 and decision.acted and decision.target is DecisionTarget.REPLICAS
    assert scaling.with_prediction(wm, 0, decision.replicas) == 3
    assert scaling.awake_wanted(wm, decision) == 3
    # maxExtraReplicas holds it to replicas + 2.
    big = scaling.predictive_decision(wm, 6000.0, 60, 1.5, autoscaler_present=False)
    assert big.predicted == 67 and scaling.with_prediction(wm, 0, big.replicas) == 3
    assert scaling.awake_wanted(wm, big) == 3
    # Never below the reactive count (replicas, minWarm, the pods added while not yet warm).
    low = scaling.predictive_decision(wm, 1.0, 60, 1.5, autoscaler_present=False)
    assert not low.acted and scaling.with_prediction(wm, 2, low.replicas) == 3
    # No forecast or no measured capacity: the reactive count, exactly.
    assert scaling.predictive_decision(wm, None, 60, 1.5, False).predicted is None
    assert scaling.predictive_decision(wm, 240.0, 60, None, False).replicas == 1  # one pod at most, unmeasured
    assert scaling.with_prediction(wm, 1, None) == scaling.desired_replicas(wm, 1) == 2


def test_within_max_replicas() -> None:
    wm = spec(replicas=2, maxReplicas=3, predictive={"enabled": True, "maxExtraReplicas": 5})
    decision = scaling.predictive_decision(wm, 600.0, 60, 1.0, autoscaler_present=False)
    assert scaling.with_prediction(wm, 0, decision.replicas) == 3 and scaling.awake_wanted(wm, decision) == 3


def test_with_an_autoscaler_it_is_a_floor_under_its_count() -> None:
    wm = spec(replicas=4, predictive={"enabled": True})  # the HPA asked for 4
    low = scaling.predictive_decision(wm, 60.0, 60, 1.0, autoscaler_present=True)
    assert low.target is DecisionTarget.FLOOR and not low.acted
    assert scaling.with_prediction(wm, 0, low.replicas) == 4  # the HPA's count stands
    high = scaling.predictive_decision(wm, 300.0, 60, 1.0, autoscaler_present=True)
    assert high.acted and scaling.with_prediction(wm, 0, high.replicas) == 5
    hpa = {"metadata": {"managedFields": [{"manager": "kube-controller-manager", "subresource": "scale"}]}}
    by_hand = {"metadata": {"managedFields": [{"manager": "kubectl", "subresource": "scale"},
                                              {"manager": "kube-controller-manager", "operation": "Update"}]}}
    assert scaling.autoscaled(hpa) and not scaling.autoscaled(by_hand) and not scaling.autoscaled({})


def test_a_lower_forecast_lowers_the_pool_only_after_the_hold() -> None:
    held = scaling.held(None, 3, now=0.0, hold_s=10.0)
    assert held == (3, 0.0)
    assert scaling.held(held, 4, now=1.0, hold_s=10.0) == (4, 1.0)  # up: at once
    assert scaling.held((4, 1.0), 2, now=5.0, hold_s=10.0) == (4, 1.0)  # down: held
    assert scaling.held((4, 1.0), 4, now=6.0, hold_s=10.0) == (4, 6.0)  # asked again: the hold restarts
    assert scaling.held((4, 6.0), 2, now=17.0, hold_s=10.0) == (2, 17.0)  # down once the hold has passed
    assert scaling.held((2, 17.0), None, now=20.0, hold_s=10.0) == (2, 17.0)  # no forecast: held too
    assert scaling.held((2, 17.0), None, now=28.0, hold_s=10.0) is None  # then the reactive count alone


def pod(name: str, level: int) -> SleepPod:
    return SleepPod(uid=name, name=name, node="n", serving=True, level=level, capable=True,
                    idle_seconds=1000.0, in_flight=0.0, labelled_awake=level == 0, busy=False)


def test_the_forecast_wakes_sleeping_pods_first_and_keeps_them_awake() -> None:
    policy = Policy(enabled=True, after_idle_seconds=30, min_awake=1)
    pods = [pod("a", 0), pod("b", 1), pod("c", 2)]
    made = plan(pods, policy, awake_wanted=3)
    assert [a.uid for a in made.wake] == ["b", "c"] and all(a.why == WHY_FORECAST for a in made.wake)
    # Idle pods the forecast needs awake do not sleep.
    awake = [pod("a", 0), pod("b", 0), pod("c", 0)]
    assert [a.uid for a in plan(awake, policy).sleep] == ["a", "b"]
    assert [a.uid for a in plan(awake, policy, awake_wanted=2).sleep] == ["a"]
    assert plan(awake, policy, awake_wanted=3).sleep == ()


# --------------------------------------------------------------------------- status


def prediction(model: str | None, p90: float = 120.0, loss: float | None = 3.0) -> Prediction:
    forecasts = () if model is None else (QuantileForecast(horizon=2, p50=p90 / 2, p90=p90),)
    return Prediction(9, model, "request metrics missing or unusable for the last 3 steps" if model is None
                      else "lowest recent quantile loss", forecasts, {}, loss)


LEAD = LeadTime(25.0, LeadSource.COLD_START)


def test_the_predictive_condition_says_why_the_pool_is_reactive() -> None:
    wm = spec(predictive={"enabled": True})
    common: dict[str, Any] = {"lead": LEAD, "step_s": 60, "history_steps": 10, "last_count": 60,
                              "last_problem": "pod-a: no warmpool_requests_total"}
    missing = ps.report(enabled=True, loaded=True, prediction=prediction(None), decision=None, capacity_rps=1.0,
                        **common)
    assert (missing.verdict.status, missing.verdict.reason) == ("False", ps.REASON_REQUEST_METRICS_UNAVAILABLE)
    assert "no warmpool_requests_total" in missing.verdict.message
    loading = ps.report(enabled=True, loaded=False, prediction=None, decision=None, capacity_rps=None, **common)
    assert loading.verdict.reason == ps.REASON_HISTORY_LOADING
    # Missing steps with nothing wrong with the metrics (the first, partial step; the operator was down):
    # no forecast yet, not a metrics fault.
    starting = ps.report(enabled=True, loaded=True, prediction=prediction(None), decision=None, capacity_rps=1.0,
                         **{**common, "last_problem": None})
    assert (starting.verdict.status, starting.verdict.reason) == ("False", ps.REASON_NO_FORECAST_YET)
    unmeasured = ps.report(enabled=True, loaded=True, prediction=prediction("ewma"), decision=None,
                           capacity_rps=None, **common)
    assert unmeasured.verdict.reason == ps.REASON_CAPACITY_NOT_MEASURED
    decision = scaling.predictive_decision(wm, 120.0, 60, 0.5, autoscaler_present=False)
    acting = ps.report(enabled=True, loaded=True, prediction=prediction("ewma"), decision=decision,
                       capacity_rps=0.5, **common)
    assert (acting.verdict.status, acting.verdict.reason) == ("True", ps.REASON_PRE_WARMING)
    figures = acting.forecast
    assert figures.rate_now == 1.0 and figures.predicted_rate == 2.0 and figures.model == "ewma"
    assert figures.lead_time_source == "cold_start_p95" and figures.horizon_seconds == 25.0
    assert figures.desired_replicas == 4 and figures.recent_error == 3.0 and figures.capacity_per_pod == 0.5
    shadow = ps.report(enabled=False, loaded=True, prediction=prediction("ewma"), decision=decision,
                       capacity_rps=0.5, **common)
    assert (shadow.verdict.status, shadow.verdict.reason) == ("False", ps.REASON_SHADOW)


# --------------------------------------------------------------------------- scrape, API, worker


def test_scrape_reads_the_prompt_histogram_and_busy_seconds() -> None:
    lines = [f"{METRIC_REQUESTS_TOTAL} 7"]
    running = 0
    for edge in TOKEN_LENGTH_EDGES:
        running += 1 if edge in (128, 2048) else 0
        lines.append(f'{METRIC_REQUEST_PROMPT_TOKENS}_bucket{{le="{float(edge)}"}} {running}')
    lines += [f'{METRIC_REQUEST_PROMPT_TOKENS}_bucket{{le="+Inf"}} 2',
              f"{METRIC_REQUEST_PROMPT_TOKENS}_count 2", f"{METRIC_REQUEST_PROMPT_TOKENS}_sum 1500",
              f"{METRIC_ENGINE_BUSY_SECONDS} 0.75"]
    parsed = parse_metrics("\n".join(lines) + "\n")
    assert parsed.ok and parsed.requests_total == 7 and parsed.prompt_count == 2 and parsed.busy_seconds == 0.75
    bins = prompt_bins(parsed.prompt_buckets)
    assert bins is not None and bins[bin_index(128)] == 1 and bins[bin_index(2048)] == 1
    assert parse_metrics(f"{METRIC_REQUESTS_TOTAL} 1\n{METRIC_ENGINE_BUSY_SECONDS} NaN\n"
                         ).busy_seconds is None


def test_the_api_takes_the_predictive_block_and_learn_buckets_with_bounds() -> None:
    parsed = spec(predictive={"enabled": True, "horizonSeconds": 120, "maxExtraReplicas": 0})
    assert parsed.pool.predictive is not None and parsed.pool.predictive.horizon_seconds == 120
    assert spec().pool.predictive is None
    for bad in ({"horizonSeconds": 0}, {"maxExtraReplicas": -1}, {"enabled": "yes"}):
        with pytest.raises(InvalidWarmModel, match="predictive"):
            spec(predictive=bad)
    learn = parse_spec({"model": {"pvc": {"claimName": "m"}}, "warmup": {"learnBuckets": True}})
    args = builders.build_deployment(Target("m", "ns", learn), 1)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--learned-buckets={CONFIG_MOUNT_PATH}/{CONFIGMAP_KEY_LEARNED_BUCKETS}" in args
    plain = builders.build_deployment(Target("m", "ns", spec()), 1)["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--learned-buckets") for a in plain["args"])


def test_the_worker_warms_at_learned_lengths_only_from_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / CONFIGMAP_KEY_LEARNED_BUCKETS
    assert read_learned_buckets(None) is None and read_learned_buckets(path) is None  # not learned yet
    path.write_text(json.dumps({"format": LEARNED_BUCKETS_FORMAT, "buckets": [6144, 1536, 12288]}))
    assert read_learned_buckets(path) == (1536, 6144, 12288)
    for bad in ("{", json.dumps({"format": "other", "buckets": [1]}),
                json.dumps({"format": LEARNED_BUCKETS_FORMAT, "buckets": [0]}),
                json.dumps({"format": LEARNED_BUCKETS_FORMAT, "buckets": ["32"]}), "x" * 10000):
        path.write_text(bad)
        assert read_learned_buckets(path) is None  # --buckets stands; never a pod that cannot warm


def test_status_forecast_says_what_the_policy_expects_next_and_why() -> None:
    wm = spec(predictive={"enabled": True})
    decision = scaling.predictive_decision(wm, 120.0, 60, 0.5, autoscaler_present=False)
    common: dict[str, Any] = {"enabled": True, "loaded": True, "prediction": prediction("ewma"), "step_s": 60,
                              "history_steps": 10, "last_count": 60, "last_problem": None}
    reason = ps.report(decision=decision, lead=LEAD, capacity_rps=0.5, **common).forecast.reason
    assert reason is not None
    # the forecast (p90 and p50, per second), for which seconds ahead, the lead time and where it comes
    # from, the capacity per pod and the pods that makes, before the forecaster's and decision's words
    assert reason.startswith("expects up to 2 req/s (p90; p50 1) 25-85 s ahead, the lead time being a new "
                             "pod's p95 cold start (25 s); at 0.5 req/s per pod that is 4 pods; ewma: ")
    waking = ps.report(decision=decision, lead=LeadTime(0.4, LeadSource.WAKE), capacity_rps=0.5, **common)
    assert "0.4-60.4 s ahead, the lead time being a sleeping pod's p95 wake (0.4 s)" in str(waking.forecast.reason)
    unmeasured = ps.report(decision=None, lead=LEAD, capacity_rps=None, **common).forecast.reason
    assert "per-pod capacity not measured yet" in str(unmeasured)
