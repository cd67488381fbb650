"""The scaling policies ``warmpool bench predict`` compares, as :class:`~.predict_sim.Controller`\\ s.

- :class:`FixedPool` (``none``): what a user without warmpool's prediction and without an
  autoscaler has: a Deployment of ``replicas`` pods, all warm from the start, never scaled.
  The replay sizes it for the trace's average load (``bench/README.md`` says how); nothing
  is forecast and nothing is started or stopped.
- :class:`Reactive` (``reactive``): the Kubernetes HPA's algorithm on a requests-per-second
  metric: every ``sync_s`` it reads the arrival rate over ``window_s`` as it stood
  ``metrics_lag_s`` ago (the scrape and the metrics pipeline), wants ⌈rate ÷ capacity⌉
  pods, skips changes within ``tolerance``, scales down only to the highest
  recommendation of the last ``scale_down_stabilisation_s``, and scales up at most by
  ``max(100 %, 4 pods)`` per sync (the HPA's default behaviour); below its minReplicas (the
  predictive floor) it goes to minReplicas at once, as the HPA controller does.
- :class:`Predictive` (``predictive:<forecaster>``): the same HPA, with the operator's
  predictive floor under it (:mod:`warmpool_operator.rules.forecast`): every step it records the
  step just closed (its count, and its peak: the busiest 10 s, scaled to the step), forecasts
  the steps one lead time ahead (their peak, unless the forecaster is set to the count) and sets the HPA's floor to
  :func:`~warmpool_operator.rules.forecast.decision.decide`'s count.  It never lowers what the
  HPA decides.  (The 60 s-step policy the last round measured; ``predictive60:<forecaster>``.)
- :class:`BurstPredictive` (``predictive:<forecaster>``): prediction at the bursts' own time scale,
  paired with a fast reactive loop (NVIDIA Dynamo's planner pairs a slow predictive loop with a 5 s
  reactive one): every ``fast.tick_s`` it closes the history steps that ended (their length chosen
  from the trace, :mod:`warmpool_operator.rules.forecast.timescale`), forecasts one lead time ahead
  when a step closed, and asks for the larger of the forecast's count
  (:func:`~warmpool_operator.rules.forecast.decision.decide`) and the fast loop's: ⌈requests in flight
  or held ÷ a pod's batch⌉ and ⌈the last ``fast.window_s``'s arrival rate ÷ capacity⌉, read without a
  metrics pipeline's lag (the workers' and the activator's own gauges).  It lowers the pool only to the
  highest ask of the last ``release_s`` (a lead time and a step by default): pods are released between
  bursts, not held five minutes as the HPA's stabilisation holds them.

Every controller sees only what the operator would: arrivals so far, and the capacity the
pods measured (:meth:`~.predict_sim.Simulation.measured_capacity_rps`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from warmpool_operator.rules.forecast.decision import DecisionInputs, PredictiveSpec, decide, horizons
from warmpool_operator.rules.forecast.forecaster import Forecaster, Prediction
from warmpool_operator.rules.forecast.history import PEAK_SUBSTEP_S, History, StepObservation, peak_of
from warmpool_operator.rules.forecast.lengths import histogram

from warmpool_bench.predict_sim import Simulation
from warmpool_bench.predict_trace import TraceRequest


@dataclass
class FixedPool:
    """A fixed ``replicas``: the pool it runs in must be ``PoolConfig(replicas, replicas, ...)``,
    so the simulation starts that many warm pods; this controller never asks for a change."""

    replicas: int
    name: str = "none"
    tick_s: float | None = None

    def on_tick(self, sim: Simulation) -> int | None:
        return None

    def on_arrival(self, sim: Simulation) -> int | None:
        return None


@dataclass(frozen=True)
class HpaSettings:
    sync_s: float = 15.0
    window_s: float = 60.0
    metrics_lag_s: float = 15.0
    tolerance: float = 0.1
    scale_down_stabilisation_s: float = 300.0
    scale_up_pods: int = 4
    scale_up_factor: float = 2.0


@dataclass
class Reactive:
    settings: HpaSettings
    name: str = "reactive"
    floor: int = 0  # raised by the predictive policy (the HPA's minReplicas)
    last_recommendation: int | None = None  # for the current rate, before any floor
    _recent: deque[tuple[float, int]] = field(default_factory=deque)

    @property
    def tick_s(self) -> float | None:
        return self.settings.sync_s

    def on_arrival(self, sim: Simulation) -> int | None:
        return None

    def on_tick(self, sim: Simulation) -> int | None:
        s = self.settings
        current = sim.desired
        capacity = sim.measured_capacity_rps()
        low, high = sim.pool.min_warm, sim.pool.max_replicas
        if capacity is None:  # no metric yet: an HPA does nothing
            raw = current
        else:
            end = sim.now - s.metrics_lag_s
            rate = sim.arrivals_between(end - s.window_s, end) / s.window_s
            raw = max(0, math.ceil(rate / capacity - 1e-9))
            if current > 0 and abs(rate / (current * capacity) - 1) <= s.tolerance:
                raw = current
        self.last_recommendation = max(low, min(high, raw))
        recommendation = max(self.last_recommendation, min(high, self.floor))
        self._recent.append((sim.now, recommendation))
        while self._recent and self._recent[0][0] < sim.now - s.scale_down_stabilisation_s:
            self._recent.popleft()
        floor = min(high, self.floor)
        if current < floor:  # the HPA goes straight to minReplicas, outside its scale-up rate limits
            return floor
        if recommendation >= current:
            limit = max(math.ceil(current * s.scale_up_factor), current + s.scale_up_pods)
            return min(recommendation, limit)
        return min(current, max(r for _, r in self._recent))


@dataclass(frozen=True)
class StepForecast:
    """One forecast made at a step boundary, for the chart and the report."""

    made_at: float  # simulated seconds
    step_start: float  # simulated start of the first target step
    p50: float  # requests per second (the forecast target, the step's peak or its count, ÷ step_s)
    p90: float
    model: str | None
    floor: int
    predicted: int | None


@dataclass
class Predictive:
    reactive: Reactive
    forecaster: Forecaster
    spec: PredictiveSpec
    requests: tuple[TraceRequest, ...]
    epoch_start: float  # unix time of the trace's t = 0
    lead_s: float  # the measured cold-start p95
    name: str = "predictive"
    history: History = field(default_factory=History)
    predictions: list[Prediction] = field(default_factory=list)
    forecasts: list[StepForecast] = field(default_factory=list)
    lead_s_now: float | None = None  # the lead for the next forecast when it differs (a sleeper to wake)
    _next_step: int | None = None
    _times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._times = [r.t for r in self.requests]  # sorted (the trace loader checks the order)

    @property
    def step_s(self) -> int:
        return self.history.limits.step_s

    @property
    def tick_s(self) -> float | None:
        return self.reactive.tick_s

    def on_arrival(self, sim: Simulation) -> int | None:
        return None

    def on_tick(self, sim: Simulation) -> int | None:
        if self.close_steps(sim):
            self._forecast(sim)
        return self.reactive.on_tick(sim)

    def close_steps(self, sim: Simulation) -> bool:
        """Record the steps that ended by now; True when any did (a forecast is due)."""
        closed = int((self.epoch_start + sim.now) // self.step_s)  # steps before this one are complete
        if self._next_step is None:
            self._next_step = int(self.epoch_start // self.step_s)
        if closed <= self._next_step:
            return False
        for step in range(self._next_step, closed):
            self.history.record(step, self._observe(step))
        self._next_step = closed
        return True

    def _observe(self, step: int) -> StepObservation | None:
        start = step * self.step_s - self.epoch_start
        if start < 0:
            return None  # the trace began inside this step: a partial count is not an observation
        first = bisect.bisect_left(self._times, start)
        last = bisect.bisect_left(self._times, start + self.step_s)
        seen = self.requests[first:last]
        sub = min(PEAK_SUBSTEP_S, self.step_s)
        edges = [bisect.bisect_left(self._times, start + k * sub, first, last)
                 for k in range(self.step_s // sub)] + [last]
        peak = peak_of([b - a for a, b in itertools.pairwise(edges)], self.step_s, sub)
        return StepObservation(requests=len(seen), peak_requests=peak, prompt_tokens=sum(r.prompt for r in seen),
                               generated_tokens=sum(r.generated for r in seen),
                               prompt_lengths=tuple(histogram(r.prompt for r in seen)),
                               generated_lengths=tuple(histogram(r.generated for r in seen)))

    def _forecast(self, sim: Simulation) -> None:
        reactive = self.reactive.last_recommendation
        self.reactive.floor = self.forecast_floor(sim, reactive if reactive is not None else sim.desired)

    def forecast_floor(self, sim: Simulation, reactive: int) -> int:
        """Forecast the steps one lead time ahead; the pods the forecast asks for (a floor)."""
        wanted = horizons(self.lead_s_now if self.lead_s_now is not None else self.lead_s, self.step_s)
        # The coarse tier for the daily and weekly features, as the operator passes it (an hour's replay
        # holds too little of it to turn them on).
        prediction = self.forecaster.update(self.history, wanted, self.forecaster.seasonal(self.history.coarse))
        self.predictions.append(prediction)
        decision = decide(DecisionInputs(
            forecast_p90=prediction.p90, step_s=self.step_s, capacity_rps=sim.measured_capacity_rps(),
            reactive_replicas=reactive, min_warm=sim.pool.min_warm,
            max_replicas=sim.pool.max_replicas, max_extra_replicas=self.spec.max_extra_replicas,
            autoscaler_present=True))
        if prediction.p50 is not None and prediction.p90 is not None:
            first = prediction.forecasts[0].horizon
            self.forecasts.append(StepForecast(
                made_at=sim.now, step_start=(prediction.last_step + first) * self.step_s - self.epoch_start,
                p50=prediction.p50 / self.step_s, p90=prediction.p90 / self.step_s, model=prediction.model,
                floor=decision.replicas, predicted=decision.predicted))
        return decision.replicas


@dataclass(frozen=True)
class FastLoopSettings:
    tick_s: float = 5.0  # Dynamo's reactive loop
    window_s: float = 10.0  # the arrival rate it reads (the shortest burst the trace cares about)
    release_s: float | None = None  # scale-down hold; None: the lead time and one step


@dataclass
class BurstPredictive:
    """Forecast at the trace's step beside a fast reactive loop (see the module docstring)."""

    observer: Predictive  # records the steps and forecasts (its HPA is not used)
    fast: FastLoopSettings = field(default_factory=FastLoopSettings)
    wake_lead_s: float | None = None  # the lead when a sleeper can be woken (the wake p95)
    name: str = "predictive"
    floor: int = 0  # the forecast's count, from the last closed step
    asks: int = 0  # ticks where the forecast asked for more than the fast loop
    _recent: deque[tuple[float, int]] = field(default_factory=deque)

    @property
    def tick_s(self) -> float | None:
        return self.fast.tick_s

    @property
    def release_s(self) -> float:
        return self.fast.release_s if self.fast.release_s is not None else self.observer.lead_s + self.observer.step_s

    def on_arrival(self, sim: Simulation) -> int | None:
        return None

    def fast_count(self, sim: Simulation) -> int:
        """Pods for what is here now: the requests in flight or held, and the recent arrival rate."""
        slots = sim.service.slots
        wanted = math.ceil(sim.in_flight / slots - 1e-9)
        capacity = sim.measured_capacity_rps()
        if capacity:
            rate = sim.arrivals_between(sim.now - self.fast.window_s, sim.now) / self.fast.window_s
            wanted = max(wanted, math.ceil(rate / capacity - 1e-9))
        return wanted

    def on_tick(self, sim: Simulation) -> int | None:
        observer = self.observer
        fast = self.fast_count(sim)
        if observer.close_steps(sim):
            # a sleeper to wake serves after a wake, not a cold start: plan that far ahead
            observer.lead_s_now = self.wake_lead_s if sim.asleep and self.wake_lead_s is not None else None
            self.floor = observer.forecast_floor(sim, reactive=fast)
        self.asks += self.floor > fast
        wanted = max(self.floor, fast)
        self._recent.append((sim.now, wanted))
        while self._recent and self._recent[0][0] < sim.now - self.release_s:
            self._recent.popleft()
        if wanted >= sim.desired:
            return wanted
        return max(r for _, r in self._recent)
