"""The replay simulator and the policies: the queueing model's arithmetic, how pods come and go, the HPA's
delays, and on a synthetic ramp the predictive pool is warm before the peak while the reactive one is not."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from warmpool_bench.predict_policies import HpaSettings, NoPrewarm, Predictive, Reactive
from warmpool_bench.predict_sim import PoolConfig, ServiceModel, Simulation
from warmpool_bench.predict_trace import TraceRequest
from warmpool_operator.predict.decision import PredictiveSpec
from warmpool_operator.predict.forecaster import Forecaster, ForecasterConfig

pytestmark = pytest.mark.unit

ONE_SECOND = ServiceModel(prefill_tokens_per_s=1000.0, decode_tokens_per_s=10.0)  # 500 + 5 tokens: 0.5 + 0.5 s
EPOCH = 1_700_000_040.0  # a whole minute: the trace starts on a step boundary


def _req(t: float) -> TraceRequest:
    return TraceRequest(t, 500, 5)


@dataclass
class Scripted:
    """Asks for a given pod count at given times (tick times must be exact multiples of tick_s)."""

    plan: dict[float, int]
    name: str = "scripted"
    tick_s: float | None = 1.0

    def on_tick(self, sim: Simulation) -> int | None:
        return self.plan.get(sim.now)

    def on_arrival(self, sim: Simulation) -> int | None:
        return None


def test_queueing_arithmetic_of_one_pod() -> None:
    sim = Simulation([_req(0.0), _req(0.1)], ONE_SECOND, PoolConfig(1, 1, 10.0), NoPrewarm(idle_timeout_s=1e9))
    assert sim.measured_capacity_rps() is None  # nothing served yet: capacity unknown, never guessed
    sim.run(end_s=3.0)
    first, second = sim.served
    assert first.warm_hit and first.ttft_s == pytest.approx(0.5)
    assert not second.warm_hit and second.start == pytest.approx(1.0)
    assert second.ttft_s == pytest.approx(0.9 + 0.5)  # waited for the pod, then its prefill
    assert sim.measured_capacity_rps() == pytest.approx(1.0)  # one request per busy second
    assert sim.pod_seconds(3.0) == pytest.approx(3.0)


def test_no_prewarm_starts_a_pod_for_a_queued_request_and_stops_it_when_idle() -> None:
    requests = [_req(0.0), _req(0.2), _req(0.3)]
    sim = Simulation(requests, ONE_SECOND, PoolConfig(1, 5, 10.0), NoPrewarm(idle_timeout_s=30.0),
                     idle_timeout_s=30.0)
    sim.run(end_s=100.0)
    assert [p.initial for p in sim.pods] == [True, False, False]  # one pod per queued request
    assert [s.warm_hit for s in sim.served] == [True, False, False]
    # the existing pod frees up (t=1, t=2) long before the new ones are warm (t=10.2, 10.3): they serve nothing
    assert not any(s.first_on_new_pod for s in sim.served)
    # Idle 30 s, a pod stops, down to minWarm: the first pod (idle from t=3) and the first new one go,
    # the last one to go idle stays.
    assert [p.stopped_at for p in sim.pods] == [pytest.approx(33.0), pytest.approx(40.2), 100.0]


def test_scale_down_order_when_removing_some() -> None:
    # t=1: ask 3 (warm at 1.5). t=2: two requests keep two pods busy until 3.0; ask 5 (two start,
    # warm at 2.5).  t=2.25: ask 2: the two starting go first, then the idle third pod; the busy stay.
    sim = Simulation([_req(2.0), _req(2.0)], ONE_SECOND, PoolConfig(0, 5, 0.5),
                     Scripted({1.0: 3, 2.0: 5, 2.25: 2}, tick_s=0.25))
    sim.run(end_s=4.0)
    stopped = [p.stopped_at for p in sim.pods]
    assert stopped[3:] == [2.25, 2.25]  # starting pods cancelled first
    assert stopped[2] == 2.25  # then the idle warm pod
    assert stopped[:2] == [4.0, 4.0]  # the busy ones are kept (they are the two asked for)
    drain = Simulation([_req(2.0), _req(2.0)], ONE_SECOND, PoolConfig(0, 5, 0.5),
                       Scripted({1.0: 2, 2.5: 1}, tick_s=0.5))
    drain.run(end_s=4.0)
    busy_stops = sorted(p.stopped_at or 0.0 for p in drain.pods)
    assert busy_stops == [3.0, 4.0]  # a busy pod asked to go finishes its request, then stops
    assert len(drain.served) == 2


def test_reactive_holds_pods_through_the_scale_down_stabilisation_window() -> None:
    burst = [_req(i * 0.1) for i in range(600)]  # 10 req/s for a minute, then nothing
    hpa = HpaSettings(scale_down_stabilisation_s=300.0)
    sim = Simulation(burst, ONE_SECOND, PoolConfig(1, 20, 5.0), Reactive(hpa))
    sim.run(end_s=600.0)
    peak_time, peak = max(((t, asked) for t, _, asked in sim.pod_timeline), key=lambda x: x[1])
    assert peak >= 8
    drops = [t for t, _, asked in sim.pod_timeline if t > peak_time and asked < peak]
    last_rise = max(t for t, _, asked in sim.pod_timeline if asked == peak)
    assert drops and drops[0] >= 60.0 + hpa.scale_down_stabilisation_s - hpa.sync_s
    assert last_rise < drops[0]


def test_predictive_history_sees_what_arrived_and_a_partial_first_step_as_missing() -> None:
    requests = tuple(_req(30.0 + i) for i in range(150))  # starts 30 s into a step
    predictive = Predictive(Reactive(HpaSettings()), Forecaster(ForecasterConfig(use_model=False)),
                            PredictiveSpec(enabled=True), requests, EPOCH, lead_s=5.0)
    sim = Simulation(requests, ONE_SECOND, PoolConfig(1, 5, 5.0), predictive)
    sim.run(end_s=240.0)
    rates = predictive.history.rates()
    assert rates[0] == 30.0  # the trace starts on a step boundary here: the first step is whole
    assert rates[1:3] == [60.0, 60.0]
    late = Predictive(Reactive(HpaSettings()), Forecaster(ForecasterConfig(use_model=False)),
                      PredictiveSpec(enabled=True), requests, EPOCH + 30.0, lead_s=5.0)
    Simulation(requests, ONE_SECOND, PoolConfig(1, 5, 5.0), late).run(end_s=240.0)
    assert late.history.rates()[0] is None  # began mid-step: a partial count is not an observation


def _ramp() -> list[TraceRequest]:
    """0.2 req/s for 10 min, up to 4 req/s at minute 20 (the peak), down to 0.2 by minute 25."""

    def rate(minute: float) -> float:
        if minute < 10:
            return 0.2
        if minute < 20:
            return 0.2 + 3.8 * (minute - 10) / 10
        return max(0.2, 4.0 - 3.8 * (minute - 20) / 5)

    requests, t = [], 0.0
    while t < 30 * 60:
        requests.append(TraceRequest(t, 500, 10))
        t += 1 / rate(t / 60)
    return requests


def test_on_a_ramp_predictive_is_warm_before_the_peak_and_reactive_is_not() -> None:
    requests = _ramp()
    peak_s = 20 * 60.0
    needed = 3  # 4 req/s x 0.6 s per request (500 prompt + 10 generated tokens) = 2.4 pods
    service = ServiceModel(prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0)
    pool = PoolConfig(min_warm=1, max_replicas=20, cold_start_s=120.0)
    reactive = Simulation(requests, service, pool, Reactive(HpaSettings()))
    reactive.run(end_s=requests[-1].t)
    predictive_policy = Predictive(Reactive(HpaSettings()), Forecaster(ForecasterConfig()),
                                   PredictiveSpec(enabled=True, max_extra_replicas=20), tuple(requests), EPOCH,
                                   lead_s=pool.cold_start_s)
    predictive = Simulation(requests, service, pool, predictive_policy)
    predictive.run(end_s=requests[-1].t)

    def warm_enough_at(sim: Simulation) -> float:
        return min((t for t, warm, _ in sim.pod_timeline if warm >= needed), default=math.inf)

    def asked_at(sim: Simulation) -> float:
        return min((t for t, _, asked in sim.pod_timeline if asked >= needed), default=math.inf)

    # The order of simulated events, not wall time: predictive asks a cold start ahead and is warm
    # before the peak; reactive asks only once the rate it reads has risen, and is warm after it.
    assert asked_at(predictive) <= peak_s - pool.cold_start_s < asked_at(reactive)
    assert warm_enough_at(predictive) < peak_s < warm_enough_at(reactive)
    missed = {name: sum(not s.warm_hit for s in sim.served) for name, sim in
              (("reactive", reactive), ("predictive", predictive))}
    assert missed["predictive"] < missed["reactive"]
    floors = [f.floor for f in predictive_policy.forecasts if f.made_at <= peak_s - pool.cold_start_s]
    assert max(floors) >= needed  # it was the floor, not the HPA, that asked in time
