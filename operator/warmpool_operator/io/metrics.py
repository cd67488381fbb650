"""The operator's own Prometheus metrics (names from :mod:`warmpool.contract`).

Served by ``prometheus_client``'s HTTP server on ``--metrics-port``; the default registry is
used on purpose: it is the operator process's only registry, and it carries the process
collector (CPU, memory, open files) for free.
"""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from warmpool.contract.metrics import (
    FORECAST_QUANTILE_P50,
    FORECAST_QUANTILE_P90,
    LABEL_KIND,
    LABEL_NAMESPACE,
    LABEL_QUANTILE,
    LABEL_REASON,
    LABEL_SCOPE,
    LABEL_TARGET,
    LABEL_TIER,
    LABEL_WARMMODEL,
    METRIC_OPERATOR_DEGRADED,
    METRIC_OPERATOR_FORECAST_CAPACITY_PER_POD,
    METRIC_OPERATOR_FORECAST_DESIRED_REPLICAS,
    METRIC_OPERATOR_FORECAST_PEAK,
    METRIC_OPERATOR_FORECAST_RATE_NOW,
    METRIC_OPERATOR_MIN_WARM_PODS,
    METRIC_OPERATOR_RECONCILE_ERRORS,
    METRIC_OPERATOR_RECONCILE_SECONDS,
    METRIC_OPERATOR_SCRAPE_FAILURES,
    METRIC_OPERATOR_SCRAPE_ROUNDS_CUT,
    METRIC_OPERATOR_TIER_DECISIONS,
    METRIC_OPERATOR_WARM_PODS,
    METRIC_OPERATOR_WRITE_FAILURES,
)
from warmpool_operator.api.types import ForecastStatus

#: Values of WRITE_FAILURES' target label.
WRITE_POD_ANNOTATION = "pod_annotation"
WRITE_HEAT_MAP = "heat_map"

