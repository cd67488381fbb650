"""`--log-format json` (warmpool.logformat) and the worker's tracing settings from OTEL_*."""

from __future__ import annotations

import json
import logging
import sys

import pytest
from warmpool_worker.tracing import (
    DEFAULT_REQUEST_SAMPLE_RATIO,
    ENV_OTEL_SAMPLER_ARG,
    TracingConfig,
    TracingConfigError,
)

from warmpool.contract.pods import ENV_POD_NAME
from warmpool.contract.telemetry import (
    ENV_OTEL_ENDPOINT,
    ENV_OTEL_SERVICE_NAME,
    ENV_OTEL_TRACES_ENDPOINT,
    valid_traceparent,
)
from warmpool.logformat import JsonFormatter, configure_logging

pytestmark = pytest.mark.unit


def record(message: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("warmpool.test", logging.WARNING, __file__, 1, message, args, exc_info)


def test_a_json_line_is_one_object_with_the_message_formatted() -> None:
    line = JsonFormatter().format(record("pod %s: %d layers", "p-0", 4))
    assert "\n" not in line
    body = json.loads(line)
    assert body["message"] == "pod p-0: 4 layers"
    assert body["level"] == "WARNING" and body["logger"] == "warmpool.test"
    assert body["time"].endswith("+00:00")
    assert "trace_id" not in body and "span_id" not in body  # no span active


def test_a_json_line_carries_the_exception_text() -> None:
    body = json.loads(JsonFormatter().format(record("failed", exc=True)))
    assert "ValueError: boom" in body["exc_info"]


def test_a_json_line_carries_the_active_spans_ids() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")  # no exporter: nothing leaves the process
    with tracer.start_as_current_span("pass") as span:
        body = json.loads(JsonFormatter().format(record("inside")))
        context = span.get_span_context()
    assert body["trace_id"] == f"{context.trace_id:032x}"
    assert body["span_id"] == f"{context.span_id:016x}"
    assert "trace_id" not in json.loads(JsonFormatter().format(record("after")))


def test_an_unknown_log_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--log-format must be one of"):
        configure_logging("INFO", "xml")


def test_tracing_is_on_only_with_an_otlp_endpoint() -> None:
    assert not TracingConfig.from_env({}).enabled
    assert not TracingConfig.from_env({ENV_OTEL_ENDPOINT: "  "}).enabled
    assert TracingConfig.from_env({ENV_OTEL_ENDPOINT: "http://127.0.0.1:4318"}).enabled
    assert TracingConfig.from_env({ENV_OTEL_TRACES_ENDPOINT: "http://127.0.0.1:4318/v1/traces"}).enabled


def test_tracing_settings_come_from_the_standard_variables() -> None:
    config = TracingConfig.from_env({ENV_OTEL_ENDPOINT: "http://127.0.0.1:4318",
                                     ENV_OTEL_SERVICE_NAME: "svc", ENV_POD_NAME: "pod-1",
                                     ENV_OTEL_SAMPLER_ARG: "0.25"})
    assert (config.service_name, config.pod, config.request_ratio) == ("svc", "pod-1", 0.25)
    assert TracingConfig.from_env({}).request_ratio == DEFAULT_REQUEST_SAMPLE_RATIO


@pytest.mark.parametrize("ratio", ["x", "1.5", "-0.1"])
def test_a_bad_sample_ratio_names_the_variable(ratio: str) -> None:
    with pytest.raises(TracingConfigError, match=ENV_OTEL_SAMPLER_ARG):
        TracingConfig.from_env({ENV_OTEL_SAMPLER_ARG: ratio})


def test_a_traceparent_is_checked_for_the_w3c_form() -> None:
    assert valid_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    for bad in ("", "00-xyz-b7ad6b7169203331-01", "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01", 42, None):
        assert not valid_traceparent(bad)
