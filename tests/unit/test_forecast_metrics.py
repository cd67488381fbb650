"""The operator's forecast gauges (#17's forecast panel) follow status.forecast, and go when the
figure is unknown, prediction is turned off, or the WarmModel's reconciler stops (it was deleted).

The figures come from :func:`warmpool_operator.rules.forecast.report.report`, the function that builds
status.forecast, and are read back from the operator's real Prometheus registry.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client
from prometheus_client import REGISTRY
from warmpool_operator.api.types import parse_spec
from warmpool_operator.control.reconciler import Reconciler
from warmpool_operator.control.shared import Shared
from warmpool_operator.io import metrics
from warmpool_operator.io.kube import Kube
from warmpool_operator.io.scrape_scheduler import ScrapeScheduler
from warmpool_operator.io.watch_cache import Cache
from warmpool_operator.io.worker_client import WorkerClient
from warmpool_operator.rules import scaling
from warmpool_operator.rules.forecast import report as ps
from warmpool_operator.rules.forecast.baselines import QuantileForecast
from warmpool_operator.rules.forecast.decision import LeadSource, LeadTime
from warmpool_operator.rules.forecast.forecaster import Prediction

from warmpool.contract.metrics import (
    FORECAST_QUANTILE_P50,
    FORECAST_QUANTILE_P90,
    LABEL_NAMESPACE,
    LABEL_QUANTILE,
    LABEL_WARMMODEL,
    METRIC_OPERATOR_FORECAST_CAPACITY_PER_POD,
    METRIC_OPERATOR_FORECAST_DESIRED_REPLICAS,
    METRIC_OPERATOR_FORECAST_PEAK,
    METRIC_OPERATOR_FORECAST_RATE_NOW,
)

pytestmark = pytest.mark.unit

RATE_NOW = METRIC_OPERATOR_FORECAST_RATE_NOW
P50 = f"{METRIC_OPERATOR_FORECAST_PEAK} p50"
P90 = f"{METRIC_OPERATOR_FORECAST_PEAK} p90"
CAPACITY = METRIC_OPERATOR_FORECAST_CAPACITY_PER_POD
DESIRED = METRIC_OPERATOR_FORECAST_DESIRED_REPLICAS
STEP_S = 60
LEAD = LeadTime(25.0, LeadSource.COLD_START)


def figures(namespace: str, name: str) -> dict[str, float | None]:
    """Each forecast series of the WarmModel as the registry exposes it (None: no such series)."""
    labels = {LABEL_NAMESPACE: namespace, LABEL_WARMMODEL: name}

    def quantile(q: str) -> float | None:
        return REGISTRY.get_sample_value(METRIC_OPERATOR_FORECAST_PEAK,
                                         {**labels, LABEL_QUANTILE: q})

    return {RATE_NOW: REGISTRY.get_sample_value(RATE_NOW, labels), P50: quantile(FORECAST_QUANTILE_P50),
            P90: quantile(FORECAST_QUANTILE_P90), CAPACITY: REGISTRY.get_sample_value(CAPACITY, labels),
            DESIRED: REGISTRY.get_sample_value(DESIRED, labels)}


def report(p90_per_step: float, capacity_rps: float | None, last_count: int) -> Any:
    """status.forecast for a forecast of ``p90_per_step`` requests per step (p50 half of it)."""
    spec = parse_spec({"model": {"pvc": {"claimName": "m"}},
                       "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": 6, "predictive": {"enabled": False}}})
    prediction = Prediction(9, "ewma", "lowest recent quantile loss",
                            (QuantileForecast(horizon=1, p50=p90_per_step / 2, p90=p90_per_step),), {}, 1.0)
    decision = scaling.predictive_decision(spec, p90_per_step, STEP_S, capacity_rps, autoscaler_present=False)
    return ps.report(enabled=False, loaded=True, prediction=prediction, decision=decision, lead=LEAD, step_s=STEP_S,
                     history_steps=10, last_count=last_count, capacity_rps=capacity_rps, last_problem=None).forecast


def test_the_gauges_follow_status_forecast_and_an_unknown_figure_has_no_series() -> None:
    forecast = report(240.0, 1.5, last_count=90)
    metrics.show_forecast("ns-a", "follow", forecast)
    # 240 requests per 60 s step: p90 4 req/s, p50 2 req/s; 90 in the last step: 1.5 req/s now;
    # 4 req/s over 1.5 req/s per pod: 3 pods (what status.forecast says, in shadow mode too).
    assert figures("ns-a", "follow") == {
        RATE_NOW: 1.5,
        P50: 2.0,
        P90: 4.0,
        CAPACITY: 1.5,
        DESIRED: 3.0,
    }
    # The next pass's forecast replaces the figures.
    metrics.show_forecast("ns-a", "follow", report(600.0, 1.5, last_count=300))
    got = figures("ns-a", "follow")
    assert got[P90] == 10.0
    assert got[RATE_NOW] == 5.0
    # 10 req/s over 1.5 per pod is 7 pods; maxExtraReplicas (default 4) holds it to replicas + 4.
    assert got[DESIRED] == 5.0
    # Capacity not measured (e.g. after a restart): no capacity, and the desired count is the one pod a
    # forecast request needs (the reactive count here), never the old figures.
    unmeasured = report(600.0, None, last_count=300)
    assert unmeasured.capacity_per_pod is None and unmeasured.desired_replicas == 1
    metrics.show_forecast("ns-a", "follow", unmeasured)
    got = figures("ns-a", "follow")
    assert got[CAPACITY] is None
    assert got[DESIRED] == 1.0
    assert got[P90] == 10.0
    # Prediction turned off (a pass reports no status.forecast): every series goes.
    metrics.show_forecast("ns-a", "follow", None)
    assert set(figures("ns-a", "follow").values()) == {None}


def test_the_gauges_go_with_the_warmmodels_reconciler_and_only_its_own() -> None:
    async def scenario() -> tuple[dict[str, float | None], dict[str, float | None]]:
        async with aiohttp.ClientSession() as session:
            # Real objects, never used by stop(): the reconciler is not started, so no pass talks to an API server.
            api = client.ApiClient()
            try:
                workers = WorkerClient(session, 1.0)
                rec = Reconciler({"metadata": {"namespace": "ns-b", "name": "gone", "uid": "u-1"}},
                                 Shared(Kube(api), workers, ScrapeScheduler(workers, 1.0, 1)),
                                 Cache(children={}, replicasets={}, pods={}))  # type: ignore[arg-type]
                for name in ("gone", "stays"):
                    metrics.show_forecast("ns-b", name, report(240.0, 1.5, last_count=90))
                await rec.stop()  # what the registry does when the WarmModel is deleted
            finally:
                await api.close()
        return figures("ns-b", "gone"), figures("ns-b", "stays")

    gone, stays = asyncio.run(scenario())
    assert set(gone.values()) == {None}
    assert stays[P90] == 4.0
    metrics.forget_forecast("ns-b", "stays")
    assert set(figures("ns-b", "stays").values()) == {None}