RECONCILE_SECONDS = Histogram(
    METRIC_OPERATOR_RECONCILE_SECONDS,
    "Seconds one reconcile of a WarmModel took (children, scrape, gating and status)",
    [LABEL_KIND],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
RECONCILE_ERRORS = Counter(
    METRIC_OPERATOR_RECONCILE_ERRORS,
    "Reconciles that failed, by kind and reason (temporary, permanent, ...)",
    [LABEL_KIND, LABEL_REASON],
)
SCRAPE_FAILURES = Counter(
    METRIC_OPERATOR_SCRAPE_FAILURES,
    "Worker /metrics scrapes that gave no usable figure, by reason",
    [LABEL_REASON],
)
TIER_DECISIONS = Counter(
    METRIC_OPERATOR_TIER_DECISIONS,
    "Tier decisions taken per pod or node and tier",
    [LABEL_SCOPE, LABEL_TIER],
)
WRITE_FAILURES = Counter(
    METRIC_OPERATOR_WRITE_FAILURES,
    "Best-effort writes that failed and were skipped (the reconcile carried on), by target",
    [LABEL_TARGET],
)
SCRAPE_ROUNDS_CUT = Counter(
    METRIC_OPERATOR_SCRAPE_ROUNDS_CUT,
    "Scrape rounds cancelled at their time bound (a pool's scrape or pass hung), with what was still running",
)
WARM_PODS = Gauge(
    METRIC_OPERATOR_WARM_PODS,
    "Worker pods verified warm, per WarmModel",
    [LABEL_NAMESPACE, LABEL_WARMMODEL],
)
MIN_WARM_PODS = Gauge(
    METRIC_OPERATOR_MIN_WARM_PODS,
    "The WarmModel's pool.minWarm (warm pods it asks for)",
    [LABEL_NAMESPACE, LABEL_WARMMODEL],
)

DEGRADED = Gauge(
    METRIC_OPERATOR_DEGRADED,
    "1 while the WarmModel's last pass failed for good, labelled with its Degraded reason; 0 (no reason) once "
    "a pass succeeds",
    [LABEL_NAMESPACE, LABEL_WARMMODEL, LABEL_REASON],
)

_PER_WARMMODEL = [LABEL_NAMESPACE, LABEL_WARMMODEL]
FORECAST_RATE_NOW = Gauge(
    METRIC_OPERATOR_FORECAST_RATE_NOW,
    "Demand prediction: mean requests per second over the last closed history step (status.forecast.rateNow)",
    _PER_WARMMODEL,
)
FORECAST_PEAK = Gauge(
    METRIC_OPERATOR_FORECAST_PEAK,
    "Demand prediction: forecast of a step's peak requests per second one lead time ahead, by quantile: "
    "0.5 (status.forecast.predictedRateP50) and 0.9 (status.forecast.predictedRate, what the pool is sized "
    "for); the step's mean where the history holds no peaks",
    [*_PER_WARMMODEL, LABEL_QUANTILE],
)
FORECAST_CAPACITY_PER_POD = Gauge(
    METRIC_OPERATOR_FORECAST_CAPACITY_PER_POD,
    "Demand prediction: requests per second one pod serves while busy, measured (status.forecast.capacityPerPod)",
    _PER_WARMMODEL,
)
FORECAST_DESIRED_REPLICAS = Gauge(
    METRIC_OPERATOR_FORECAST_DESIRED_REPLICAS,
    "Demand prediction: pods the forecast asks for (status.forecast.desiredReplicas; acted on only when "
    "spec.pool.predictive.enabled)",
    _PER_WARMMODEL,
)
#: The per-WarmModel forecast gauges, each with the quantile it is of (None: no quantile label).
_FORECAST_GAUGES: tuple[tuple[Gauge, str | None], ...] = (
    (FORECAST_RATE_NOW, None),
    (FORECAST_PEAK, FORECAST_QUANTILE_P50),
    (FORECAST_PEAK, FORECAST_QUANTILE_P90),
    (FORECAST_CAPACITY_PER_POD, None),
    (FORECAST_DESIRED_REPLICAS, None),
)


def show_forecast(namespace: str, warmmodel: str, forecast: ForecastStatus | None) -> None:
    """Mirror a pass's status.forecast in the gauges: a figure that is unset (not known yet, or
    prediction off: ``forecast`` None) loses its series rather than keep a stale value."""
    figures = (None, None, None, None, None) if forecast is None else (
        forecast.rate_now, forecast.predicted_rate_p50, forecast.predicted_rate, forecast.capacity_per_pod,
        forecast.desired_replicas)
    for (gauge, quantile), value in zip(_FORECAST_GAUGES, figures, strict=True):
        labels = (namespace, warmmodel) if quantile is None else (namespace, warmmodel, quantile)
        if value is None:
            _remove(gauge, labels)
        else:
            gauge.labels(*labels).set(value)


def forget_forecast(namespace: str, warmmodel: str) -> None:
    """The WarmModel is gone (or no longer ours): its forecast series go with it."""
    for gauge, quantile in _FORECAST_GAUGES:
        _remove(gauge, (namespace, warmmodel) if quantile is None else (namespace, warmmodel, quantile))


def show_degraded(namespace: str, warmmodel: str, reason: str | None) -> None:
    """A pass's verdict in DEGRADED: 1 with the reason it failed for good (``reason``, one of the
    status module's fixed Degraded reasons, so the label stays bounded), or 0 with no reason.  The
    WarmModel keeps exactly one series: a reason it no longer has goes."""
    current = reason or ""
    for stale in _degraded_reasons(namespace, warmmodel) - {current}:
        _remove(DEGRADED, (namespace, warmmodel, stale))
    DEGRADED.labels(namespace, warmmodel, current).set(1 if reason else 0)


def show_failed_pass(namespace: str, warmmodel: str, min_warm: int | None) -> None:
    """A pass that failed before it counted the pool's pods still leaves the pool's gauges: its warm
    count as last seen (0 before any count) and, when the spec parsed, its minWarm, so the
    below-minWarm alert sees a WarmModel that never made its children."""
    WARM_PODS.labels(namespace, warmmodel)  # creates the series at 0; keeps a count already shown
    if min_warm is not None:
        MIN_WARM_PODS.labels(namespace, warmmodel).set(min_warm)


def forget_degraded(namespace: str, warmmodel: str) -> None:
    """The WarmModel is gone (or no longer ours): its DEGRADED series goes with it."""
    for reason in _degraded_reasons(namespace, warmmodel):
        _remove(DEGRADED, (namespace, warmmodel, reason))


def _degraded_reasons(namespace: str, warmmodel: str) -> set[str]:
    return {sample.labels[LABEL_REASON] for family in DEGRADED.collect() for sample in family.samples
            if sample.labels[LABEL_NAMESPACE] == namespace and sample.labels[LABEL_WARMMODEL] == warmmodel}


def _remove(gauge: Gauge, labels: tuple[str, ...]) -> None:
    # Older prometheus_client versions raise KeyError when there is no such series: nothing to drop.
    with contextlib.suppress(KeyError):
        gauge.remove(*labels)


def serve(port: int, host: str) -> None:
    """Start the metrics endpoint in a background thread (port 0: not at all)."""
    if port > 0:
        start_http_server(port, addr=host)
