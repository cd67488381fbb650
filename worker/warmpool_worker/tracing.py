"""The worker's traces: one trace per pod start, the first request, sampled later requests,
and the operator's tier directives joined to the operator's trace.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set.
Off, this module imports nothing beyond the standard library and `warmpool.contract`, and
nothing asks it to: no OpenTelemetry module is ever imported (checked by a test through
``sys.modules``).

On, the start path still gains nothing heavy: the steps are recorded as plain wall-clock
pairs (`ColdStartRecorder`, two ``time.time()`` calls and a list append each), and the spans
are emitted *after the fact*, with explicit start/end times, by a background thread once the
worker is ready -- that thread is where OpenTelemetry is first imported.  The phase
boundaries are the very timestamps `metrics.WorkerMetrics.mark_phase` recorded (process start
from the kernel), so a trace's durations agree with the phase metrics.

Span tree (names from `warmpool.contract`)::

    cold_start                      process start -> ready (a child of the activator's hold when
                                    the pod was started for held requests: ENV_COLD_START_TRACE)
      interpreter_and_imports       process start -> the engine's load call (torch imported)
      weights_mapped                load call -> weights_mapped phase
      layer_materialised  x N       one per layer forced resident (warmpool.layer)
      warmup_prefill      x M       one per warm-up prefill (warmpool.bucket, warmpool.tokens)
      graph_capture                 CUDA graphs (only when captured)
      ready                         last step -> ready phase
      first_request                 the first completion (ends after the root: same trace)
    request                         a later completion, sampled (its own trace)
    tier_directive_applied          child of the operator's span named by the directive's traceparent
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from warmpool.contract.http import CONTROL_FIELD_TRACEPARENT
from warmpool.contract.numerals import shown
from warmpool.contract.pods import ENV_POD_NAME
from warmpool.contract.telemetry import (
    ATTR_BUCKET,
    ATTR_DEVICE,
    ATTR_DIGEST,
    ATTR_LAYER,
    ATTR_POD,
    ATTR_TIER,
    ATTR_TOKENS,
    ENV_OTEL_ENDPOINT,
    ENV_OTEL_SERVICE_NAME,
    ENV_OTEL_TRACES_ENDPOINT,
    SPAN_COLD_START,
    SPAN_FIRST_REQUEST,
    SPAN_GRAPH_CAPTURE,
    SPAN_IMPORTS,
    SPAN_LAYER,
    SPAN_PREFILL,
    SPAN_READY,
    SPAN_REQUEST,
    SPAN_TIER_APPLIED,
    SPAN_WEIGHTS_MAPPED,
    TRACE_SERVICE_WORKER,
)
from warmpool.contract.zero import ENV_COLD_START_TRACE, parse_cold_start_trace

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

DEFAULT_REQUEST_SAMPLE_RATIO = 0.01
#: The share of requests after the first that the worker traces (0..1).
ENV_OTEL_SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"


log = logging.getLogger(__name__)


class TracingConfigError(ValueError):
    """An OTEL_* variable the worker cannot use; the message names it."""


@dataclass(frozen=True)
class TracingConfig:
    """Whether to trace, and what every span carries; built once at the CLI edge (`from_env`)."""

    enabled: bool = False
    service_name: str = TRACE_SERVICE_WORKER
    pod: str = ""  # the pod's name ($POD_NAME, set by the operator); empty: the host's name in spans
    #: share of completions after the first that get a trace of their own
    request_ratio: float = DEFAULT_REQUEST_SAMPLE_RATIO
    #: the hold this pod was started for, and by when it must have started to be its cold start
    #: (the pod template's annotation, warmpool/contract/zero.py); None: a trace of its own
    cold_start_parent: tuple[str, float] | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.request_ratio <= 1.0:
            raise TracingConfigError(f"{ENV_OTEL_SAMPLER_ARG} must be within [0, 1], got {self.request_ratio}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TracingConfig:
        env = os.environ if env is None else env
        enabled = bool(env.get(ENV_OTEL_ENDPOINT, "").strip() or env.get(ENV_OTEL_TRACES_ENDPOINT, "").strip())
        raw_ratio = env.get(ENV_OTEL_SAMPLER_ARG, "").strip()
        try:
            ratio = float(raw_ratio) if raw_ratio else DEFAULT_REQUEST_SAMPLE_RATIO
        except ValueError:
            raise TracingConfigError(f"{ENV_OTEL_SAMPLER_ARG} must be a number in [0, 1], got {raw_ratio!r}") from None
        return cls(
            enabled=enabled,
            service_name=env.get(ENV_OTEL_SERVICE_NAME, "").strip() or TRACE_SERVICE_WORKER,
            pod=env.get(ENV_POD_NAME, "").strip(),
            request_ratio=ratio,
            cold_start_parent=_cold_start_parent(env.get(ENV_COLD_START_TRACE, "")),
        )

    def cold_start_traceparent(self, process_start: float) -> str | None:
        """The hold to parent the cold start on: only if this process started by its deadline."""
        if self.cold_start_parent is None or process_start > self.cold_start_parent[1]:
            return None
        return self.cold_start_parent[0]


def _cold_start_parent(raw: str) -> tuple[str, float] | None:
    """The hold of the pod template's annotation.  Unset or empty (a template without it): the
    pod's own trace; garbled: the same, said once in the log.  The value is advisory (it only
    parents a trace), so a bad one never stops the worker from starting."""
    parent = parse_cold_start_trace(raw)
    if raw and parent is None:
        log.warning("%s=%s is not '<traceparent> <unix deadline>': ignored; the cold start gets a trace "
                    "of its own", ENV_COLD_START_TRACE, shown(raw))
    return parent


@dataclass(frozen=True)
class Step:
    """One recorded cold-start step: Unix times and the span's own attributes."""

    name: str
    start: float
    end: float
    attributes: dict[str, str | int] = field(default_factory=dict)


