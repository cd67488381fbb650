"""The worker's span sink (tracing.TraceSink) never grows without bound: spans wait as plain values
only until the SDK starts, at most MAX_PENDING_SPANS of them, and an SDK that fails to start
drops what waited and everything after (tracing never takes memory or the worker down)."""

from __future__ import annotations

import time

import pytest
from warmpool_worker import tracing
from warmpool_worker.tracing import MAX_PENDING_SPANS, ColdStartRecorder, TraceSink, TracingConfig

pytestmark = pytest.mark.unit


def test_spans_before_the_sdk_starts_are_capped() -> None:
    sink = TraceSink(TracingConfig(enabled=True), "cpu")
    for _ in range(MAX_PENDING_SPANS + 500):
        sink.request(time.time(), time.time(), "full", 200)
    assert sink.pending == MAX_PENDING_SPANS and sink.dropped == 500


def test_an_sdk_that_fails_to_start_keeps_no_span(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(config: TracingConfig, device: str) -> tracing.WorkerTracing:
        raise RuntimeError("the exporter could not be made")

    monkeypatch.setattr(tracing, "WorkerTracing", broken)  # the SDK failing at start, as it may in the field
    sink = TraceSink(TracingConfig(enabled=True), "cpu")
    for _ in range(10):
        sink.request(time.time(), time.time(), "full", 200)
    sink.cold_start_done(ColdStartRecorder(time.time()), "sha256:" + "0" * 64, time.time()).join(timeout=10)
    for _ in range(200_000):  # the 200k requests that once leaked 74 MiB
        sink.request(time.time(), time.time(), "full", 200)
    assert sink.pending == 0 and sink.dropped == 200_010
