"""The operator's traces: a span per reconcile pass, with children for apply, scrape, decide
and status, and the pass's W3C traceparent sent in each tier directive so the worker's
reaction joins the pass's trace.  The activator's spans of a held request (activator/proxy.py)
come from the same class.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set
(:meth:`Tracing.from_env`, called once by the command line, which hands the object on through
kopf's memo); off, :meth:`Tracing.span` is a no-op context manager and OpenTelemetry is never
imported.  The spans use OpenTelemetry's context (contextvars), so a child opened anywhere inside
a pass's coroutine finds its parent without being handed it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from warmpool.contract.http import CONTROL_FIELD_TRACEPARENT
from warmpool.contract.telemetry import (
    ENV_OTEL_ENDPOINT,
    ENV_OTEL_SERVICE_NAME,
    ENV_OTEL_TRACES_ENDPOINT,
    TRACE_SERVICE_OPERATOR,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer


def tracing_requested(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return bool(env.get(ENV_OTEL_ENDPOINT, "").strip()
                or env.get(ENV_OTEL_TRACES_ENDPOINT, "").strip())


class Tracing:
    """The operator's tracer, or none (every call a no-op)."""

    def __init__(self, tracer: Tracer | None = None, provider: TracerProvider | None = None) -> None:
        self._tracer = tracer
        self._provider = provider

    @classmethod
    def from_env(cls, default_service: str = TRACE_SERVICE_OPERATOR) -> Tracing:
        """The SDK and the OTLP/HTTP exporter if the OTEL_* variables ask for it, else tracing off."""
        if not tracing_requested():
            return cls()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        service = os.environ.get(ENV_OTEL_SERVICE_NAME, "").strip() or default_service
        # The sampler comes from OTEL_TRACES_SAMPLER (the SDK's default: every pass).
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider.get_tracer("warmpool.operator"), provider)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def shutdown(self) -> None:
        """Flush what is buffered (at exit)."""
        if self._provider is not None:
            self._provider.shutdown()

    @contextmanager
    def span(self, name: str, attributes: Mapping[str, str | int] | None = None,
             parent: str | None = None, new_trace: bool = False) -> Iterator[None]:
        """A span named ``name``: the child of ``parent`` (a W3C traceparent from another process)
        when given, else of the current span; with ``new_trace``, the root of a trace of its own
        that links to the current span (a no-op with tracing off)."""
        if self._tracer is None:
            yield
            return
        from opentelemetry import trace
        from opentelemetry.context import Context

        context = None
        links = []
        if parent is not None:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            context = TraceContextTextMapPropagator().extract({CONTROL_FIELD_TRACEPARENT: parent})
        elif new_trace:
            context = Context()
            current = trace.get_current_span().get_span_context()
            links = [trace.Link(current)] if current.is_valid else []
        with self._tracer.start_as_current_span(name, context=context, links=links,
                                                attributes=dict(attributes or {})):
            yield

    def set_attribute(self, key: str, value: str | int) -> None:
        """An attribute of the current span, known only once its work is done (no-op with tracing off)."""
        if self._tracer is None:
            return
        from opentelemetry import trace

        trace.get_current_span().set_attribute(key, value)

    def traceparent(self) -> str | None:
        """The current span's W3C traceparent (what a tier directive carries), or None."""
        if self._tracer is None:
            return None
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        return carrier.get(CONTROL_FIELD_TRACEPARENT)