class ColdStartRecorder:
    """The cold start's steps as plain timestamps (what the start path pays: no OpenTelemetry)."""

    def __init__(self, process_start: float) -> None:
        self.process_start = process_start
        self.steps: list[Step] = []
        self.tier = ""
        self._last = process_start

    def mark(self, name: str, start: float | None = None, end: float | None = None,
             attributes: Mapping[str, str | int] | None = None) -> None:
        """A step from ``start`` (default: the end of the previous step) to ``end`` (default: now)."""
        stop = time.time() if end is None else end
        begin = self._last if start is None else start
        self.steps.append(Step(name, begin, stop, dict(attributes or {})))
        self._last = stop

    # The steps by name (what runtime.py calls); each ends now unless told otherwise.
    def imports_done(self, at: float) -> None:
        self.mark(SPAN_IMPORTS, start=self.process_start, end=at)

    def weights_mapped(self, at: float) -> None:
        self.mark(SPAN_WEIGHTS_MAPPED, end=at)

    def layer(self, index: int) -> None:
        self.mark(SPAN_LAYER, attributes={ATTR_LAYER: index, ATTR_TIER: self.tier})

    def prefill(self, bucket: int) -> None:
        # sized_prompt_tokens cuts every warm-up prompt to exactly its bucket's length
        self.mark(SPAN_PREFILL, attributes={ATTR_BUCKET: bucket, ATTR_TOKENS: bucket, ATTR_TIER: self.tier})

    def graph_capture(self, start: float, end: float) -> None:
        self.mark(SPAN_GRAPH_CAPTURE, start=start, end=end)

    def ready(self, at: float) -> None:
        self.mark(SPAN_READY, end=at)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class WorkerTracing:
    """The SDK side: exporter, tracer, and the spans built from recorded steps (tracing on only)."""

    def __init__(self, config: TracingConfig, device: str) -> None:
        # The only place OpenTelemetry is imported (never on the path of a worker with tracing off).
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        self.config = config
        self.device = device
        self.digest = ""
        self.pod = config.pod or os.uname().nodename
        # Sampling is decided here (the cold start always, later requests by ratio), not by
        # OTEL_TRACES_SAMPLER: a ratio sampler would drop the one trace per pod start.
        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name, ATTR_POD: self.pod}),
            sampler=ALWAYS_ON,
        )
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer: Tracer = self.provider.get_tracer("warmpool.worker")
        self._root: Context | None = None
        self._first_request_done = False
        self._lock = threading.Lock()

    def common(self, tier: str) -> dict[str, str]:
        return {ATTR_POD: self.pod, ATTR_DIGEST: self.digest, ATTR_TIER: tier, ATTR_DEVICE: self.device}

    def emit_cold_start(self, recorder: ColdStartRecorder, ready_at: float) -> None:
        """The cold start's trace from recorded steps (root: process start -> ready)."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        common = self.common(recorder.tier)
        hold = self.config.cold_start_traceparent(recorder.process_start)
        parent = None if hold is None else TraceContextTextMapPropagator().extract({CONTROL_FIELD_TRACEPARENT: hold})
        root = self.tracer.start_span(SPAN_COLD_START, context=parent, start_time=_ns(recorder.process_start),
                                      attributes=common)
        context = trace.set_span_in_context(root)
        for step in recorder.steps:
            span = self.tracer.start_span(
                step.name, context=context, start_time=_ns(step.start), attributes={**common, **step.attributes}
            )
            span.end(end_time=_ns(step.end))
        root.end(end_time=_ns(ready_at))
        with self._lock:
            self._root = context

    def request_span(self, start: float, end: float, tier: str, status: int) -> None:
        """The first completion joins the cold start's trace; later ones are sampled by ratio."""
        with self._lock:
            first = not self._first_request_done and self._root is not None
            if first:
                self._first_request_done = True
            parent = self._root if first else None
        if not first and random.random() >= self.config.request_ratio:
            return
        attributes: dict[str, Any] = {**self.common(tier), "http.response.status_code": status}
        span: Span = self.tracer.start_span(
            SPAN_FIRST_REQUEST if first else SPAN_REQUEST, context=parent, start_time=_ns(start),
            attributes=attributes,
        )
        span.end(end_time=_ns(end))

    def directive_span(self, traceparent: str, tier: str, before: str, start: float, end: float) -> None:
        """The worker's reaction to an operator directive, in the operator's trace."""
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract({CONTROL_FIELD_TRACEPARENT: traceparent})
        span = self.tracer.start_span(
            SPAN_TIER_APPLIED, context=parent, start_time=_ns(start),
            attributes={**self.common(tier), "warmpool.tier.before": before},
        )
        span.end(end_time=_ns(end))

    def shutdown(self) -> None:
        """Flush what is queued (bounded by the SDK's own export timeout)."""
        self.provider.shutdown()


