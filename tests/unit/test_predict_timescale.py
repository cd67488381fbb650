"""The forecast's step and horizon follow the data (operator/warmpool_operator/rules/forecast/timescale.py),
and the burst-scale predictive policy of `bench predict` (a fast reactive loop beside the forecast)
releases pods between bursts."""

from __future__ import annotations

import pytest
from warmpool_bench.predict_policies import BurstPredictive, FastLoopSettings, HpaSettings, Predictive, Reactive
from warmpool_bench.predict_sim import PoolConfig, ServiceModel, Simulation
from warmpool_bench.predict_trace import TraceRequest
from warmpool_operator.rules.forecast.decision import PredictiveSpec, horizons
from warmpool_operator.rules.forecast.forecaster import Forecaster, ForecasterConfig
from warmpool_operator.rules.forecast.history import History, HistoryLimits
from warmpool_operator.rules.forecast.timescale import bursts, choose_step

pytestmark = pytest.mark.unit

ONE_SECOND = ServiceModel(prefill_tokens_per_s=1000.0, decode_tokens_per_s=10.0)  # 500 + 5 tokens: 0.5 + 0.5 s
EPOCH = 1_700_000_040.0  # a whole minute


def _bursty(burst_s: float, every_s: float = 120.0, rate: float = 5.0, count: int = 20) -> list[float]:
    """``count`` bursts of ``burst_s`` at ``rate`` req/s, one every ``every_s``, one stray request between."""
    times = []
    for k in range(count):
        start = k * every_s
        times += [start + i / rate for i in range(int(burst_s * rate))]
        times.append(start + every_s / 2)
    return sorted(times)


@pytest.mark.parametrize(("burst_s", "step_s"), [(8.0, 5), (20.0, 10), (40.0, 20), (65.0, 30), (150.0, 60)])
def test_the_step_follows_the_bursts_in_the_trace(burst_s: float, step_s: int) -> None:
    times = _bursty(burst_s, every_s=max(120.0, 3 * burst_s))
    found = bursts(times)
    assert len(found) == 20 and {b.seconds for b in found} == {burst_s}
    choice = choose_step(times)
    assert choice.step_s == step_s and choice.burst_p50_s == burst_s
    assert f"{step_s} s steps" in choice.reason


def test_the_typical_burst_is_the_one_requests_arrive_in_not_the_many_one_second_blips() -> None:
    # 100 blips of 3 requests in one second, and 10 bursts of 20 s at 5 req/s (1000 requests): requests
    # mostly arrive in 20 s bursts, though most bursts by number are 1 s long.
    times = _bursty(20.0, every_s=300.0, count=10)
    times += [t for k in range(100) for t in (5000.0 + 30 * k, 5000.2 + 30 * k, 5000.4 + 30 * k)]
    choice = choose_step(sorted(times))
    assert choice.bursts == 110 and choice.burst_p50_s == 20.0 and choice.step_s == 10


def test_steady_traffic_has_no_bursts_and_keeps_the_longest_step() -> None:
    steady = [k + 0.5 for k in range(3600)]  # one request a second: no second at twice the mean
    choice = choose_step(steady)
    assert (choice.step_s, choice.bursts, choice.burst_p50_s) == (60, 0, None) and "no bursts" in choice.reason
    assert choose_step([0.0, 1000.0]).step_s == 60 and choose_step([]).bursts == 0


@pytest.mark.parametrize(("cold_p95_s", "step_s", "wanted"), [(7.0, 5, (2, 3)), (7.0, 10, (1, 2)),
                                                             (30.0, 10, (4,)), (45.0, 60, (1, 2))])
def test_the_horizon_covers_the_pools_p95_cold_start(cold_p95_s: float, step_s: int,
                                                     wanted: tuple[int, ...]) -> None:
    steps = horizons(cold_p95_s, step_s)
    assert steps == wanted
    assert (steps[0] - 1) * step_s <= cold_p95_s < steps[0] * step_s  # the step a pod asked now is warm in
    assert steps[-1] * step_s >= cold_p95_s + step_s  # and one step beyond it


def _burst_policy(requests: tuple[TraceRequest, ...], step_s: int, lead_s: float) -> BurstPredictive:
    observer = Predictive(Reactive(HpaSettings()), Forecaster(ForecasterConfig(use_model=False, only="last_value")),
                          PredictiveSpec(enabled=True, max_extra_replicas=20), requests, EPOCH, lead_s=lead_s,
                          history=History(limits=HistoryLimits(step_s=step_s, retention_s=step_s * 1000)))
    return BurstPredictive(observer, FastLoopSettings())


def test_the_fast_loop_answers_within_a_tick_and_pods_go_between_bursts() -> None:
    # Bursts of 10 s at 4 req/s every 120 s, 1 s per request: the fast loop asks within 5 s; between
    # bursts the pool goes back to zero (it holds a lead time and a step, not the HPA's 300 s).
    requests = tuple(TraceRequest(120.0 * m + k / 4, 500, 5) for m in range(5) for k in range(40))
    burst = _burst_policy(requests, step_s=10, lead_s=5.0)
    sim = Simulation(requests, ONE_SECOND, PoolConfig(0, 20, 5.0), burst)
    sim.run(end_s=requests[-1].t + 60)
    asked = {t: n for t, _, n in sim.pod_timeline}
    assert max(n for t, n in asked.items() if t <= 5.0) >= 2  # more than the activator's one pod in 5 s
    for m in range(1, 5):  # before each later burst the pool is empty again
        before = [n for t, n in asked.items() if t < 120.0 * m]
        assert before[-1] == 0
    reactive = Simulation(requests, ONE_SECOND, PoolConfig(0, 20, 5.0), Reactive(HpaSettings()))
    reactive.run(end_s=requests[-1].t + 60)
    held = {t: n for t, _, n in reactive.pod_timeline}
    assert all([n for t, n in held.items() if t < 120.0 * m][-1] > 0 for m in range(1, 5))  # the HPA holds on
    assert burst.observer.step_s == 10 and len(burst.observer.history) >= 50  # 10 s steps, recorded


def test_the_forecast_floor_raises_the_pool_ahead_of_a_burst_it_has_seen_coming() -> None:
    # A ramp at 10 s steps: 1, 2, 3 ... req/s for 10 s each.  Last value forecasts the step it saw,
    # so after the first steps the floor asks before the fast loop would (the forecast's ask counted).
    requests = tuple(TraceRequest(10.0 * s + k / (s + 1), 500, 5) for s in range(12) for k in range(10 * (s + 1)))
    burst = _burst_policy(requests, step_s=10, lead_s=5.0)
    Simulation(requests, ONE_SECOND, PoolConfig(0, 40, 5.0), burst).run(end_s=130.0)
    assert burst.observer.predictions and any(f.floor > 0 for f in burst.observer.forecasts)
    assert burst.asks > 0
