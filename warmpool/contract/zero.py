"""Scale to zero: what the activator and the operator agree on.  The activator holds requests of a
pool that has no awake warm pod and says so in one annotation per activator replica on the
WarmModel; the operator reads them, wakes or starts a pod, and switches the Service's
EndpointSlices from the activator's addresses to the pods'.

Part of the contract: names both sides must agree on, each defined once (see warmpool/contract/__init__.py)."""

from __future__ import annotations

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


def parse_held(value: object) -> tuple[int, float, str | None] | None:
    """(requests held, unix time written, traceparent or None) of one annotation value; None if it
    is not one (a traceparent that is not W3C's is left out)."""
    if not isinstance(value, str):
        return None
    parts = value.split()
    if len(parts) not in (2, 3) or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    trace = parts[2] if len(parts) == 3 and valid_traceparent(parts[2]) else None
    return int(parts[0]), float(parts[1]), trace


def cold_start_trace_value(traceparent: str, deadline: float) -> str:
    return f"{traceparent} {int(deadline)}"


def parse_cold_start_trace(value: object) -> tuple[str, float] | None:
    """(traceparent, unix deadline) of the pod template's annotation; None if it is not one."""
    if not isinstance(value, str):
        return None
    parts = value.split()
    if len(parts) != 2 or not valid_traceparent(parts[0]) or not parts[1].isdigit():
        return None
    return parts[0], float(parts[1])
