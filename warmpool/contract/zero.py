"""Scale to zero: what the activator and the operator agree on.  The activator holds requests of a
pool that has no awake warm pod and says so in one annotation per activator replica on the
WarmModel; the operator reads them, wakes or starts a pod, and switches the Service's
EndpointSlices from the activator's addresses to the pods'.

Part of the contract: names both sides must agree on, each defined once (see warmpool/contract/__init__.py)."""

from __future__ import annotations

from typing import NamedTuple

from warmpool.contract.numerals import NumeralError, parse_ascii_int, shown
from warmpool.contract.telemetry import valid_traceparent

#: app.kubernetes.io/component of the activator's pods and Service.
COMPONENT_ACTIVATOR = "activator"
#: The activator's data port (the OpenAI-compatible traffic of pools at zero).
DEFAULT_ACTIVATOR_PORT = 8012

#: On a WarmModel: ``held.warmpool.dev/<activator pod>`` = "<requests held> <unix time written>",
#: then, with tracing on, the W3C traceparent of the oldest hold (the operator's passes and the
#: pods they start join its trace).  One key per activator replica, so two replicas never
#: overwrite each other's count; a replica removes its key once it holds nothing for the pool.
HELD_ANNOTATION_PREFIX = "held.warmpool.dev/"
#: The most requests one held annotation may report.  A replica holds at most its pool's
#: ``maxHeldRequests`` (the API allows up to 10,000); a larger count is not an activator's.
HELD_COUNT_MAX = 100_000
#: How far past the reader's own clock a held annotation's time may be (two nodes' clocks differ by
#: less).  A later time is not believed: it would keep its count fresh for ever.  The operator
#: judges by its own clock, and the admission policy refuses such a write by the API server's.
HELD_CLOCK_SKEW_SECONDS = 60
#: The largest unix time either annotation may carry (the year 2286): a longer number is garbage.
MAX_UNIX_SECONDS = 9_999_999_999

#: On the pod template of a pool that left zero for held requests: "<traceparent> <unix deadline>",
#: the hold its pods start for.  The worker reads it through ``ENV_COLD_START_TRACE`` (the
#: Downward API) and parents its cold-start trace on the hold, if it started by the deadline (a
#: pod added later, by the same template, starts a trace of its own).
ANNOTATION_COLD_START_TRACE = "warmpool.dev/cold-start-trace"
ENV_COLD_START_TRACE = "WARMPOOL_COLD_START_TRACE"

#: A scale-to-zero pool's Service has no selector; these EndpointSlices carry its addresses: the
#: awake warm pods', else the activator's.  kube-proxy reads them by the service-name label, and
#: the EndpointSlice controller leaves slices another manager labels as its own.
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
LABEL_ENDPOINTSLICE_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
ENDPOINTSLICE_MANAGER = "operator.warmpool.dev"
PODS_SLICE_SUFFIX = "-pods"
ACTIVATOR_SLICE_SUFFIX = "-activator"

#: The OpenAI-style error types of the activator's refusals.
ERROR_HOLD_FULL = "warmpool_hold_full"
ERROR_HOLD_TIMEOUT = "warmpool_hold_timeout"
ERROR_MISDIRECTED = "warmpool_misdirected"  # 421: the Host names no scale-to-zero WarmModel Service
ERROR_UPSTREAM = "warmpool_upstream"  # 502: no pod took a forwarded request


def held_annotation(pod: str) -> str:
    return f"{HELD_ANNOTATION_PREFIX}{pod}"


def held_value(count: int, wall: float, traceparent: str | None = None) -> str:
    return f"{count} {int(wall)}" + (f" {traceparent}" if traceparent else "")


class HeldValue(NamedTuple):
    """One held annotation's value."""

    requests: int
    #: unix time the activator wrote it (by its own clock: the reader judges it by its own)
    written: float
    #: the W3C traceparent of the oldest hold, or None
    trace: str | None


class BadHeldValue(ValueError):
    """A held annotation's value that is not one; the message says what is wrong."""


def read_held(value: object) -> HeldValue:
    """The value of one held annotation ("<count> <unix time>[ <traceparent>]", ASCII digits, the
    count at most HELD_COUNT_MAX); raises :class:`BadHeldValue` naming what is wrong.  A third field
    that is not a W3C traceparent is left out, not refused.  Whether the time is believable is the
    reader's to judge, by its own clock (HELD_CLOCK_SKEW_SECONDS)."""
    parts = value.split(" ") if isinstance(value, str) else []
    if len(parts) not in (2, 3):
        raise BadHeldValue(f"{shown(value)} is not '<count> <unix time>[ <traceparent>]'")
    try:
        count = parse_ascii_int(parts[0], HELD_COUNT_MAX)
    except NumeralError as error:
        raise BadHeldValue(f"count: {error}") from None
    try:
        written = parse_ascii_int(parts[1], MAX_UNIX_SECONDS)
    except NumeralError as error:
        raise BadHeldValue(f"time: {error}") from None
    trace = parts[2] if len(parts) == 3 and valid_traceparent(parts[2]) else None
    return HeldValue(count, float(written), trace)


def cold_start_trace_value(traceparent: str, deadline: float) -> str:
    return f"{traceparent} {int(deadline)}"


def parse_cold_start_trace(value: object) -> tuple[str, float] | None:
    """(traceparent, unix deadline) of the pod template's annotation; None if it is not one."""
    parts = value.split(" ") if isinstance(value, str) else []
    if len(parts) != 2 or not valid_traceparent(parts[0]):
        return None
    try:
        return parts[0], float(parse_ascii_int(parts[1], MAX_UNIX_SECONDS))
    except NumeralError:
        return None


#: The activator's refusals that protect it (and so every pool it holds for) from one client.
ERROR_BODY_TOO_LARGE = "warmpool_body_too_large"  # 413: a body larger than a worker accepts
ERROR_SLOW_CLIENT = "warmpool_slow_client"  # 408: a body not sent within the activator's deadline
ERROR_BUSY = "warmpool_busy"  # 503 with Retry-After: the activator's byte or connection bound is reached
ERROR_NOT_SERVING_API = "warmpool_not_serving_api"  # 404: only the serving API (/v1/...) is forwarded
