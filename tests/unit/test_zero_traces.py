"""The trace of a request held at zero: the activator's hold travels in its held-count annotation,
the operator's pass for held requests joins it, and a pool leaving zero stamps it on its pod
template, where the worker's cold start takes it as its parent (only for a pod started by the
deadline).  Spans are read back from OpenTelemetry's in-memory exporter."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from warmpool_operator.api.types import parse_spec
from warmpool_operator.control import zero as zero_step
from warmpool_operator.io.tracing import Tracing
from warmpool_operator.model import Target
from warmpool_operator.rules import builders, zero
from warmpool_worker.cli import build_parser, serve_config
from warmpool_worker.tracing import ColdStartRecorder, TracingConfig, WorkerTracing

from warmpool.contract.telemetry import ENV_OTEL_ENDPOINT, SPAN_COLD_START, SPAN_RECONCILE
from warmpool.contract.zero import (
    ANNOTATION_COLD_START_TRACE,
    ENV_COLD_START_TRACE,
    cold_start_trace_value,
    held_annotation,
    held_value,
    parse_cold_start_trace,
    read_held,
)

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
HOLD = f"00-{TRACE_ID}-b7ad6b7169203331-01"
OTHER = "00-11111111111111111111111111111111-2222222222222222-01"
ZERO = {"afterIdleSeconds": 600, "holdTimeoutSeconds": 60}


def _body(zero_policy: dict[str, Any] | None = ZERO, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    pool: dict[str, Any] = {"replicas": 1, "minWarm": 0}
    if zero_policy is not None:
        pool["scaleToZero"] = zero_policy
    return {"metadata": {"name": "m", "namespace": "ns", "annotations": annotations or {}},
            "spec": {"model": {"hostPath": {"path": "/models/m"}}, "pool": pool}}


def _target(body: dict[str, Any]) -> Target:
    return Target(name="m", namespace="ns", spec=parse_spec(body["spec"]))


def _stamp(target: Target, body: dict[str, Any], live: dict[str, Any] | None, replicas: int, wall: float) -> str | None:
    """The cold-start trace a pass of a fresh operator (nothing stamped yet) writes."""
    return zero_step.cold_start_trace(zero_step.ZeroMemory(), target, body, live, replicas, wall)


def _deployment(replicas: int, kept: str | None = None) -> dict[str, Any]:
    annotations = {} if kept is None else {ANNOTATION_COLD_START_TRACE: kept}
    return {"spec": {"replicas": replicas, "template": {"metadata": {"annotations": annotations}}}}


@pytest.fixture()
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.clear()


def _provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _parent_of(span: ReadableSpan) -> tuple[str, str] | None:
    if span.parent is None:
        return None
    return f"{span.parent.trace_id:032x}", f"{span.parent.span_id:016x}"


# --------------------------------------------------------------------------- the held annotation


def test_a_held_value_carries_the_holds_traceparent_and_old_values_still_read() -> None:
    assert read_held(held_value(3, NOW, HOLD)) == (3, NOW, HOLD)
    assert read_held(held_value(3, NOW)) == (3, NOW, None)  # an activator without tracing
    # A garbled trace does not cost the count: the pool must still leave zero.
    assert read_held("3 1800000000 not-a-trace") == (3, NOW, None)


def test_the_trace_comes_from_the_first_live_replica_by_name_that_sends_one() -> None:
    annotations = {
        held_annotation("activator-b"): held_value(1, NOW, OTHER),
        held_annotation("activator-a"): held_value(2, NOW, HOLD),
        held_annotation("activator-0"): held_value(1, NOW),  # no trace: tracing off there
        held_annotation("activator-dead"): held_value(9, NOW - 60 - zero.STALE_GRACE_SECONDS - 1, OTHER),
    }
    held = zero.held_requests(annotations, 60, NOW)
    assert held == zero.Held(requests=4, replicas=3, trace=HOLD)
    assert zero_step.hold_trace(_body(annotations=annotations), NOW) == HOLD


def test_no_trace_without_scale_to_zero_or_a_live_count() -> None:
    live = {held_annotation("activator-a"): held_value(2, NOW, HOLD)}
    assert zero_step.hold_trace(_body(None, live), NOW) is None
    assert zero_step.hold_trace(_body(annotations={held_annotation("activator-a"): held_value(0, NOW, HOLD)}),
                                NOW) is None
    # The hold timeout the staleness is judged by is the spec's (a dead activator's count goes stale).
    assert zero_step.hold_trace(_body({**ZERO, "holdTimeoutSeconds": 5}, live), NOW + 5 + 31) is None
    assert zero_step.hold_trace(_body({"afterIdleSeconds": 600}, live), NOW + 120) == HOLD  # the default 120 s


# --------------------------------------------------------------------------- the pod template


def test_a_pool_leaving_zero_for_held_requests_stamps_the_hold_on_its_pod_template() -> None:
    body = _body(annotations={held_annotation("activator-a"): held_value(2, NOW, HOLD)})
    target = _target(body)
    stamped = _stamp(target, body, _deployment(0, kept=OTHER + " 1"), 1, NOW)
    assert stamped == cold_start_trace_value(HOLD, NOW + 60)
    assert parse_cold_start_trace(stamped) == (HOLD, NOW + 60)  # the deadline: the hold can last no longer
    template = builders.build_deployment(target, 1, stamped)["spec"]["template"]
    assert template["metadata"]["annotations"][ANNOTATION_COLD_START_TRACE] == stamped
    worker = template["spec"]["containers"][0]
    env = {e["name"]: e for e in worker["env"]}
    assert env[ENV_COLD_START_TRACE]["valueFrom"]["fieldRef"]["fieldPath"] == (
        f"metadata.annotations['{ANNOTATION_COLD_START_TRACE}']")


def test_a_later_pass_of_the_same_leave_keeps_the_stamp_until_the_pool_is_back_at_zero() -> None:
    memory = zero_step.ZeroMemory()
    first = _body(annotations={held_annotation("activator-a"): held_value(2, NOW, HOLD)})
    stamped = zero_step.cold_start_trace(memory, _target(first), first, _deployment(0), 1, NOW)
    # The next pass: the cache still shows the Deployment at zero, a second later, and the oldest
    # hold has gone (its client hung up): a new stamp would roll the pod that is starting.
    later = _body(annotations={held_annotation("activator-a"): held_value(1, NOW + 1, OTHER)})
    assert zero_step.cold_start_trace(memory, _target(later), later, _deployment(0), 1, NOW + 1) == stamped
    # Back at zero (the pass that goes there forgets the stamp), the next leave stamps its own hold.
    memory.cold_start_stamp = None
    again = _body(annotations={held_annotation("activator-a"): held_value(1, NOW + 300, OTHER)})
    assert zero_step.cold_start_trace(memory, _target(again), again, _deployment(0, stamped), 1, NOW + 300) == (
        cold_start_trace_value(OTHER, NOW + 360))


def test_otherwise_the_live_templates_value_stays_so_no_pod_rolls() -> None:
    body = _body(annotations={held_annotation("activator-a"): held_value(2, NOW, HOLD)})
    target = _target(body)
    kept = cold_start_trace_value(OTHER, NOW - 100)
    # Pods running (scaling 1 -> 2, or held requests for a pool whose pods still settle): unchanged.
    assert _stamp(target, body, _deployment(1, kept), 2, NOW) == kept
    assert _stamp(target, body, _deployment(1), 1, NOW) is None
    # At zero and staying there, or leaving it without a traced hold (a forecast): unchanged too.
    assert _stamp(target, body, _deployment(0, kept), 0, NOW) == kept
    untraced = _body(annotations={held_annotation("activator-a"): held_value(2, NOW)})
    assert _stamp(_target(untraced), untraced, _deployment(0, kept), 1, NOW) == kept
    # A new Deployment has no pods to start for a hold.
    assert _stamp(target, body, None, 1, NOW) is None


def test_a_pool_without_scale_to_zero_has_neither_the_annotation_nor_the_variable() -> None:
    body = _body(None)
    target = _target(body)
    assert _stamp(target, body, _deployment(0, HOLD + " 1"), 1, NOW) is None
    template = builders.build_deployment(target, 1)["spec"]["template"]
    assert ANNOTATION_COLD_START_TRACE not in template["metadata"]["annotations"]
    assert ENV_COLD_START_TRACE not in {e["name"] for e in template["spec"]["containers"][0]["env"]}


# --------------------------------------------------------------------------- the spans


def test_a_pass_for_held_requests_is_a_child_of_the_hold(spans: InMemorySpanExporter) -> None:
    provider = _provider(spans)
    tracing = Tracing(provider.get_tracer("test"), provider)
    with tracing.span(SPAN_RECONCILE, {"k": "v"}, parent=HOLD):
        tracing.set_attribute("warmpool.outcome", 200)
        inner = tracing.traceparent()
    with tracing.span(SPAN_RECONCILE):
        pass
    joined, own = spans.get_finished_spans()
    assert _parent_of(joined) == (TRACE_ID, HOLD.split("-")[2])
    assert joined.attributes == {"k": "v", "warmpool.outcome": 200}
    assert inner is not None and inner.split("-")[1] == TRACE_ID
    assert _parent_of(own) is None and f"{own.context.trace_id:032x}" != TRACE_ID


def test_tracing_off_ignores_a_parent() -> None:
    tracing = Tracing()
    with tracing.span(SPAN_RECONCILE, parent=HOLD):
        tracing.set_attribute("warmpool.outcome", 1)
        assert tracing.traceparent() is None


@pytest.mark.parametrize(("started", "joined"), [(NOW - 30, True), (NOW + 60, True), (NOW + 61, False)])
def test_the_worker_parents_its_cold_start_on_the_hold_only_if_it_started_by_the_deadline(
        spans: InMemorySpanExporter, started: float, joined: bool) -> None:
    config = TracingConfig.from_env({ENV_OTEL_ENDPOINT: "http://127.0.0.1:1",
                                     ENV_COLD_START_TRACE: cold_start_trace_value(HOLD, NOW + 60)})
    assert config.cold_start_parent == (HOLD, NOW + 60)
    worker = WorkerTracing(config, "cpu")
    provider = _provider(spans)
    worker.tracer = provider.get_tracer("test")
    recorder = ColdStartRecorder(process_start=started)
    worker.emit_cold_start(recorder, ready_at=started + 5)
    (root,) = [s for s in spans.get_finished_spans() if s.name == SPAN_COLD_START]
    assert (_parent_of(root) == (TRACE_ID, HOLD.split("-")[2])) is joined
    assert (f"{root.context.trace_id:032x}" == TRACE_ID) is joined
    worker.provider.shutdown()


@pytest.mark.parametrize("value", ["", "garbage", HOLD, f"{HOLD} soon", "00-xyz 5",
                                   # str.isdigit() vouches for all of these deadlines; float() took some
                                   f"{HOLD} \u00b2", f"{HOLD} \u0661\u0668\u0660\u0660", f"{HOLD} \uff11",
                                   f"{HOLD} +1", f"{HOLD}  1", f"{HOLD} 1e3", f"{HOLD} nan", f"{HOLD} inf",
                                   f"{HOLD} -1", f"{HOLD} " + "9" * 5000, f"{HOLD} 99999999999"])
def test_an_empty_or_garbled_template_value_gives_the_pod_its_own_trace(value: str) -> None:
    assert parse_cold_start_trace(value) is None
    assert TracingConfig.from_env({ENV_COLD_START_TRACE: value}).cold_start_parent is None


def test_a_worker_starts_with_a_bad_cold_start_annotation_and_logs_that_it_ignored_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """The worker's start path (its CLI edge builds the configuration from the environment): a
    template annotation whose deadline is "\u00b2" once raised out of it, and the pod crash-looped."""
    monkeypatch.setenv(ENV_COLD_START_TRACE, f"{HOLD} \u00b2")
    monkeypatch.setenv(ENV_OTEL_ENDPOINT, "http://127.0.0.1:1")
    with caplog.at_level(logging.WARNING):
        config = serve_config(build_parser().parse_args(["serve", "--model", str(tmp_path)]))
    assert config.tracing.enabled and config.tracing.cold_start_parent is None
    (said,) = [r.getMessage() for r in caplog.records if ENV_COLD_START_TRACE in r.getMessage()]
    assert "ignored" in said and "\\xb2" in said


def test_the_pass_that_takes_the_pool_to_zero_forgets_the_stamp(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    # kopf posts Events from its own handler context only; here the reason is what counts.
    monkeypatch.setattr(kopf, "event", lambda *_, reason, **__: events.append(reason))
    body = _body({"afterIdleSeconds": 5, "holdTimeoutSeconds": 60})
    memory = zero_step.ZeroMemory(at_zero=False, left_zero=0.0, cold_start_stamp=cold_start_trace_value(HOLD, NOW))
    state = zero_step.decide_and_announce(memory, _target(body), body, _deployment(1), [], None, now=100.0, wall=NOW)
    assert state.at_zero and events == [zero.REASON_SCALED_TO_ZERO]
    assert memory.cold_start_stamp is None

