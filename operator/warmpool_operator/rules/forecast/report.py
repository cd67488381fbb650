"""What demand prediction reports in a WarmModel's status (pure): ``status.forecast``,
``status.learnedBuckets`` and the ``Predictive`` condition, whose reason says why the pool is
sized by the forecast or, when it is not, why it scales reactively."""

from __future__ import annotations

import math
from dataclasses import dataclass

from warmpool_operator.api.types import ForecastStatus, LearnedBucketsStatus
from warmpool_operator.rules.forecast.buckets import LearnedBuckets
from warmpool_operator.rules.forecast.decision import Decision, LeadSource, LeadTime
from warmpool_operator.rules.forecast.forecaster import Prediction

# The Predictive condition's reasons (CamelCase, one word each).
REASON_PRE_WARMING = "PreWarming"  # True: the forecast asks for more pods than the reactive count
REASON_FORECASTING = "Forecasting"  # forecasting; the reactive count is enough for now
REASON_SHADOW = "ShadowOnly"  # spec.pool.predictive.enabled false: forecast reported, not acted on
REASON_HISTORY_LOADING = "HistoryLoading"
REASON_NO_FORECAST_YET = "NoForecastYet"
#: The workers' request metrics are missing or garbage: reactive scaling only.
REASON_REQUEST_METRICS_UNAVAILABLE = "RequestMetricsUnavailable"
REASON_CAPACITY_NOT_MEASURED = "CapacityNotMeasured"


@dataclass(frozen=True)
class Verdict:
    """The Predictive condition: status ("True"/"False"), reason and message."""

    status: str
    reason: str
    message: str


@dataclass(frozen=True)
class Report:
    forecast: ForecastStatus
    verdict: Verdict


def _rate(count: float | None, step_s: int) -> float | None:
    if count is None or not math.isfinite(count):
        return None
    return round(max(0.0, count) / step_s, 4)


def report(*, enabled: bool, loaded: bool, prediction: Prediction | None, decision: Decision | None,
           lead: LeadTime, step_s: int, history_steps: int, last_count: int | None, capacity_rps: float | None,
           last_problem: str | None, step_reason: str | None = None, history_step_s: int | None = None,
           fast_loop: str | None = None) -> Report:
    """status.forecast and the Predictive condition from this pass's forecast and decision
    (``step_s``: the forecast's step; ``step_reason``: why; ``history_step_s``: the history's
    resolution, status.forecast.stepSeconds, when it differs; ``fast_loop``: what the fast loop
    beside the forecast asked for, when it asked for more)."""
    forecast = ForecastStatus(
        rate_now=_rate(last_count, step_s),
        predicted_rate=_rate(prediction.p90, step_s) if prediction is not None else None,
        predicted_rate_p50=_rate(prediction.p50, step_s) if prediction is not None else None,
        horizon_seconds=round(lead.seconds, 3),
        lead_time_source=lead.source.value,
        model=prediction.model if prediction is not None else None,
        recent_error=(round(prediction.recent_loss, 4)
                      if prediction is not None and prediction.recent_loss is not None
                      and math.isfinite(prediction.recent_loss) else None),
        capacity_per_pod=round(capacity_rps, 4) if capacity_rps is not None and math.isfinite(capacity_rps) else None,
        desired_replicas=decision.replicas if decision is not None and decision.predicted is not None else None,
        history_steps=history_steps,
        step_seconds=history_step_s or step_s,
        reason=_reason(prediction, decision, lead, step_s, capacity_rps, step_reason, fast_loop)[:1024],
    )
    return Report(forecast, _verdict(enabled, loaded, prediction, decision, capacity_rps, last_problem))


def _reason(prediction: Prediction | None, decision: Decision | None, lead: LeadTime, step_s: int,
            capacity_rps: float | None, step_reason: str | None = None, fast_loop: str | None = None) -> str:
    """What the policy expects next and why: the forecast (for which seconds ahead), the capacity per
    pod and the lead time it plans with, the pods that makes, then the forecaster's and the decision's
    own words, and last why the step is what it is."""
    parts = []
    if prediction is not None and prediction.p90 is not None and math.isfinite(prediction.p90):
        ahead = f"{lead.seconds:.3g}-{lead.seconds + step_s:.3g} s ahead"
        expects = (f"expects up to {max(0.0, prediction.p90) / step_s:.3g} req/s (p90; p50 "
                   f"{max(0.0, prediction.p50 or 0.0) / step_s:.3g}) {ahead}, the lead time being "
                   f"{_LEAD_WORDS[lead.source]} ({lead.seconds:.3g} s)")
        if capacity_rps is not None and math.isfinite(capacity_rps) and capacity_rps > 0:
            expects += f"; at {capacity_rps:.3g} req/s per pod"
            if decision is not None and decision.predicted is not None:
                expects += f" that is {decision.predicted} pods"
        else:
            expects += "; per-pod capacity not measured yet"
        parts.append(expects)
    if prediction is not None:
        parts.append(f"{prediction.model or 'no model'}: {prediction.reason}")
    if decision is not None:
        parts.append(decision.reason)
    if fast_loop:
        parts.append(fast_loop)
    if step_reason:
        parts.append(f"step: {step_reason}")
    return "; ".join(parts) or "no forecast yet"


#: How status words each lead time's source.
_LEAD_WORDS = {
    LeadSource.WAKE: "a sleeping pod's p95 wake",
    LeadSource.COLD_START: "a new pod's p95 cold start",
    LeadSource.HORIZON: "spec.pool.predictive.horizonSeconds (no cold start measured yet)",
}


def _verdict(enabled: bool, loaded: bool, prediction: Prediction | None, decision: Decision | None,
             capacity_rps: float | None, last_problem: str | None) -> Verdict:
    if not loaded:
        return Verdict("False", REASON_HISTORY_LOADING, "loading the stored request history: reactive meanwhile")
    if prediction is not None and prediction.model is None and last_problem is not None:
        return Verdict("False", REASON_REQUEST_METRICS_UNAVAILABLE,
                       f"{prediction.reason} ({last_problem}): the pool scales reactively (replicas, minWarm)")
    if prediction is None or prediction.p90 is None:
        why = prediction.reason if prediction is not None else "the first history steps are being recorded"
        return Verdict("False", REASON_NO_FORECAST_YET, f"no forecast yet ({why}): reactive meanwhile")
    if capacity_rps is None and (decision is None or decision.predicted is None):
        return Verdict("False", REASON_CAPACITY_NOT_MEASURED, "per-pod capacity not measured yet (no request "
                       "served and timed): reactive meanwhile")
    why = decision.reason if decision is not None else ""
    if not enabled:
        return Verdict("False", REASON_SHADOW, f"spec.pool.predictive.enabled is false: not acted on ({why})")
    if decision is not None and decision.acted:
        return Verdict("True", REASON_PRE_WARMING, f"{prediction.model}: {why}")
    return Verdict("True", REASON_FORECASTING, f"{prediction.model}: {why}")


def learned_status(learned: LearnedBuckets) -> LearnedBucketsStatus:
    return LearnedBucketsStatus(
        buckets=list(learned.buckets) or None,
        prompts_per_bucket=list(learned.prompts_per_bucket) or None,
        longer_than_all=learned.longer_than_all if learned.learned else None,
        observed=learned.observed,
        reason=learned.reason[:1024],
    )
