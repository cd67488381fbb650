"""One WarmModel's demand prediction at run time: history fed from scrapes, persisted, and forecast
on the operator's one forecasting thread (:class:`ForecastRunner`); and the pass's forecast step
(:class:`PoolForecast`): the pods the forecast asks for, and what status reports of it.

* **History** (rules/forecast/history.py) gets one fine step per ``--predict-step-seconds`` (by
  default the shortest the scrapes support: 30 s at the default 10 s scrape, 10 s at 3 s) from the
  pool's counters (rules/forecast/steps.py), :data:`HISTORY_POINTS` of them, and rolls them up into a
  coarse tier of :data:`COARSE_STEP_S` steps kept :data:`COARSE_RETENTION_S` (28 days: the weekly
  shape, which the fine steps are too few to hold).  It is loaded from ConfigMap ``<name>-history``
  (io/history_store.py) when the reconciler starts, so a restarted operator goes on from what it
  had (an older operator's single-resolution history is re-held at these limits, its weeks in the
  coarse tier), and saved through the store (at most one write per five minutes, or five steps when
  they are shorter than the default's, and once more, forced, when the operator shuts down).
  Steps that close before the load has finished wait for it, so a slow API server loses none.
* **Forecasts** run on the thread the registry owns (one for the whole operator: LightGBM is
  single-threaded, so prediction costs at most one core however many WarmModels there are),
  never on the event loop.  Each closed step asks for one; one is in flight per WarmModel at
  a time, on a copy of the history.  When it is done the reconciler is poked, and the next pass
  reads :meth:`ForecastRunner.current`.  A short history gives a baseline's forecast; missing
  request metrics give no forecast and the reason (rules/forecast/forecaster.py).
* **The forecast's step** is read off the history's own recent counts (rules/forecast/timescale.py):
  the longest step, a whole multiple of the history's, no longer than half the burst a request
  typically arrives in, re-chosen every :data:`CHOOSE_EVERY_S`.  The forecaster runs on the history
  resampled to that step (its whole steps only), once per forecast step, with horizons in that step
  covering the lead time; a history too short to read bursts from forecasts at its own step.  So a
  history held at 5 s steps forecasts 20 s bursts at 10 s, and a 60 s one at 60 s.  The daily and
  weekly features (time of day and week, the figure a day and a week before) are read off the
  coarse tier (rules/forecast/features.py's ``Seasonal``).
* **The fast loop** (rules/forecast/fast_loop.py) runs beside the forecast at every pass: pods for
  the last 10 s of arrivals at the measured capacity; the pool gets the larger ask, and a lower one
  only after the hold (a lead time, at least five forecast steps), so pods go between bursts.
* **Learned buckets** (``spec.warmup.learnBuckets``) are read off the prompt-length histogram
  the history holds (rules/forecast/buckets.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from warmpool.contract.api import CONDITION_PREDICTIVE
from warmpool_operator.api.types import ForecastStatus, LearnedBucketsStatus, WarmModelSpec
from warmpool_operator.io.history_store import HistoryStore, StoreSettings
from warmpool_operator.io.kube import Kube
from warmpool_operator.model import Sample
from warmpool_operator.rules import scaling
from warmpool_operator.rules.forecast import decision
from warmpool_operator.rules.forecast import report as forecast_report
from warmpool_operator.rules.forecast.baselines import BaselineConfig
from warmpool_operator.rules.forecast.buckets import LearnedBuckets, learn_buckets
from warmpool_operator.rules.forecast.fast_loop import WINDOW_S as FAST_WINDOW_S
from warmpool_operator.rules.forecast.fast_loop import fast_ask
from warmpool_operator.rules.forecast.features import FeatureConfig
from warmpool_operator.rules.forecast.forecaster import Forecaster, ForecasterConfig, Prediction
from warmpool_operator.rules.forecast.history import MISSING, History, HistoryLimits, resampled
from warmpool_operator.rules.forecast.history_reshape import oldest_step, since
from warmpool_operator.rules.forecast.lengths import LENGTH_EDGES
from warmpool_operator.rules.forecast.steps import CapacityMeter, ClosedStep, StepAccumulator
from warmpool_operator.rules.forecast.timescale import StepChoice, choose_step_from_counts
from warmpool_operator.rules.observation import PodObservation, wake_figures

log = logging.getLogger("warmpool.operator")

#: Fine steps a history holds, whatever the step (so the ConfigMap stays the same size): 3.5 days
#: at the default 30 s, 28 h at 10 s.
HISTORY_POINTS = 7 * 1440
#: A history's length histograms are kept per hour (a multiple of every allowed step).
SLOT_SECONDS = 3600
#: The coarse tier's step (the least, a whole multiple of the fine step dividing an hour) and how long
#: it is kept: 8,064 steps of 5 min, four weeks (the day-of-week features need two).
COARSE_STEP_S = 300
COARSE_RETENTION_S = 28 * 86400
#: The store writes at most once per this many seconds, and when forced at shutdown; a step shorter
#: than the shortest default (tests and demos) writes every WRITE_EVERY_STEPS steps instead.
WRITE_EVERY_S = 300
WRITE_EVERY_STEPS = 5
SHORTEST_DEFAULT_STEP_S = 10
DAY = 86400
#: The recent traffic the forecast's step is read from, the least of it that is enough, and how
#: often the choice is made again.
CHOOSE_WINDOW_S = 3600
CHOOSE_MIN_S = 600
CHOOSE_EVERY_S = 300
#: The forecast's model is retrained once per this many seconds of steps (60 steps at 60 s).
RETRAIN_EVERY_S = 3600


def choose_forecast_step(history: History) -> StepChoice:
    """The step to forecast ``history`` at: from its last :data:`CHOOSE_WINDOW_S` of counts, or its
    own step while it holds less than :data:`CHOOSE_MIN_S` of them."""
    step_s = history.limits.step_s
    recent = history.requests[-max(1, CHOOSE_WINDOW_S // step_s):]
    if len(recent) * step_s < CHOOSE_MIN_S:
        return StepChoice(step_s, 0, None, None, f"the history's own {step_s} s: {len(recent) * step_s} s of it "
                          f"is too little to read bursts from (at least {CHOOSE_MIN_S} s)")
    return choose_step_from_counts([None if r == MISSING else r for r in recent], step_s)


def forecast_with(forecaster: Forecaster, history: History, step_s: int, horizons: tuple[int, ...]) -> Prediction:
    """``forecaster``'s prediction for ``history`` resampled to ``step_s``, its coarse tier for the daily
    and weekly features (run on the forecasting thread)."""
    return forecaster.update(resampled(history, step_s), horizons, forecaster.seasonal(history.coarse))


def coarse_step_for(step_s: int) -> int | None:
    """The coarse tier's step over fine ``step_s`` steps: the least whole multiple of it, at least
    :data:`COARSE_STEP_S`, that divides an hour slot; None when that is the fine step itself."""
    coarse = next((m for m in range(step_s, SLOT_SECONDS + 1, step_s) if m >= COARSE_STEP_S and SLOT_SECONDS % m == 0),
                  step_s)
    return coarse if coarse > step_s else None


def limits_for(step_s: int) -> HistoryLimits:
    """A history's limits at fine ``step_s`` steps (one dividing an hour): :data:`HISTORY_POINTS` of them,
    and the coarse tier beside them (none when the fine step is already as long)."""
    coarse = coarse_step_for(step_s)
    return HistoryLimits(step_s=step_s, retention_s=step_s * HISTORY_POINTS, slot_s=SLOT_SECONDS,
                         coarse_step_s=coarse, coarse_retention_s=COARSE_RETENTION_S if coarse is not None else 0)


def write_interval_s(step_s: int) -> float:
    """Least seconds between two writes of the history: :data:`WRITE_EVERY_S` (a crash loses at most
    that; the ConfigMap is up to ~250 kB), or :data:`WRITE_EVERY_STEPS` steps shorter than the shortest
    default step (tests and demos see it stored within seconds)."""
    return float(WRITE_EVERY_S if step_s >= SHORTEST_DEFAULT_STEP_S else WRITE_EVERY_STEPS * step_s)


def forecaster_config(step_s: int) -> ForecasterConfig:
    """The library's defaults, with every length in steps scaled to the step (a day is a day, and the
    model is retrained once an hour: at 5 s steps, every 60 steps would be twelve trainings an hour,
    most of the forecaster's cost)."""
    per_day = max(1, DAY // step_s)
    return ForecasterConfig(
        features=FeatureConfig(step_s=step_s, time_of_day_min_steps=2 * per_day, day_of_week_min_steps=14 * per_day),
        baselines=BaselineConfig(season_steps=per_day),
        retrain_every_steps=max(1, RETRAIN_EVERY_S // step_s),
    )


def copy_history(history: History) -> History:
    """A copy (its coarse tier too) the forecasting thread may read while the event loop appends to the original."""
    return since(history, oldest_step(history))


@dataclass(frozen=True)
class Forecast:
    """A prediction, the step it was made at and the horizons (in those steps) it was asked for."""

    prediction: Prediction
    step_s: int
    horizons: tuple[int, ...]


class ForecastRunner:
    """Demand prediction of one WarmModel (its reconciler owns it; stopped with it)."""

    def __init__(self, kube: Kube, owner: Mapping[str, Any], step_s: int, executor: Executor,
                 poke: Callable[[], None], clock: Callable[[], float] = time.time) -> None:
        self.step_s = step_s
        self.limits = limits_for(step_s)
        self.store = HistoryStore(kube, owner, self.limits, StoreSettings(min_interval_s=write_interval_s(step_s)))
        self.history = History(limits=self.limits)
        self.accumulator = StepAccumulator(step_s)
        self.capacity = CapacityMeter()
        #: one forecaster per step forecast at (each keeps its own scores and model)
        self.forecasters: dict[int, Forecaster] = {}
        self.choice = StepChoice(step_s, 0, None, None, "no history yet")
        self._chosen_at: int | None = None  # the history's end when the step was last chosen
        self.executor = executor
        self.poke = poke
        self.clock = clock
        self.loaded = False
        self.load_reason: str | None = None
        self.forecast: Forecast | None = None
        self.horizons: tuple[int, ...] = (1,)
        #: why the newest step is missing or partial (None: it was whole)
        self.last_problem: str | None = None
        self.last_closed: ClosedStep | None = None
        self._waiting: list[ClosedStep] = []  # steps closed before the history was loaded
        self._tasks: set[asyncio.Task[None]] = set()
        self._forecasting = False
        self._saving = False

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        self._spawn(self._load(), "history load")

    async def stop(self, *, save: bool) -> None:
        """Cancel what runs; ``save``: write the history once more (the operator shuts down)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if save and self.loaded:
            await self.store.save(self.history, force=True)

    def _spawn(self, job: Any, name: str) -> None:
        task: asyncio.Task[None] = asyncio.create_task(job, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load(self) -> None:
        loaded = await self.store.load()
        self.history, self.load_reason, self.loaded = loaded.history, loaded.reason, True
        for closed in self._waiting:
            self._record(closed)
        self._waiting.clear()
        self._choose()
        self._ask_forecast()

    @property
    def forecast_step_s(self) -> int:
        return self.choice.step_s

    def _choose(self) -> None:
        """Read the forecast's step off the recent history again, every CHOOSE_EVERY_S of steps."""
        end = self.history.end
        if self._chosen_at is not None and end - self._chosen_at < max(1, CHOOSE_EVERY_S // self.step_s):
            return
        self.choice, self._chosen_at = choose_forecast_step(self.history), end

    def forecast_end(self) -> int:
        """The forecast step after the last whole one the history holds."""
        return self.history.end // (self.forecast_step_s // self.step_s)

    # ------------------------------------------------------------------ steps

    def observe(self, samples: Mapping[str, tuple[str, Sample | None]], at_zero: bool = False) -> None:
        """This pass's samples (uid -> (pod name, sample)); records the steps that closed.
        ``at_zero``: a scale-to-zero pool at zero (a step with no pod is then a zero, not missing)."""
        closed = self.accumulator.observe(samples, self.clock(), at_zero)
        for step in closed:
            self.capacity.add(step.served, step.busy_seconds, step.batch)
            self.last_problem, self.last_closed = step.problem, step
            if self.loaded:
                self._record(step)
            else:
                self._waiting.append(step)
        if closed and self.loaded:
            self._choose()
            self._ask_forecast()
            if not self._saving:  # one write in flight at a time (the store rate-limits the rest)
                self._saving = True
                self._spawn(self._save(), "history save")

    def _record(self, step: ClosedStep) -> None:
        if len(self.history) and step.step < self.history.end:
            return  # already held (a step the stored history has from before a restart)
        self.history.record(step.step, step.observation)

    async def _save(self) -> None:
        try:
            await self.store.save(self.history)
        finally:
            self._saving = False

    def want_horizons(self, horizons: tuple[int, ...]) -> None:
        """The steps ahead the decision needs (from the lead time); a change asks for a forecast."""
        if horizons != self.horizons:
            self.horizons = horizons
            if self.loaded:
                self._ask_forecast()

    # ------------------------------------------------------------------ forecasting

    def _up_to_date(self) -> bool:
        """The forecast held is for the step, horizons and newest whole forecast step of now (a
        history step that closes inside a longer forecast step asks for nothing)."""
        made = self.forecast
        return (made is not None and made.step_s == self.forecast_step_s and made.horizons == self.horizons
                and made.prediction.last_step >= self.forecast_end() - 1)

    def _ask_forecast(self) -> None:
        if self._forecasting or not len(self.history) or self._up_to_date():
            return
        self._forecasting = True
        step_s = self.forecast_step_s
        forecaster = self.forecasters.setdefault(step_s, Forecaster(forecaster_config(step_s)))
        self._spawn(self._run_forecast(forecaster, copy_history(self.history), step_s, self.horizons), "forecast")

    async def _run_forecast(self, forecaster: Forecaster, history: History, step_s: int,
                            horizons: tuple[int, ...]) -> None:
        try:
            loop = asyncio.get_running_loop()
            prediction = await loop.run_in_executor(self.executor, forecast_with, forecaster, history, step_s,
                                                    horizons)
            self.forecast = Forecast(prediction, step_s, horizons)
        except Exception:  # a forecast that fails leaves the pool to the reactive count
            log.exception("forecast failed")
        finally:
            self._forecasting = False
        self.poke()
        # Steps, step or horizons that moved on while it ran get their own forecast.
        if self.forecast is not None:
            self._ask_forecast()

    def current(self) -> Prediction | None:
        """The newest prediction, if it is for the step and horizons wanted now and not stale."""
        made = self.forecast
        if made is None or made.step_s != self.forecast_step_s or made.horizons != self.horizons:
            return None
        if made.prediction.last_step < self.forecast_end() - 1 - 2:  # more than two steps behind
            return None
        return made.prediction

    def learned_buckets(self, max_context: int = LENGTH_EDGES[-1]) -> LearnedBuckets:
        return learn_buckets(self.history.prompt_histogram(), max_context)


# --------------------------------------------------------------------------- the pass's forecast step


@dataclass
class Predicted:
    """What demand prediction gives a pass: the pods it asks for, and what status reports."""

    #: the pods the forecast, or the fast loop beside it, asks for, acted on (None: no ask this pass)
    wanted: int | None = None
    #: seconds a lower ask waits before it lowers the pool; None: no predictive decision this pass
    #: (prediction off, or learned warm-up lengths only), so the scale-down hold is left alone
    hold_s: float | None = None
    forecast: ForecastStatus | None = None
    learned: LearnedBucketsStatus | None = None
    conditions: list[tuple[str, str, str, str]] = field(default_factory=list)

    @property
    def awake_wanted(self) -> int:
        """Awake pods the forecast asks for: sleeping pods wake first to serve them."""
        return self.wanted or 0


class PoolForecast:
    """One WarmModel's demand prediction across passes: the runner, started while
    spec.pool.predictive or spec.warmup.learnBuckets asks for it, stopped when neither does."""

    def __init__(self, kube: Kube, owner: Mapping[str, Any], step_s: int, executor: Executor | None,
                 poke: Callable[[], None], clock: Callable[[], float] = time.time) -> None:
        self.kube, self.owner, self.step_s, self.executor = kube, owner, step_s, executor
        self.poke, self.clock = poke, clock
        self.runner: ForecastRunner | None = None
        self._stopping: set[asyncio.Task[None]] = set()

    def _running(self, spec: WarmModelSpec) -> ForecastRunner | None:
        wanted = (spec.pool.predictive is not None or spec.warmup.learn_buckets) and self.executor is not None
        if not wanted:
            if self.runner is not None:  # turned off: stop (the stored history stays for later)
                stopping = asyncio.create_task(self.runner.stop(save=False))
                self._stopping.add(stopping)
                stopping.add_done_callback(self._stopping.discard)
                self.runner = None
            return None
        if self.runner is None:
            assert self.executor is not None
            self.runner = ForecastRunner(self.kube, self.owner, self.step_s, self.executor, self.poke, self.clock)
            self.runner.start()
        return self.runner

    async def stop(self, *, save: bool) -> None:
        if self.runner is not None:
            await self.runner.stop(save=save)

    def step(self, spec: WarmModelSpec, owner: Mapping[str, Any], observations: list[PodObservation],
             cold_start_p95: float | None, at_zero: bool = False) -> Predicted:
        """Feed this pass's samples to the history; the pods the forecast asks for, and its status."""
        runner = self._running(spec)
        out = Predicted()
        if runner is None:
            return out
        live = [o for o in observations if not o.terminating]
        runner.observe({o.uid: (o.name, o.sample) for o in live}, at_zero)
        if spec.warmup.learn_buckets and runner.loaded:
            out.learned = forecast_report.learned_status(runner.learned_buckets())
        predictive = spec.pool.predictive
        if predictive is None:
            return out
        wake = wake_figures(live)
        lead = decision.lead_time(predictive, cold_start_p95, wake.p95_seconds if wake is not None else None,
                                  sum(o.asleep for o in live))
        step_s = runner.forecast_step_s
        runner.want_horizons(decision.horizons(lead.seconds, step_s))
        prediction = runner.current()
        capacity = runner.capacity.capacity_rps()
        made = scaling.predictive_decision(spec, prediction.p90 if prediction is not None else None,
                                           step_s, capacity, scaling.autoscaled(owner), at_zero)
        # The fast loop beside it, where the operator owns replicas (an autoscaler is the reactive
        # loop otherwise): pods for the last seconds' arrivals, for what the forecast missed.
        arrived = runner.accumulator.arrivals_within(FAST_WINDOW_S, runner.clock())
        fast = fast_ask(arrived, capacity) if predictive.enabled and not scaling.autoscaled(owner) else None
        fast_wanted = min(fast, spec.pool.max_replicas) if fast is not None else None
        forecast_count = made.predicted if made.predicted is not None else 0
        fast_words = (f"fast loop: {fast_wanted} pods for {arrived / FAST_WINDOW_S:.3g} req/s over the last "
                      f"{FAST_WINDOW_S:g} s" if fast_wanted is not None and fast_wanted > forecast_count else None)
        last = runner.last_closed
        report = forecast_report.report(
            enabled=predictive.enabled, loaded=runner.loaded, prediction=prediction, decision=made, lead=lead,
            step_s=step_s, history_steps=len(runner.history),
            # the last history step's count, at the forecast step's length (its rate, per forecast step)
            last_count=(last.observation.requests * (step_s // runner.step_s)
                        if last is not None and last.observation is not None else None),
            capacity_rps=capacity, last_problem=runner.last_problem, step_reason=runner.choice.reason,
            history_step_s=runner.step_s, fast_loop=fast_words)
        out.forecast = report.forecast
        out.conditions.append((CONDITION_PREDICTIVE, report.verdict.status, report.verdict.reason,
                               report.verdict.message))
        acting = predictive.enabled and report.verdict.status == "True" and made.predicted is not None
        forecast_wanted = scaling.awake_wanted(spec, made) if acting else None
        asks = [n for n in (forecast_wanted, fast_wanted) if n is not None]
        out.wanted = max(asks) if asks else None
        # A lower forecast lowers the pool only after a lead time (at least five forecast steps: at
        # the bursts' step, that is pods released between bursts, not held for minutes).
        out.hold_s = max(lead.seconds, 5.0 * step_s)
        return out
