"""Telemetry both sides emit the same way: OpenTelemetry's variables, service, span and attribute
names in traces, and the log formats.

Part of the contract: names both sides must agree on, each defined once (see warmpool/contract/__init__.py)."""

from __future__ import annotations

# OpenTelemetry's own variables (the standard names): tracing is on only when an endpoint is set.
ENV_OTEL_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTEL_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
#: Service names in traces (OTEL_SERVICE_NAME overrides).
TRACE_SERVICE_WORKER = "warmpool-worker"
TRACE_SERVICE_OPERATOR = "warmpool-operator"
TRACE_SERVICE_ACTIVATOR = "warmpool-activator"

# Span names: the worker's cold start (one trace per pod start; children in phase order) ...
SPAN_COLD_START = "cold_start"
SPAN_IMPORTS = "interpreter_and_imports"
SPAN_WEIGHTS_MAPPED = "weights_mapped"
SPAN_LAYER = "layer_materialised"
SPAN_PREFILL = "warmup_prefill"
SPAN_GRAPH_CAPTURE = "graph_capture"
SPAN_READY = "ready"
SPAN_FIRST_REQUEST = "first_request"
SPAN_REQUEST = "request"
SPAN_TIER_APPLIED = "tier_directive_applied"
# ... and the operator's reconcile pass.
SPAN_RECONCILE = "reconcile"
SPAN_APPLY = "apply"
SPAN_SCRAPE = "scrape"
SPAN_DECIDE = "decide"
SPAN_STATUS = "status"
# ... and the activator's held request: the hold (the pods it waits for are started in the hold's
# trace: the operator's passes and the new pods' cold starts are its children), then the forward.
SPAN_HELD_REQUEST = "held_request"
SPAN_HOLD = "hold"
SPAN_FORWARD = "forward"

# Span attributes.
ATTR_POD = "k8s.pod.name"
ATTR_DIGEST = "warmpool.model.digest"
ATTR_TIER = "warmpool.tier"
ATTR_DEVICE = "warmpool.device"
ATTR_LAYER = "warmpool.layer"
ATTR_BUCKET = "warmpool.bucket"
ATTR_TOKENS = "warmpool.tokens"
ATTR_WARMMODEL_UID = "warmpool.warmmodel.uid"
ATTR_WARMMODEL = "warmpool.warmmodel"
ATTR_OUTCOME = "warmpool.outcome"

#: W3C trace context (a ``traceparent``): version-traceid-parentid-flags, lower-case hex of these lengths.
TRACEPARENT_FIELD_LENGTHS = (2, 32, 16, 2)
_LOWER_HEX = frozenset("0123456789abcdef")


def valid_traceparent(value: object) -> bool:
    if not isinstance(value, str):
        return False
    fields = value.split("-")
    return (tuple(len(f) for f in fields) == TRACEPARENT_FIELD_LENGTHS
            and all(set(f) <= _LOWER_HEX for f in fields))

#: ``--log-format`` values of `warmpool worker ...` and `warmpool operator`.
LOG_FORMAT_TEXT = "text"
LOG_FORMAT_JSON = "json"
LOG_FORMATS = (LOG_FORMAT_TEXT, LOG_FORMAT_JSON)
#: ``--log-level`` values of every warmpool process (the chart's logLevel enum is a subset).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
