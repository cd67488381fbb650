"""The scale-to-zero rules (pure functions, no I/O): whether a pool is at zero, how many requests
the activator replicas hold for it, and the EndpointSlices of its selector-less Service.

A pool with ``spec.pool.scaleToZero`` runs its usual size (replicas, at least minWarm, at least
one pod) while it has traffic; after ``afterIdleSeconds`` with no request and nothing held it goes
to zero; a held request brings it back.  Its Service routes through two EndpointSlices: the
awake warm pods', and the activator's, which lists the activator only while the first is empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from warmpool.contract.http import WORKER_PORT_NAME
from warmpool.contract.zero import (
    ACTIVATOR_SLICE_SUFFIX,
    ENDPOINTSLICE_MANAGER,
    HELD_ANNOTATION_PREFIX,
    HELD_CLOCK_SKEW_SECONDS,
    LABEL_ENDPOINTSLICE_MANAGED_BY,
    LABEL_SERVICE_NAME,
    PODS_SLICE_SUFFIX,
    BadHeldValue,
    read_held,
)
from warmpool_operator.api.types import InvalidWarmModel, ScaleToZeroSpec
from warmpool_operator.model import Obj, Target
from warmpool_operator.rules.builders import common_labels, service_name, stamp

#: A held-requests annotation not rewritten for this long past the hold timeout is left by an
#: activator that died: its requests have been answered (or lost with it) by then.
STALE_GRACE_SECONDS = 30.0

#: Events of a scale-to-zero pool, and the Ready condition's reasons at zero and on the way back.
REASON_SCALED_TO_ZERO = "ScaledToZero"
REASON_SCALED_FROM_ZERO = "ScaledFromZero"
REASON_STARTING_ON_DEMAND = "StartingOnDemand"
#: A Warning Event: a held annotation's value was not counted (once per distinct value).
REASON_HELD_IGNORED = "HeldAnnotationIgnored"


def scale_to_zero_of(body: Mapping[str, Any]) -> ScaleToZeroSpec | None:
    """A WarmModel's ``spec.pool.scaleToZero`` read by the API's own model (its defaults, its
    bounds), for the readers that do not parse the whole spec (the activator, a pass's trace);
    None when unset.  Raises :class:`InvalidWarmModel` naming each bad field."""
    raw = ((body.get("spec") or {}).get("pool") or {}).get("scaleToZero")
    if raw is None:
        return None
    where = "spec.pool.scaleToZero"
    if not isinstance(raw, Mapping):
        raise InvalidWarmModel([f"{where}: not an object: {raw!r}"])
    try:
        return ScaleToZeroSpec.model_validate(dict(raw))
    except ValidationError as error:
        raise InvalidWarmModel([f"{where}.{'.'.join(str(part) for part in item['loc'])}: {item['msg']}"
                                for item in error.errors(include_url=False)]) from None


@dataclass(frozen=True)
class Endpoint:
    """One address of a Service's EndpointSlice, and the pod behind it."""

    ip: str
    pod: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class IgnoredHeld:
    """A held annotation not counted: its key, its value, and why."""

    key: str
    value: str
    why: str
    #: its time is ahead of the operator's clock (the activator rewrites it every few seconds, each
    #: time with a new time: the same news until it is no longer ahead)
    ahead: bool = False

    @property
    def news(self) -> tuple[str, str]:
        """What makes two of them the same news (one Event each)."""
        return (self.key, "<ahead of the clock>" if self.ahead else self.value)


@dataclass(frozen=True)
class Held:
    """Requests held for one pool, summed over the activator replicas that still report them."""

    requests: int = 0
    replicas: int = 0
    #: the traceparent of a hold (of the first replica by name that sends one): the passes that
    #: serve the held requests, and the pods they start, join its trace
    trace: str | None = None
    #: the annotations not counted because their values are bad (a stale one is not bad: its
    #: activator died)
    ignored: tuple[IgnoredHeld, ...] = ()


def held_requests(annotations: Mapping[str, Any], hold_timeout_seconds: float, now_wall: float) -> Held:
    """What the ``held.warmpool.dev/<activator>`` annotations say.  Stale ones are left out; bad
    ones too, and listed: a value not in the contract's format, a count above its bound, or a time
    later than this operator's clock plus HELD_CLOCK_SKEW_SECONDS (another pod's clock never keeps
    a count fresh)."""
    bound = hold_timeout_seconds + STALE_GRACE_SECONDS
    total = replicas = 0
    trace: str | None = None
    ignored: list[IgnoredHeld] = []
    for key in sorted(annotations):
        if not key.startswith(HELD_ANNOTATION_PREFIX):
            continue
        value = annotations[key]
        try:
            held = read_held(value)
        except BadHeldValue as error:
            ignored.append(IgnoredHeld(key, str(value), str(error)))
            continue
        if held.written - now_wall > HELD_CLOCK_SKEW_SECONDS:
            why = (f"its time is {held.written - now_wall:.0f}s ahead of the operator's clock (at most "
                   f"{HELD_CLOCK_SKEW_SECONDS}s is believed)")
            ignored.append(IgnoredHeld(key, str(value), why, ahead=True))
            continue
        if held.requests == 0 or now_wall - held.written > bound:
            continue
        total += held.requests
        replicas += 1
        trace = trace or held.trace
    return Held(total, replicas, trace, tuple(ignored))


@dataclass(frozen=True)
class ZeroInputs:
    """One pass's view of a scale-to-zero pool."""

    held: int
    #: pods that exist and are not terminating; of them, the ones warm (or asleep: a sleeping pod is warm)
    live_pods: int
    settled_pods: int
    #: seconds since the pool last served or held a request; None: not known yet
    idle_seconds: float | None
    #: the decision of the pass before (None: first pass; read back from the Deployment)
    was_at_zero: bool


@dataclass(frozen=True)
class ZeroState:
    """What one pass decided for a scale-to-zero pool: at zero or not, and the requests held."""

    at_zero: bool
    held: int


@dataclass(frozen=True)
class ZeroDecision:
    at_zero: bool
    #: why it changed this pass (for the Event); None: no change
    change: str | None = None


def decide(policy: ScaleToZeroSpec, inputs: ZeroInputs) -> ZeroDecision:
    """At zero or not.  Held requests always bring the pool back; it goes to zero only when every
    pod has settled (warm or asleep: never one still starting for a held request) and the pool has
    had no request for afterIdleSeconds."""
    if inputs.held > 0:
        if inputs.was_at_zero:
            return ZeroDecision(False, f"{inputs.held} request(s) held by the activator")
        return ZeroDecision(False)
    if inputs.was_at_zero:
        return ZeroDecision(True)
    idle = inputs.idle_seconds
    if idle is None or idle < policy.after_idle_seconds or inputs.settled_pods < inputs.live_pods:
        return ZeroDecision(False)
    return ZeroDecision(True, f"no request for {idle:.0f}s (afterIdleSeconds {policy.after_idle_seconds})")


# --------------------------------------------------------------------------------- EndpointSlices


def pods_slice_name(name: str) -> str:
    return f"{name}{PODS_SLICE_SUFFIX}"


def activator_slice_name(name: str) -> str:
    return f"{name}{ACTIVATOR_SLICE_SUFFIX}"


def slice_names(name: str) -> tuple[str, str]:
    return pods_slice_name(name), activator_slice_name(name)


def _slice(target: Target, name: str, port: int, endpoints: Sequence[Endpoint]) -> Obj:
    labels = {**common_labels(target.name), LABEL_SERVICE_NAME: service_name(target.name),
              LABEL_ENDPOINTSLICE_MANAGED_BY: ENDPOINTSLICE_MANAGER}
    return stamp({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": target.namespace, "labels": labels},
        "addressType": "IPv4",
        "ports": [{"name": WORKER_PORT_NAME, "port": port, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [e.ip], "conditions": {"ready": True, "serving": True, "terminating": False},
             "targetRef": {"kind": "Pod", "namespace": e.namespace, "name": e.pod, "uid": e.uid}}
            for e in sorted(endpoints, key=lambda e: e.ip)
        ],
    })


def build_slices(target: Target, pods: Sequence[Endpoint], activators: Sequence[Endpoint],
                 activator_port: int) -> tuple[Obj, Obj]:
    """(the pods' slice, the activator's slice): the activator is listed only while no pod is."""
    pods_slice = _slice(target, pods_slice_name(target.name), target.spec.pod.port, pods)
    activator_slice = _slice(target, activator_slice_name(target.name), activator_port,
                             () if pods else activators)
    return pods_slice, activator_slice


def ready_endpoints(slices: Iterable[Mapping[str, Any]]) -> tuple[list[Endpoint], int | None]:
    """The ready addresses of EndpointSlices the EndpointSlice controller made (the activator's
    Service), and the port named like the pool Services' (else the first port)."""
    found: dict[str, Endpoint] = {}
    port: int | None = None
    for slice_obj in slices:
        ports = slice_obj.get("ports") or []
        named = [p for p in ports if p.get("name") == WORKER_PORT_NAME] or ports
        if named and named[0].get("port"):
            port = int(named[0]["port"])
        for endpoint in slice_obj.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            ref = endpoint.get("targetRef") or {}
            for ip in endpoint.get("addresses") or []:
                found[str(ip)] = Endpoint(str(ip), str(ref.get("name") or ""), str(ref.get("namespace") or ""),
                                          str(ref.get("uid") or ""))
    return sorted(found.values(), key=lambda e: e.ip), port
