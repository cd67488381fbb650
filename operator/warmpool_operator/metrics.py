"""The operator's own Prometheus metrics (names from :mod:`warmpool.contract`).

Served by ``prometheus_client``'s HTTP server on ``--metrics-port``; the default registry is
used on purpose: it is the operator process's only registry, and it carries the process
collector (CPU, memory, open files) for free.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from warmpool import contract

#: Values of WRITE_FAILURES' target label.
WRITE_POD_ANNOTATION = "pod_annotation"
WRITE_HEAT_MAP = "heat_map"

RECONCILE_SECONDS = Histogram(
    contract.METRIC_OPERATOR_RECONCILE_SECONDS,
    "Seconds one reconcile of a WarmModel took (children, scrape, gating and status)",
    [contract.LABEL_KIND],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
RECONCILE_ERRORS = Counter(
    contract.METRIC_OPERATOR_RECONCILE_ERRORS,
    "Reconciles that failed, by kind and reason (temporary, permanent, ...)",
    [contract.LABEL_KIND, contract.LABEL_REASON],
)
SCRAPE_FAILURES = Counter(
    contract.METRIC_OPERATOR_SCRAPE_FAILURES,
    "Worker /metrics scrapes that gave no usable figure, by reason",
    [contract.LABEL_REASON],
)
TIER_DECISIONS = Counter(
    contract.METRIC_OPERATOR_TIER_DECISIONS,
    "Tier decisions taken per pod or node and tier",
    [contract.LABEL_SCOPE, contract.LABEL_TIER],
)
WRITE_FAILURES = Counter(
    contract.METRIC_OPERATOR_WRITE_FAILURES,
    "Best-effort writes that failed and were skipped (the reconcile carried on), by target",
    [contract.LABEL_TARGET],
)
WARM_PODS = Gauge(
    contract.METRIC_OPERATOR_WARM_PODS,
    "Worker pods verified warm, per WarmModel",
    [contract.LABEL_NAMESPACE, contract.LABEL_WARMMODEL],
)


def serve(port: int, host: str) -> None:
    """Start the metrics endpoint in a background thread (port 0: not at all)."""
    if port > 0:
        start_http_server(port, addr=host)
