"""`warmpool bench predict`: fixed, reactive and predictive scaling, replayed over a real trace.

The policies (honest baselines, all on the same replay, pods counted whenever they hold an
accelerator, asleep or awake):

- ``fixed``: a pool sized for the trace's busiest minute (``fixed@mean``: for its mean);
- ``reactive``: HPA-like on the pool's measured capacity, from zero (``minWarm: 0``, the activator
  raising the pool to one pod for a request that finds none); ``reactive@minwarm1``: the same with
  ``minWarm: 1``;
- ``predictive:<forecaster>``: a forecast at the bursts' own step (chosen from the trace,
  :mod:`warmpool_operator.rules.forecast.timescale`) beside a fast reactive loop, from zero
  (:class:`~.predict_policies.BurstPredictive`); ``predictive:auto@minwarm1`` with ``minWarm: 1``;
  ``predictive60:auto`` the last round's 60 s-step floor under the HPA, for comparison.

Offline half of the predictive-scaling benchmark: the trace (the shared Azure code trace by default)
is replayed through :mod:`.predict_sim`'s queueing model of a pool (its docstring says what
TTFT means there) under each policy of :mod:`.predict_policies`, with the operator's own
prediction code (:mod:`warmpool_operator.rules.forecast`) doing the forecasting and deciding.
Cold-start time is an input: by default the figure this project measured
(``bench/results/coldstart.json``), and the same replay is repeated at longer cold starts
(GPU-sized pods take 10-60 s) to show how the comparison moves with it.

Also measured here: the forecaster's CPU cost per WarmModel (on the trace, and projected for
a full history: its fine steps and four weeks of coarse ones), each candidate's quantile loss over
the replay, and the learned warm-up buckets' coverage of the trace's prompt lengths against the defaults.

The live half (a segment of the trace replayed against real pods on the local cluster, with this
simulator run beside it on the same segment) is :mod:`.predict_live` (``--live``).
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from warmpool_operator.control.forecasting import forecaster_config, limits_for
from warmpool_operator.rules.forecast.baselines import QuantileForecast
from warmpool_operator.rules.forecast.buckets import learn_buckets
from warmpool_operator.rules.forecast.decision import PredictiveSpec, horizons
from warmpool_operator.rules.forecast.evaluation import quantile_loss
from warmpool_operator.rules.forecast.forecaster import (
    CANDIDATES,
    Forecaster,
    Prediction,
)
from warmpool_operator.rules.forecast.history import PEAK_SUBSTEP_S, History, StepObservation, peak_of
from warmpool_operator.rules.forecast.lengths import histogram
from warmpool_operator.rules.forecast.timescale import StepChoice, choose_step

from warmpool_bench.coldstart import machine_info
from warmpool_bench.predict_inputs import MeasuredInputs, PodMemory
from warmpool_bench.predict_policies import (
    BurstPredictive,
    FastLoopSettings,
    FixedPool,
    HpaSettings,
    Predictive,
    Reactive,
)
from warmpool_bench.predict_sim import PoolConfig, ServiceModel, Simulation
from warmpool_bench.predict_trace import Trace
from warmpool_bench.stats import percentile, ratio

DEFAULT_BUCKETS = (32, 128, 512)
FIXED, REACTIVE, PREDICTIVE = "fixed", "reactive", "predictive:auto"
MIN_WARM_SUFFIX = "minwarm"  # ``<policy>@minwarm1``: the same policy with minWarm 1 (not from zero)
BASELINE_NAMES = (FIXED, f"{FIXED}@mean", REACTIVE)
#: the last round's policy: a 60 s-step forecast as a floor under the HPA
STEP60 = "predictive60:auto"
#: A request after this long without any arrival opens a burst: it is the "first request" of the targets.
LULL_S = 60.0


@dataclass(frozen=True)
class ScaleUp:
    """How long added capacity takes to serve, in one scenario: the replayed time (a median) and the
    lead time the predictive policy plans with (the p95, as the operator's decision uses)."""

    label: str
    start_s: float
    lead_s: float
    source: str
    #: pods scaled down sleep and are woken first (this scenario's start_s / lead_s are the wake's)
    wakes: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.start_s <= self.lead_s:
            raise ValueError(f"need 0 <= start_s <= lead_s, got {self}")


def settings_from_measured(measured: MeasuredInputs, extra_cold_starts_s: Sequence[float] = (),
                           **overrides: Any) -> PredictBenchSettings:
    """Scenarios: a new pod's cold start, then a sleeping pod's wake (both measured here), then any extra
    cold starts asked for (sensitivity; lead = the same figure)."""
    scale_ups = (
        ScaleUp("new pod (measured)", measured.cold_start.median_s, measured.cold_start.p95_s,
                measured.cold_start.source),
        ScaleUp("wake (measured)", measured.wake.median_s, measured.wake.p95_s, measured.wake.source, wakes=True),
        *(ScaleUp("sensitivity", s, s, "not measured: a longer cold start for comparison")
          for s in extra_cold_starts_s),
    )
    fields: dict[str, Any] = {"prefill_tokens_per_s": measured.prefill_tokens_per_s,
                              "decode_tokens_per_s": measured.batch.decode_tokens_per_s,
                              "speedups": measured.batch.speedups, "decode_source": measured.batch.source,
                              "scale_ups": scale_ups, "prefill_source": measured.prefill_source,
                              "memory": measured.memory, **overrides}
    return PredictBenchSettings(**fields)


@dataclass(frozen=True)
class PredictBenchSettings:
    """What one replay runs with.  The timings have no defaults: :func:`settings_from_measured` fills
    them from this machine's results files (:mod:`.predict_inputs`); a test states its own."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    scale_ups: tuple[ScaleUp, ...]  # one scenario each; the first is the primary (targets, chart)
    cold_start_s: float = 0.0  # the scenario being replayed (set from scale_ups by run_predict)
    lead_s: float = 0.0
    wake_s: float | None = None  # None: pods scaled down stop; else they sleep and wake in this long
    wake_lead_s: float | None = None
    #: the forecast's step; None: chosen from the trace (timescale.choose_step)
    step_s: int | None = None
    fast: FastLoopSettings = field(default_factory=FastLoopSettings)
    #: what a pod holds awake and asleep (memory-hours); None: not reported
    memory: PodMemory | None = None
    prefill_source: str = "as set"
    #: the batch's speed-up per batch size (its length: the requests a pod serves at once)
    speedups: tuple[float, ...] = (1.0,)
    decode_source: str = "as set"
    min_warm: int = 1  # the @minwarm policies' floor; the others start from zero
    max_replicas: int = 64
    max_extra_replicas: int | None = None  # None: up to max_replicas (no cap above the reactive count)
    fixed_replicas: int | None = None  # none's pool; None: sized for the trace's busiest minute (fixed_pool_size)
    hpa: HpaSettings = field(default_factory=HpaSettings)
    forecasters: tuple[str, ...] = ("auto", *CANDIDATES)
    retrain_every_steps: int | None = None  # None: the operator's, for the step (once an hour of steps)
    max_context: int = 8192  # SmolLM2-135M-Instruct's context
    repeat: int = 1

    @property
    def service(self) -> ServiceModel:
        return ServiceModel(self.prefill_tokens_per_s, self.decode_tokens_per_s, self.speedups)

    def step(self, trace: Trace) -> StepChoice:
        chosen = choose_step([r.t for r in trace.requests])
        if self.step_s is None:
            return chosen
        return replace(chosen, step_s=self.step_s, reason=f"set to {self.step_s} s (the trace's: {chosen.reason})")

    def spec(self) -> PredictiveSpec:
        extra = self.max_replicas if self.max_extra_replicas is None else self.max_extra_replicas
        return PredictiveSpec(enabled=True, horizon_seconds=300, max_extra_replicas=extra)


def run_predict(trace: Trace, settings: PredictBenchSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    """The results (JSON-ready) and the chart's data (pod timelines and forecasts of the measured scenario)."""
    started = time.time()
    loadavg_start = list(os.getloadavg())
    step = settings.step(trace)
    settings = replace(settings, step_s=step.step_s)
    result: dict[str, Any] = {
        "benchmark": "predict",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": machine_info(),
        "trace": describe_trace(trace, settings.repeat),
        "settings": {**_settings_json(settings), "fixed_replicas_used": fixed_pool_size(trace, settings),
                     "fixed_replicas_mean": fixed_pool_size(trace, settings, "mean"), "lull_s": LULL_S,
                     "step": asdict(step),
                     "horizon_steps": list(horizons(settings.scale_ups[0].lead_s, step.step_s))},
        "scenarios": [],
    }
    result["machine"]["loadavg"] = loadavg_start
    first = settings.scale_ups[0]
    for scale_up in settings.scale_ups:
        if scale_up.wakes:  # new pods still cold-start; pods scaled down sleep, and wake first
            scenario = replace(settings, cold_start_s=first.start_s, lead_s=first.lead_s, wake_s=scale_up.start_s,
                               wake_lead_s=scale_up.lead_s)
        else:
            scenario = replace(settings, cold_start_s=scale_up.start_s, lead_s=scale_up.lead_s)
        result["scenarios"].append({**run_scenario(trace, scenario, scale_up.label), "lead_s": scale_up.lead_s,
                                    "source": scale_up.source})
    primary = result["scenarios"][0]
    if settings.max_extra_replicas is None:  # the same replay with the library's default cap, for comparison
        capped = replace(settings, cold_start_s=first.start_s, lead_s=first.lead_s,
                         max_extra_replicas=PredictiveSpec().max_extra_replicas, forecasters=("auto",))
        run = run_policy(trace, capped, PREDICTIVE)
        primary["predictive_auto_capped"] = {"max_extra_replicas": capped.spec().max_extra_replicas,
                                             **run["figures"]}
    result["forecast_quality"] = primary.pop("forecast_quality")
    for scenario in result["scenarios"]:
        scenario.pop("forecast_quality", None)
        scenario["targets"] = targets(scenario)
    result["targets"] = primary["targets"]
    result["buckets"] = bucket_figures(trace, settings.max_context)
    result["forecaster_cost"] = forecaster_cost(trace, primary, replace(settings, lead_s=first.lead_s))
    result["wall_s"] = time.time() - started
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    chart = {"cold_start_s": primary["cold_start_s"], "timelines": primary.pop("timelines"),
             "forecasts": primary["forecasts"], "times": [r.t for r in trace.requests],
             "capacity_rps": None}
    for scenario in result["scenarios"][1:]:
        del scenario["timelines"], scenario["forecasts"]
    return result, chart


def describe_trace(trace: Trace, repeat: int) -> dict[str, Any]:
    times = np.array([r.t for r in trace.requests])
    prompts = [r.prompt for r in trace.requests]
    per_minute = np.bincount((times // 60).astype(int))
    per_10s = np.bincount((times // 10).astype(int))
    return {
        "source": trace.source,
        "repeat": repeat,
        "requests": len(trace.requests),
        "duration_s": trace.duration_s,
        "start_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(trace.epoch_start)),
        "mean_rps": len(trace.requests) / trace.duration_s if trace.duration_s else None,
        "peak_minute_rps": float(per_minute.max()) / 60,
        "peak_10s_rps": float(per_10s.max()) / 10,
        "idle_minutes": int(np.count_nonzero(per_minute == 0)),
        "prompt_p50": percentile(prompts, 50),
        "prompt_p90": percentile(prompts, 90),
        "prompt_p99": percentile(prompts, 99),
        "generated_p50": percentile([r.generated for r in trace.requests], 50),
    }


def _settings_json(settings: PredictBenchSettings) -> dict[str, Any]:
    return {
        "scale_ups": [asdict(s) for s in settings.scale_ups],
        "prefill_tokens_per_s": settings.prefill_tokens_per_s,
        "prefill_source": settings.prefill_source,
        "decode_tokens_per_s": settings.decode_tokens_per_s,
        "decode_source": settings.decode_source,
        "requests_per_pod": len(settings.speedups),
        "batch_speedups": list(settings.speedups),
        "min_warm": settings.min_warm,
        "max_replicas": settings.max_replicas,
        "max_extra_replicas": settings.spec().max_extra_replicas,
        "fixed_replicas": settings.fixed_replicas,
        "hpa": asdict(settings.hpa),
        "step_s": settings.step_s,
        "fast_loop": asdict(settings.fast),
        "feature_window_steps": 15,
        "retrain_every_steps": retrain_steps(settings, settings.step_s or 60),
        "forecasters": list(settings.forecasters),
        "max_context": settings.max_context,
        "memory": None if settings.memory is None else asdict(settings.memory),
    }


# --- one policy, one scenario -------------------------------------------------------------------


def run_policy(trace: Trace, settings: PredictBenchSettings, policy: str) -> dict[str, Any]:
    """Replay the trace under one policy; its figures and, for a predictive one, its forecasts.

    ``<policy>@minwarm<n>`` keeps n pods warm; every other scaled policy starts from zero."""
    base, _, suffix = policy.partition("@")
    min_warm = int(suffix[len(MIN_WARM_SUFFIX):]) if suffix.startswith(MIN_WARM_SUFFIX) else 0
    pool = PoolConfig(min_warm=min_warm, max_replicas=settings.max_replicas, cold_start_s=settings.cold_start_s,
                      wake_s=settings.wake_s)
    end = trace.duration_s
    observer: Predictive | None = None
    if base == FIXED:
        replicas = fixed_pool_size(trace, settings, "mean" if suffix == "mean" else "peak")
        sim = Simulation(trace.requests, settings.service,
                         replace(pool, min_warm=replicas, max_replicas=replicas, wake_s=None), FixedPool(replicas))
    elif base == REACTIVE:
        sim = Simulation(trace.requests, settings.service, pool, Reactive(settings.hpa))
    else:
        kind, _, only = base.partition(":")
        step_s = 60 if kind == STEP60.split(":")[0] else settings.step_s or 60
        config = replace(forecaster_config(step_s), only=None if only == "auto" else only,
                         retrain_every_steps=retrain_steps(settings, step_s))
        observer = Predictive(Reactive(settings.hpa), Forecaster(config), settings.spec(), trace.requests,
                              trace.epoch_start, lead_s=settings.lead_s, name=policy,
                              history=History(limits=limits_for(step_s)))
        controller: Predictive | BurstPredictive = observer
        if kind == "predictive":
            controller = BurstPredictive(observer, settings.fast, wake_lead_s=settings.wake_lead_s, name=policy)
        sim = Simulation(trace.requests, settings.service, pool, controller)
    sim.run(end)
    out: dict[str, Any] = {"figures": figures(sim, end, settings.memory), "timeline": sim.pod_timeline}
    if observer is not None:
        f = observer.forecaster
        out["figures"].update({
            "models_used": dict(Counter(p.model or "none" for p in observer.predictions)),
            "trainings": f.trainings,
            "cpu_train_s": f.cpu_train_s,
            "cpu_predict_s": f.cpu_predict_s,
            "forecast_steps": len(observer.predictions),
            "step_s": observer.step_s,
            "last_reason": observer.predictions[-1].reason if observer.predictions else None,
            "forecast_error": acted_forecast_error(observer.predictions, observer.history),
        })
        out["forecasts"] = [vars(x) for x in observer.forecasts]
        out["predictions"] = observer.predictions
        out["history"] = observer.history
    return out


def acted_forecast_error(predictions: Sequence[Prediction], history: History) -> dict[str, Any]:
    """The error of the forecast the policy acted on: each step's used forecast, for every horizon it
    was made for, against the peak that step then had (per second, so steps of any length compare)."""
    actual = {history.start + i: c for i, c in enumerate(history.peak_rates()) if c is not None}
    step = history.limits.step_s
    pairs = [(actual[p.last_step + f.horizon], f) for p in predictions for f in p.forecasts
             if p.last_step + f.horizon in actual]
    if not pairs:
        return {"pairs": 0}
    return {
        "pairs": len(pairs),
        "p50_mae_rps": sum(abs(a - f.p50) for a, f in pairs) / len(pairs) / step,
        "p90_coverage": sum(a <= f.p90 for a, f in pairs) / len(pairs),
        "mean_quantile_loss_rps": sum(quantile_loss(a, f) for a, f in pairs) / len(pairs) / step,
        "actual_mean_rps": sum(a for a, _ in pairs) / len(pairs) / step,
    }


def fixed_pool_size(trace: Trace, settings: PredictBenchSettings, sizing: str = "peak") -> int:
    """A fixed pool's replicas, sized the way a user without a forecast or an autoscaler sizes it from
    the traffic they have seen, within ``[min_warm, max_replicas]``:

    - ``peak`` (``none``): for the busiest minute: ⌈the most service seconds arriving in one clock minute
      ÷ 60 ÷ a full batch's speed-up⌉ pods (the pods that minute keeps busy, each serving a full batch;
      a service second is a request's served alone).  ``--fixed-replicas`` replaces it.
    - ``mean`` (``none@mean``): for the average: ⌈total service seconds ÷ duration ÷ the same speed-up⌉.
    """
    per_pod = settings.service.full_batch_speedup
    if sizing == "peak" and settings.fixed_replicas is not None:
        wanted = settings.fixed_replicas
    elif trace.duration_s <= 0:
        wanted = settings.min_warm
    elif sizing == "peak":
        per_minute: dict[int, float] = {}
        for r in trace.requests:
            minute = int(r.t // 60)
            per_minute[minute] = per_minute.get(minute, 0.0) + settings.service.service_s(r)
        wanted = math.ceil(max(per_minute.values()) / 60 / per_pod - 1e-9)
    elif sizing == "mean":
        wanted = math.ceil(sum(settings.service.service_s(r) for r in trace.requests) / trace.duration_s / per_pod
                           - 1e-9)
    else:
        raise ValueError(f"fixed pool sizing must be 'peak' or 'mean', got {sizing!r}")
    return max(settings.min_warm, min(settings.max_replicas, wanted))


def figures(sim: Simulation, end_s: float, memory: PodMemory | None = None) -> dict[str, Any]:
    """The replay's figures.  Pod-hours are what the pool holds: every pod from the moment it is asked
    for to its stop, asleep or awake (a sleeping pod keeps its accelerator); awake pod-hours beside them."""
    served = sim.served
    ttfts = [s.ttft_s for s in served]
    first = [s.ttft_s for s in served if s.first_on_new_pod]
    by_arrival = sorted((s.arrival, s.ttft_s) for s in served)
    after_lull = [ttft for i, (t, ttft) in enumerate(by_arrival) if i == 0 or t - by_arrival[i - 1][0] >= LULL_S]
    missed = sum(not s.warm_hit for s in served)
    return {
        "requests": len(served),
        "no_warm_capacity": missed,
        "no_warm_capacity_share": missed / len(served) if served else None,
        "warm_hit_rate": 1 - missed / len(served) if served else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "ttft_p99_s": percentile(ttfts, 99),
        "first_request_count": len(after_lull),
        "first_request_p50_s": percentile(after_lull, 50),
        "first_request_p95_s": percentile(after_lull, 95),
        "new_pod_first_count": len(first),
        "new_pod_first_p95_s": percentile(first, 95),
        **held_hours(sim, end_s, memory),
        "pods_started": sum(not p.initial for p in sim.pods),
        "max_pods": max((asked for _, _, asked in sim.pod_timeline), default=0),
    }


def held_hours(sim: Simulation, end_s: float, memory: PodMemory | None) -> dict[str, Any]:
    """Pod-hours held (asleep or awake: a sleeping pod keeps its accelerator), awake pod-hours, and the
    accelerator memory they hold in GiB-hours (a sleeping pod's at its measured asleep size)."""
    held = sim.pod_seconds(end_s) / 3600
    asleep = min(held, sim.asleep_seconds() / 3600)
    awake = held - asleep
    gib_hours = None if memory is None else (awake * memory.awake_bytes + asleep * memory.asleep_bytes) / 2**30
    return {"pod_hours": held, "awake_pod_hours": awake, "asleep_pod_hours": asleep, "memory_gib_hours": gib_hours}


def run_scenario(trace: Trace, settings: PredictBenchSettings, label: str) -> dict[str, Any]:
    warm = f"@{MIN_WARM_SUFFIX}{max(1, settings.min_warm)}"
    policies = [*BASELINE_NAMES, REACTIVE + warm, *(f"predictive:{name}" for name in settings.forecasters)]
    if "auto" in settings.forecasters:
        policies += [PREDICTIVE + warm, STEP60]
    runs = {policy: run_policy(trace, settings, policy) for policy in policies}
    scenario: dict[str, Any] = {
        "cold_start_s": settings.cold_start_s,
        "wake_s": settings.wake_s,
        "label": label,
        "policies": {policy: run["figures"] for policy, run in runs.items()},
        "timelines": {policy: run["timeline"] for policy, run in runs.items()},
        "forecasts": {policy: run["forecasts"] for policy, run in runs.items() if "forecasts" in run},
    }
    auto = runs.get(PREDICTIVE)
    if auto is not None:
        scenario["forecast_quality"] = forecast_quality(auto["predictions"], auto["history"])
    return scenario


# --- forecast quality, targets, buckets, cost --------------------------------------------------------


def forecast_quality(predictions: Sequence[Prediction], history: History) -> dict[str, Any]:
    """Each candidate's mean quantile loss and p50 absolute error over the replay, on common steps, against
    what they forecast (each step's peak: :meth:`~warmpool_operator.rules.forecast.history.History.peak_rates`)."""
    actual = {history.start + i: c for i, c in enumerate(history.peak_rates()) if c is not None}
    made: dict[str, dict[tuple[int, int], QuantileForecast]] = {}
    for prediction in predictions:
        for name, forecasts in prediction.candidates.items():
            for f in forecasts:
                target = prediction.last_step + f.horizon
                if target in actual:
                    made.setdefault(name, {})[(prediction.last_step, f.horizon)] = f
    out: dict[str, Any] = {"per_candidate": {}, "note": f"peaks (the busiest sub-step scaled to the step) per "
                           f"{history.limits.step_s} s step, in requests per step; losses over the steps every "
                           "listed candidate forecast (LightGBM only joins once it is trained)"}
    if not made:
        return out
    common = set.intersection(*(set(m) for m in made.values()))
    keys = sorted(common)
    for name, by_origin in sorted(made.items()):
        pairs = [(float(actual[origin + h]), by_origin[(origin, h)]) for origin, h in keys]
        out["per_candidate"][name] = {
            "forecasts": len(by_origin),
            "common_steps": len(pairs),
            "mean_quantile_loss": sum(quantile_loss(a, f) for a, f in pairs) / len(pairs) if pairs else None,
            "p50_mae": sum(abs(a - f.p50) for a, f in pairs) / len(pairs) if pairs else None,
            "p90_coverage": sum(a <= f.p90 for a, f in pairs) / len(pairs) if pairs else None,
        }
    return out


TARGETS_TEXT = {
    "no_warm_capacity_ratio_vs_reactive": "requests without warm capacity, predictive ÷ reactive-from-zero ≤ 0.2",
    "first_request_p95_reduction_vs_reactive": "first request after a lull, P95, ≥ 50 % lower than "
                                               "reactive-from-zero",
    "warm_hit_points_vs_reactive": "warm-hit rate, predictive minus reactive-from-zero ≥ +20 points",
    "pod_hours_ratio_vs_reactive": "pod-hours, predictive ÷ reactive-from-zero ≤ 1.25",
    "pod_hours_ratio_vs_fixed": "pod-hours, predictive ÷ fixed pool ≤ 0.6, at ≥ 95 % of its warm hits",
}


def targets(scenario: dict[str, Any], policy: str = PREDICTIVE, reactive_policy: str = REACTIVE,
            fixed_policy: str = FIXED) -> dict[str, Any]:
    """The predictive targets: ``policy`` against reactive from zero and against the fixed pool (the live
    bench names its pools apart).  ``first_request_never_empty_reduction``: how much lower the fixed pool's
    first request after a lull is than reactive's, the most any pre-warm could gain on that figure (a pool
    that is never empty still prefills the request)."""
    p = scenario["policies"][policy]
    reactive, fixed = scenario["policies"][reactive_policy], scenario["policies"][fixed_policy]
    missed = ratio(p["no_warm_capacity"], reactive["no_warm_capacity"])
    first = ratio(p["first_request_p95_s"], reactive["first_request_p95_s"])
    hits = (100 * (p["warm_hit_rate"] - reactive["warm_hit_rate"])
            if p["warm_hit_rate"] is not None and reactive["warm_hit_rate"] is not None else None)
    vs_fixed = ratio(p["pod_hours"], fixed["pod_hours"])
    hits_share = ratio(p["warm_hit_rate"], fixed["warm_hit_rate"])
    values = {
        "no_warm_capacity_ratio_vs_reactive": missed,
        "first_request_p95_reduction_vs_reactive": None if first is None else 1 - first,
        "warm_hit_points_vs_reactive": hits,
        "pod_hours_ratio_vs_reactive": ratio(p["pod_hours"], reactive["pod_hours"]),
        "pod_hours_ratio_vs_fixed": vs_fixed,
    }
    met = {
        "no_warm_capacity_ratio_vs_reactive": missed is not None and missed <= 0.2,
        "first_request_p95_reduction_vs_reactive": first is not None and 1 - first >= 0.5,
        "warm_hit_points_vs_reactive": hits is not None and hits >= 20,
        "pod_hours_ratio_vs_reactive": values["pod_hours_ratio_vs_reactive"] is not None
        and values["pod_hours_ratio_vs_reactive"] <= 1.25,
        "pod_hours_ratio_vs_fixed": vs_fixed is not None and vs_fixed <= 0.6
        and hits_share is not None and hits_share >= 0.95,
    }
    never_empty = ratio(fixed["first_request_p95_s"], reactive["first_request_p95_s"])
    return {"policy": policy, "cold_start_s": scenario["cold_start_s"], "warm_hit_share_of_fixed": hits_share,
            "first_request_never_empty_reduction": None if never_empty is None else 1 - never_empty,
            "figures": {k: {"value": v, "met": met[k], "target": TARGETS_TEXT[k]} for k, v in values.items()}}


def bucket_figures(trace: Trace, max_context: int) -> dict[str, Any]:
    """Learned buckets on the whole trace and learned on its first half, scored on its second half."""
    prompts = [r.prompt for r in trace.requests]
    half = len(prompts) // 2

    def share(buckets: Sequence[int], lengths: Sequence[int]) -> float | None:
        return sum(n <= max(buckets) for n in lengths) / len(lengths) if lengths and buckets else None

    whole = learn_buckets(histogram(prompts), max_context)
    held = learn_buckets(histogram(prompts[:half]), max_context)
    return {
        "max_context": max_context,
        "defaults": list(DEFAULT_BUCKETS),
        "learned": list(whole.buckets),
        "learned_prompts_per_bucket": list(whole.prompts_per_bucket),
        "learned_longer_than_all": whole.longer_than_all,
        "learned_reason": whole.reason,
        "share_within_defaults": share(DEFAULT_BUCKETS, prompts),
        "share_within_learned": share(whole.buckets, prompts),
        "held_out": {
            "learned_on_first_half": list(held.buckets),
            "share_within_learned_second_half": share(held.buckets, prompts[half:]),
            "share_within_defaults_second_half": share(DEFAULT_BUCKETS, prompts[half:]),
        },
        "note": "share = prompts no longer than the largest warmed length (a warmed length covers them)",
    }


def forecaster_cost(trace: Trace, scenario: dict[str, Any], settings: PredictBenchSettings) -> dict[str, Any]:
    """CPU seconds per WarmModel per hour: on the replay, and projected for a full history."""
    auto = scenario["policies"][PREDICTIVE]
    hours = trace.duration_s / 3600
    on_trace = (auto["cpu_train_s"] + auto["cpu_predict_s"]) / hours if hours else None
    projected = full_history_cost(trace, settings)
    per_hour = projected["cpu_s_per_hour"]
    return {
        "on_trace_cpu_s_per_model_hour": on_trace,
        "on_trace_note": "the replay's forecaster: short history, so few training rows",
        "full_history": projected,
        "percent_of_one_core_per_100_models": 100 * 100 * per_hour / 3600,
        "target": "≤ 5 % of one core per 100 WarmModels",
        "met": 100 * 100 * per_hour / 3600 <= 5,
    }


def tiled_coarse(history: History, counts: np.ndarray[Any, Any], peaks: np.ndarray[Any, Any]) -> History | None:
    """A full coarse tier for ``history`` (ending where its fine steps end): the trace's whole coarse steps,
    rolled up from its per-step ``counts`` and ``peaks`` as the history rolls them up, tiled."""
    limits = history.limits.coarse
    k = limits.step_s // history.limits.step_s if limits is not None else 0
    groups = len(counts) // k if k else 0
    if limits is None or not groups:  # no coarse tier, or a trace shorter than one coarse step
        return None
    rolled = counts[:groups * k].reshape(groups, k).sum(axis=1)
    busiest = np.maximum(counts, peaks)[:groups * k].reshape(groups, k).max(axis=1) * k
    index = np.resize(np.arange(groups), limits.points)
    zeros = [0] * limits.points
    return History(limits=limits, start=history.end // k - limits.points, requests=rolled[index].tolist(),
                   prompt_tokens=zeros, generated_tokens=list(zeros), peak_requests=busiest[index].tolist())


def retrain_steps(settings: PredictBenchSettings, step_s: int) -> int:
    """The steps between trainings: the settings', else the operator's for ``step_s``."""
    return settings.retrain_every_steps or forecaster_config(step_s).retrain_every_steps


def full_history_cost(trace: Trace, settings: PredictBenchSettings, predictions: int = 30) -> dict[str, Any]:
    """Train once and predict ``predictions`` times on a full history (its fine steps and four weeks of
    coarse ones, with the daily and weekly features they turn on): the trace's per-step counts and
    peaks tiled (a cost figure only: the rows and features are what cost, not the values)."""
    step = settings.step_s or 60
    times = np.array([r.t for r in trace.requests])
    counts = np.bincount((times // step).astype(int))
    width = min(PEAK_SUBSTEP_S, step)
    sub = np.bincount((times // width).astype(int), minlength=len(counts) * step // width)
    peaks = [peak_of(sub[k * step // width:(k + 1) * step // width].tolist(), step, width)
             for k in range(len(counts))]
    history = History(limits=limits_for(step))
    first = int(trace.epoch_start // step)
    index = np.resize(np.arange(len(counts)), history.limits.points)
    for offset, k in enumerate(index.tolist()):
        history.record(first + offset, StepObservation(requests=int(counts[k]), peak_requests=peaks[k]))
    history.coarse = tiled_coarse(history, counts, np.asarray(peaks))
    wanted = horizons(settings.lead_s, step)
    retrain = retrain_steps(settings, step)
    forecaster = Forecaster(replace(forecaster_config(step), retrain_every_steps=retrain))
    seasonal = forecaster.seasonal(history.coarse)
    forecaster.maybe_train(history, wanted, seasonal)
    train_s = forecaster.cpu_train_s
    forecaster.predict(history, wanted, seasonal)  # the first scores the baselines on the history: once per start
    forecaster.cpu_predict_s = 0.0
    for _ in range(predictions):
        forecaster.predict(history, wanted, seasonal)
    predict_s = forecaster.cpu_predict_s / predictions
    # One forecast per step, one training per `retrain` steps.
    per_hour = train_s * (3600 / step / retrain) + predict_s * (3600 / step)
    return {
        "steps": len(history),
        "features": list(forecaster.model.features.names) if forecaster.model else [],
        "train_cpu_s": train_s,
        "predict_cpu_s": predict_s,
        "retrain_every_steps": retrain,
        "cpu_s_per_hour": per_hour,
        "train_reason": forecaster.train_reason,
        "coarse_steps": len(history.coarse) if history.coarse is not None else 0,
        "note": f"one thread; the trace's per-{step} s counts and peaks tiled to the 10,080 fine steps a history "
                "holds for the row count, and its 5 min ones to the coarse tier's four weeks; the model forecasts "
                "peaks with the count features beside them",
    }

