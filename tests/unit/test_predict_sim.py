"""The replay simulator and the policies: the queueing model's arithmetic, how pods come and go, the HPA's
delays, and on a synthetic ramp the predictive pool is warm before the peak while the reactive one is not."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from warmpool_bench.predict_policies import FixedPool, HpaSettings, Predictive, Reactive
from warmpool_bench.predict_sim import PoolConfig, ServiceModel, Simulation
from warmpool_bench.predict_trace import TraceRequest
from warmpool_operator.rules.forecast.decision import PredictiveSpec
from warmpool_operator.rules.forecast.forecaster import Forecaster, ForecasterConfig

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
    sim = Simulation([_req(0.0), _req(0.1)], ONE_SECOND, PoolConfig(1, 1, 10.0), FixedPool(1))
    assert sim.measured_capacity_rps() is None  # nothing served yet: capacity unknown, never guessed
    sim.run(end_s=3.0)
    first, second = sim.served
    assert first.warm_hit and first.ttft_s == pytest.approx(0.5)
    assert not second.warm_hit and second.start == pytest.approx(1.0)
    assert second.ttft_s == pytest.approx(0.9 + 0.5)  # waited for the pod, then its prefill
    assert sim.measured_capacity_rps() == pytest.approx(1.0)  # one request per busy second
    assert sim.pod_seconds(3.0) == pytest.approx(3.0)


def test_a_batching_pod_serves_several_at_once_each_at_its_share_of_the_batch_speed() -> None:
    # Two slots, a batch of two decodes 1.6x one request alone: each of the two gets 0.8x, 8 tokens/s.
    batching = ServiceModel(prefill_tokens_per_s=1000.0, decode_tokens_per_s=10.0, speedups=(1.0, 1.6))
    requests = [_req(0.0), _req(0.0), _req(0.0)]
    sim = Simulation(requests, batching, PoolConfig(1, 1, 10.0), FixedPool(1))
    sim.run(end_s=5.0)
    first, second, third = sim.served
    assert first.warm_hit and second.warm_hit and not third.warm_hit  # two slots: the third waits
    # The first started alone (1 s), the second with it (0.5 s + 5 tokens at 8 tokens/s = 1.125 s): the
    # first slot frees at 1.0 s, and the third starts there beside the second.
    assert third.start == pytest.approx(1.0) and third.ttft_s == pytest.approx(1.5)
    assert sim.pods[0].served == 3
    # Capacity: 3 requests per busy pod-second, the pod busy from 0 until the last ends at 2.125 s.
    assert sim.measured_capacity_rps() == pytest.approx(3 / 2.125)
    assert ONE_SECOND.slots == 1 and batching.slots == 2
    with pytest.raises(ValueError, match=r"speed-ups must start at 1\.0"):
        ServiceModel(1000.0, 10.0, speedups=(1.5, 2.0))


def test_capacity_is_the_best_batch_size_measured_not_the_mean_over_quiet_and_busy_times() -> None:
    # A batch of two decodes twice as fast as one request (each request 1 s at either size): six
    # requests alone, then six pairs.  Alone a pod serves 1 per busy second, in pairs 2.
    doubling = ServiceModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=10.0, speedups=(1.0, 2.0))
    alone = [TraceRequest(10.0 * k, 1, 10) for k in range(6)]
    pairs = [TraceRequest(100.0 + 10.0 * k, 1, 10) for k in range(6) for _ in range(2)]
    sim = Simulation([*alone, *pairs], doubling, PoolConfig(1, 1, 10.0), FixedPool(1))
    sim.run(end_s=200.0)
    assert len(sim.served) == 18
    # 18 requests in 12 busy seconds would say 1.5; the pairs finish together, in a step of two
    assert sim.measured_capacity_rps() == pytest.approx(2.0)


def test_a_fixed_pool_never_scales_and_queues_what_it_cannot_serve() -> None:
    # Two warm pods, 1 s per request, four arrivals at t=0: two served at once, two wait for the
    # first pods to free up at t=1 (waited 1 s, then their 0.5 s prefill).  No pod ever starts or stops.
    requests = [_req(0.0)] * 4 + [_req(10.0)]
    sim = Simulation(requests, ONE_SECOND, PoolConfig(2, 2, 30.0), FixedPool(2))
    sim.run(end_s=20.0)
    assert [s.warm_hit for s in sim.served] == [True, True, False, False, True]
    assert [s.ttft_s for s in sim.served] == pytest.approx([0.5, 0.5, 1.5, 1.5, 0.5])
    assert len(sim.pods) == 2 and all(p.initial for p in sim.pods)
    assert sim.pod_seconds(20.0) == pytest.approx(40.0)
    assert [asked for _, _, asked in sim.pod_timeline] == [2]


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


def test_no_prewarm_pool_is_sized_for_the_busiest_minute_or_the_mean_or_as_set() -> None:
    from dataclasses import replace

    from warmpool_bench.predict import PredictBenchSettings, ScaleUp, fixed_pool_size
    from warmpool_bench.predict_trace import Trace

    # 1 s of service per request.  Minute 0: 150 requests (150 busy seconds: 2.5 pods) -> 3 pods for the
    # busiest minute; then 10 more over four minutes: 160 busy seconds over 300 s -> 1 pod for the mean.
    requests = [_req(i * 0.4) for i in range(150)] + [_req(60.0 + 24.0 * k) for k in range(1, 11)]
    trace = Trace("hand-made", EPOCH, tuple(requests))
    settings = PredictBenchSettings(prefill_tokens_per_s=1000.0, decode_tokens_per_s=10.0,
                                    scale_ups=(ScaleUp("test", 5.0, 5.0, "test"),))
    assert trace.duration_s == 300.0
    assert fixed_pool_size(trace, settings) == fixed_pool_size(trace, settings, "peak") == 3
    assert fixed_pool_size(trace, settings, "mean") == 1
    assert fixed_pool_size(trace, replace(settings, min_warm=2), "mean") == 2
    assert fixed_pool_size(trace, replace(settings, fixed_replicas=7)) == 7
    assert fixed_pool_size(trace, replace(settings, fixed_replicas=500, max_replicas=64)) == 64
    with pytest.raises(ValueError, match="sizing"):
        fixed_pool_size(trace, settings, "median")


def test_first_request_after_a_lull_is_counted_the_same_for_every_policy() -> None:
    from warmpool_bench.predict import figures

    # One pod, 1 s per request: a burst of three at t=0 (the first after the "lull" before the trace),
    # then one at t=30 (no lull), then one at t=100 (70 s after the last arrival: a lull).
    requests = [_req(0.0), _req(0.0), _req(0.0), _req(30.0), _req(100.0)]
    sim = Simulation(requests, ONE_SECOND, PoolConfig(1, 1, 10.0), FixedPool(1))
    sim.run(end_s=101.0)
    out = figures(sim, 101.0)
    assert out["first_request_count"] == 2 and out["first_request_p95_s"] == pytest.approx(0.5)
    assert out["new_pod_first_count"] == 0 and out["new_pod_first_p95_s"] is None
    assert out["no_warm_capacity"] == 2 and out["ttft_p95_s"] > 2.0  # the burst's second and third waited


def test_reactive_follows_the_lagged_rate_one_sync_at_a_time() -> None:
    # 4 req/s from t=0, 1 s per request (measured capacity 1 req/s per pod once one completes).  Each
    # sync reads the 60 s window ending 15 s ago: t=30 sees [-45, 15) = 1 req/s (1 pod, within tolerance
    # of the 1 it has), t=45 sees [-30, 30) = 2 req/s, t=60 3 req/s, t=75 the whole 4 req/s.
    requests = [_req(k * 0.25) for k in range(4 * 300)]
    hpa = HpaSettings()
    sim = Simulation(requests, ONE_SECOND, PoolConfig(1, 20, 5.0), Reactive(hpa))
    sim.run(end_s=300.0)
    changes = [(t, asked) for (t, _, asked), (_, _, before) in
               zip(sim.pod_timeline[1:], sim.pod_timeline, strict=False) if asked != before]
    assert changes[:3] == [(45.0, 2), (60.0, 3), (75.0, 4)]
    assert max(asked for _, _, asked in sim.pod_timeline) == 4  # never more than the rate needs
    warm_times = [t for t, warm, _ in sim.pod_timeline if warm == 4]
    assert warm_times and warm_times[0] == 75.0 + 5.0  # the last pod serves one cold start after it was asked


def test_reactive_below_its_floor_goes_to_the_floor_at_once_like_the_hpa() -> None:
    # No traffic: the HPA alone stays at minWarm.  A floor of 10 (the predictive minReplicas) is reached at
    # the next sync, not through the scale-up rate limit (x2 or +4 per sync would need two syncs).
    reactive = Reactive(HpaSettings())
    sim = Simulation([_req(200.0)], ONE_SECOND, PoolConfig(1, 20, 5.0), reactive)
    reactive.floor = 10
    sim.run(end_s=20.0)
    assert [(t, asked) for t, _, asked in sim.pod_timeline][:2] == [(0.0, 1), (15.0, 10)]


def _bursts(minutes: int) -> list[TraceRequest]:
    """Every minute, 30 requests in its first 10 s (3 req/s), then 50 s of nothing: 0.5 req/s on average."""
    return [_req(60.0 * m + k / 3) for m in range(minutes) for k in range(30)]


def test_predictive_records_each_steps_busiest_10_s_and_sizes_the_floor_for_it() -> None:
    from warmpool_operator.rules.forecast.forecaster import TARGET_REQUESTS

    requests = tuple(_bursts(12))
    pool = PoolConfig(1, 20, 5.0)

    def run(target: str) -> Predictive:
        config = ForecasterConfig(use_model=False, only="last_value", target=target)
        policy = Predictive(Reactive(HpaSettings()), Forecaster(config), PredictiveSpec(enabled=True,
                            max_extra_replicas=20), requests, EPOCH, lead_s=5.0)
        Simulation(requests, ONE_SECOND, pool, policy).run(end_s=requests[-1].t)
        return policy

    peak, count = run("peak"), run(TARGET_REQUESTS)
    assert peak.history.requests[:10] == [30] * 10
    assert peak.history.peak_requests[:10] == [180] * 10  # 30 in one 10 s sub-step = 180 per 60 s step
    # 1 s per request (capacity 1 req/s per pod): the bursts need 3 pods, the minute's mean needs 1.
    assert {f.predicted for f in peak.forecasts[3:]} == {3} and {f.floor for f in peak.forecasts[3:]} == {3}
    assert {f.predicted for f in count.forecasts[3:]} == {1}
    assert all(f.p90 == pytest.approx(3.0) for f in peak.forecasts[3:])  # req/s at the burst's rate


def test_pod_hours_on_a_hand_made_trace_count_every_pod_holding_an_accelerator_asleep_or_awake() -> None:
    from warmpool_bench.predict import figures
    from warmpool_bench.predict_inputs import PodMemory

    # 100 s; one pod warm from the start; a second asked for at 10 s (warm at 10.5), one scaled down at
    # 20 s, one more wanted at 50 s, one scaled down at 60 s.  Requests at 0 s and 99 s.
    plan = {10.0: 2, 20.0: 1, 50.0: 2, 60.0: 1}
    memory = PodMemory(awake_bytes=2 * 2**30, asleep_bytes=0.5 * 2**30, source="test")
    requests = [_req(0.0), _req(99.0)]

    # Pods that stop when scaled down: pod 0 held 0-20 s, pod 1 10-60 s, pod 2 (a new one) 50-100 s.
    stopping = Simulation(requests, ONE_SECOND, PoolConfig(1, 2, 0.5), Scripted(dict(plan)))
    stopping.run(end_s=100.0)
    out = figures(stopping, 100.0, memory)
    assert len(stopping.pods) == 3
    assert out["pod_hours"] == out["awake_pod_hours"] == pytest.approx(120 / 3600)
    assert out["asleep_pod_hours"] == 0 and out["memory_gib_hours"] == pytest.approx(2 * 120 / 3600)

    # Pods that sleep: pod 0 sleeps 20-50 s and is woken (no third pod), pod 1 sleeps 60-100 s.  Both hold
    # their accelerator throughout: 100 + 90 s held, of which 30 + 40 s asleep.
    sleeping = Simulation(requests, ONE_SECOND, PoolConfig(1, 2, 0.5, wake_s=0.2), Scripted(dict(plan)))
    sleeping.run(end_s=100.0)
    out = figures(sleeping, 100.0, memory)
    assert len(sleeping.pods) == 2  # the sleeper was woken, not a new pod started
    assert out["pod_hours"] == pytest.approx(190 / 3600)
    assert out["asleep_pod_hours"] == pytest.approx(70 / 3600) and out["awake_pod_hours"] == pytest.approx(120 / 3600)
    assert out["memory_gib_hours"] == pytest.approx((2 * 120 + 0.5 * 70) / 3600)
    assert [t for t, warm, _ in sleeping.pod_timeline if warm == 2] == [10.5, 50.2]  # a wake, not a cold start
    assert figures(sleeping, 100.0)["memory_gib_hours"] is None  # nothing measured: not reported


def test_a_pool_at_zero_is_raised_to_one_pod_by_the_request_that_finds_none() -> None:
    from warmpool_bench.predict import figures

    # minWarm 0: nothing held until the first request; it waits one cold start (5 s) and its prefill.
    sim = Simulation([_req(100.0), _req(100.5)], ONE_SECOND, PoolConfig(0, 5, 5.0), Reactive(HpaSettings()))
    sim.run(end_s=1000.0)
    out = figures(sim, 1000.0)
    assert sim.pods[0].asked_at == 100.0 and out["pods_started"] == 1
    assert sim.served[0].ttft_s == pytest.approx(5.5) and out["no_warm_capacity"] == 2
    # The HPA lets it go back to zero once its lagged window no longer sees them (100 + 60 + 15 s) and
    # its scale-down stabilisation (300 s) has passed, at a 15 s sync: not before.
    assert sim.pods[0].stopped_at == 480.0