#: Spans kept as plain values until the SDK has started; past this many, more are dropped (so a
#: worker whose SDK is slow to start never grows without bound).
MAX_PENDING_SPANS = 1000


class TraceSink:
    """What the runtime, the server and the control endpoint call (tracing on only).

    OpenTelemetry is imported, and the `WorkerTracing` built, by a background thread once
    the worker is ready (`cold_start_done`); a directive or request seen before then is kept
    as plain values and emitted by that thread, so nothing on the start path waits for it.
    """

    def __init__(self, config: TracingConfig, device: str) -> None:
        self.config = config
        self.device = device
        self.recorder: ColdStartRecorder | None = None
        self._tracing: WorkerTracing | None = None
        self._pending: list[Callable[[WorkerTracing], None]] = []
        #: the SDK could not start: spans are dropped from then on, none kept
        self._failed = False
        self.dropped = 0
        self._lock = threading.Lock()
        self.thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _submit(self, emit: Callable[[WorkerTracing], None]) -> None:
        with self._lock:
            tracing = self._tracing
            if tracing is None:
                if self._failed or len(self._pending) >= MAX_PENDING_SPANS:
                    self.dropped += 1
                else:
                    self._pending.append(emit)
                return
        try:
            emit(tracing)
        except Exception:  # tracing must never fail a request
            log.exception("could not emit a span")

    def cold_start_done(self, recorder: ColdStartRecorder, digest: str, ready_at: float) -> threading.Thread:
        """Build the SDK and emit the cold start's trace, then anything queued (a daemon thread)."""

        def run() -> None:
            try:
                tracing = WorkerTracing(self.config, self.device)
            except Exception:  # tracing must never take the worker down
                log.exception("could not start tracing: no spans will be sent")
                with self._lock:
                    self._failed = True
                    self.dropped += len(self._pending)
                    self._pending = []
                return
            try:
                tracing.digest = digest
                tracing.emit_cold_start(recorder, ready_at)
                with self._lock:
                    self._tracing = tracing
                    pending, self._pending = self._pending, []
                for emit in pending:
                    emit(tracing)
            except Exception:  # tracing must never take the worker down
                log.exception("could not emit the cold-start trace")

        self.thread = threading.Thread(target=run, name="cold-start trace", daemon=True)
        self.thread.start()
        return self.thread

    def request(self, start: float, end: float, tier: str, status: int) -> None:
        self._submit(lambda t: t.request_span(start, end, tier, status))

    def directive(self, traceparent: str, tier: str, before: str, start: float, end: float) -> None:
        self._submit(lambda t: t.directive_span(traceparent, tier, before, start, end))

    def shutdown(self) -> None:
        with self._lock:
            tracing = self._tracing
        if tracing is not None:
            tracing.shutdown()
