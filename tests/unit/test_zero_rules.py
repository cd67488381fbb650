"""The scale-to-zero rules (rules/zero.py): held counts, the at-zero decision, the Service's two
EndpointSlices (and the pods a pass routes to first), the replicas and the Ready condition at
zero, and the spec rules around it."""

from __future__ import annotations

from typing import Any

import kopf
import pytest
from warmpool_operator.api import types as api
from warmpool_operator.control import zero as zero_step
from warmpool_operator.model import Target
from warmpool_operator.rules import scaling, zero
from warmpool_operator.rules import status as st
from warmpool_operator.rules.builders import build_service
from warmpool_operator.rules.gating import PodRef
from warmpool_operator.rules.observation import ColdStarts

from warmpool.contract.pods import AWAKE_TRUE, LABEL_AWAKE
from warmpool.contract.zero import (
    ENDPOINTSLICE_MANAGER,
    HELD_CLOCK_SKEW_SECONDS,
    HELD_COUNT_MAX,
    LABEL_ENDPOINTSLICE_MANAGED_BY,
    LABEL_SERVICE_NAME,
    BadHeldValue,
    held_annotation,
    held_value,
    read_held,
)

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0


def _spec(**pool: Any) -> api.WarmModelSpec:
    zero_policy = {"afterIdleSeconds": 600, "holdTimeoutSeconds": 60, "maxHeldRequests": 5}
    return api.parse_spec({"model": {"hostPath": {"path": "/models/m"}},
                           "pool": {"replicas": 0, "minWarm": 0, "scaleToZero": zero_policy, **pool}})


def _policy() -> api.ScaleToZeroSpec:
    policy = _spec().pool.scale_to_zero
    assert policy is not None
    return policy


def test_held_counts_sum_the_live_replicas_and_leave_out_stale_garbage_and_foreign_keys() -> None:
    annotations = {
        held_annotation("activator-a"): held_value(3, NOW - 5),
        held_annotation("activator-b"): held_value(2, NOW),
        # Not rewritten for longer than the hold timeout plus the grace: its replica died.
        held_annotation("activator-dead"): held_value(7, NOW - 60 - zero.STALE_GRACE_SECONDS - 1),
        held_annotation("activator-idle"): held_value(0, NOW),
        held_annotation("activator-garbage"): "many",
        "example.com/held": "9 1800000000",
    }
    held = zero.held_requests(annotations, _policy().hold_timeout_seconds, NOW)
    assert (held.requests, held.replicas) == (5, 2)
    assert [bad.key for bad in held.ignored] == [held_annotation("activator-garbage")]
    assert zero.held_requests({}, _policy().hold_timeout_seconds, NOW) == zero.Held()


@pytest.mark.parametrize("value", ["", "3", "3 x", "-1 5", "1.5 5", "1 2 3 4", None, 7,
                                   # Other scripts' digits: str.isdigit() takes them all, int() some.
                                   "\u00b2 1", "1 \u00b2", "\u0663 5", "\uff13 5", "3 \u0661\u0668\u0660\u0660",
                                   "+1 5", " 1 5", "1  5", "1\t5", "1_0 5", "1e3 5", "nan 5", "inf 5",
                                   f"{HELD_COUNT_MAX + 1} 5", "9" * 5000 + " 5", "1 " + "9" * 400, "1 99999999999"])
def test_a_malformed_held_value_is_refused(value: object) -> None:
    with pytest.raises(BadHeldValue):
        read_held(value)


@pytest.mark.parametrize(("value", "why"), [("\u00b2 1", "count: '\\xb2' is not a whole number in ASCII digits"),
                                            ("3 soon", "time: 'soon' is not a whole number in ASCII digits"),
                                            (f"{HELD_COUNT_MAX + 1} 1", f"count: {HELD_COUNT_MAX + 1} is outside"),
                                            ("many", "'many' is not '<count> <unix time>[ <traceparent>]'")])
def test_a_bad_held_value_says_what_is_wrong(value: str, why: str) -> None:
    with pytest.raises(BadHeldValue) as raised:
        read_held(value)
    assert str(raised.value).startswith(why)


def test_a_bad_held_value_is_ignored_and_listed_not_raised() -> None:
    """What wedged every pass: "\u00b2" passes str.isdigit(), then int() raises."""
    key = held_annotation("x")
    held = zero.held_requests({key: "\u00b2 1", held_annotation("y"): held_value(2, NOW)}, 60, NOW)
    assert (held.requests, held.replicas) == (2, 1)
    (bad,) = held.ignored
    assert (bad.key, bad.value) == (key, "\u00b2 1") and "ASCII digits" in bad.why


def test_a_held_time_ahead_of_the_operators_clock_is_not_believed() -> None:
    """Another pod's clock never keeps a count fresh: a time past now plus the skew is ignored."""
    near, far = held_annotation("near"), held_annotation("far")
    annotations = {near: held_value(2, NOW + HELD_CLOCK_SKEW_SECONDS),
                   far: held_value(3, NOW + HELD_CLOCK_SKEW_SECONDS + 1)}
    held = zero.held_requests(annotations, 60, NOW)
    assert held.requests == 2
    assert [(bad.key, "ahead of the operator's clock" in bad.why) for bad in held.ignored] == [(far, True)]
    # Ten years on, the far value is no fresher than an honest one written then: stale.
    assert zero.held_requests({far: annotations[far]}, 60, NOW + 10 * 365 * 86400).requests == 0


def test_the_count_bound_covers_every_count_the_api_allows_an_activator_to_hold() -> None:
    assert api.MAX_ZERO_HELD_REQUESTS <= HELD_COUNT_MAX
    assert read_held(held_value(api.MAX_ZERO_HELD_REQUESTS, NOW)) == (api.MAX_ZERO_HELD_REQUESTS, NOW, None)


def test_held_values_round_trip() -> None:
    assert read_held(held_value(4, NOW + 0.9)) == (4, NOW, None)


def _inputs(**overrides: Any) -> zero.ZeroInputs:
    values: dict[str, Any] = {"held": 0, "live_pods": 1, "settled_pods": 1, "idle_seconds": 0.0, "was_at_zero": False}
    return zero.ZeroInputs(**{**values, **overrides})


def test_a_held_request_brings_the_pool_back_and_says_why() -> None:
    made = zero.decide(_policy(), _inputs(held=2, was_at_zero=True, live_pods=0, settled_pods=0))
    assert not made.at_zero and made.change is not None and "2 request(s) held" in made.change
    # Already out of zero: no change to announce.
    assert zero.decide(_policy(), _inputs(held=2)) == zero.ZeroDecision(False)


def test_the_pool_goes_to_zero_only_when_idle_long_enough_and_every_pod_settled() -> None:
    policy = _policy()
    assert zero.decide(policy, _inputs(idle_seconds=599)) == zero.ZeroDecision(False)
    assert zero.decide(policy, _inputs(idle_seconds=None)) == zero.ZeroDecision(False)
    # A pod still starting (for a request just answered) keeps the pool up.
    assert zero.decide(policy, _inputs(idle_seconds=900, live_pods=2, settled_pods=1)) == zero.ZeroDecision(False)
    made = zero.decide(policy, _inputs(idle_seconds=600))
    assert made.at_zero and made.change == "no request for 600s (afterIdleSeconds 600)"
    # At zero with nothing held: it stays, and there is nothing new to say.
    assert zero.decide(policy, _inputs(was_at_zero=True, live_pods=0, settled_pods=0)) == zero.ZeroDecision(True)


PODS = [zero.Endpoint("10.1.0.9", "m-b", "ns", "uid-b"), zero.Endpoint("10.1.0.7", "m-a", "ns", "uid-a")]
ACTIVATORS = [zero.Endpoint("10.1.0.2", "activator-0", "warmpool", "uid-x")]


def test_the_slices_list_the_pods_when_there_are_any_and_the_activator_otherwise() -> None:
    target = Target("m", "ns", _spec())
    pods_slice, activator_slice = zero.build_slices(target, PODS, ACTIVATORS, 8012)
    assert [e["addresses"] for e in pods_slice["endpoints"]] == [["10.1.0.7"], ["10.1.0.9"]]
    assert pods_slice["endpoints"][0]["targetRef"] == {"kind": "Pod", "namespace": "ns", "name": "m-a", "uid": "uid-a"}
    assert pods_slice["ports"][0]["port"] == target.spec.pod.port
    assert activator_slice["endpoints"] == []
    for made in (pods_slice, activator_slice):
        labels = made["metadata"]["labels"]
        assert labels[LABEL_SERVICE_NAME] == "m" and labels[LABEL_ENDPOINTSLICE_MANAGED_BY] == ENDPOINTSLICE_MANAGER
    assert (pods_slice["metadata"]["name"], activator_slice["metadata"]["name"]) == zero.slice_names("m")

    pods_slice, activator_slice = zero.build_slices(target, [], ACTIVATORS, 8012)
    assert pods_slice["endpoints"] == []
    assert [e["addresses"] for e in activator_slice["endpoints"]] == [["10.1.0.2"]]
    # The activator's port, under the port name the Service's targetPort resolves.
    assert activator_slice["ports"][0]["port"] == 8012
    assert activator_slice["ports"][0]["name"] == pods_slice["ports"][0]["name"]


def test_a_scale_to_zero_service_has_no_selector_and_targets_the_port_by_number() -> None:
    target = Target("m", "ns", _spec())
    service = build_service(target)
    assert "selector" not in service["spec"]
    assert service["spec"]["ports"][0]["targetPort"] == target.spec.pod.port
    plain = build_service(Target("m", "ns", api.parse_spec({"model": {"hostPath": {"path": "/models/m"}}})))
    assert plain["spec"]["selector"]


def test_the_activators_ready_addresses_are_read_from_its_own_slices() -> None:
    slices = [{"ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8012}],
               "endpoints": [{"addresses": ["10.1.0.3"], "conditions": {"ready": True},
                              "targetRef": {"name": "a-1", "namespace": "warmpool", "uid": "u1"}},
                             {"addresses": ["10.1.0.4"], "conditions": {"ready": False}}]}]
    found, port = zero.ready_endpoints(slices)
    assert found == [zero.Endpoint("10.1.0.3", "a-1", "warmpool", "u1")] and port == 8012
    assert zero.ready_endpoints([]) == ([], None)


def test_replicas_are_zero_at_zero_and_at_least_one_otherwise() -> None:
    spec = _spec()
    assert scaling.desired_replicas(spec, at_zero=True) == 0
    assert scaling.desired_replicas(spec) == 1  # out of zero because a request wants a pod
    assert scaling.desired_replicas(_spec(replicas=3, maxReplicas=4)) == 3
    # A forecast burst raises a pool at zero too.
    assert scaling.with_prediction(spec, 0, 2, at_zero=True) == 2
    assert scaling.with_prediction(spec, 0, None, at_zero=True) == 0


def _ready(zero_state: zero.ZeroState) -> tuple[dict[str, Any], dict[str, Any]]:
    out = st.compute_status(name="m", spec=_spec(), generation=1, pods=[], deployment=None, cold_starts=ColdStarts(),
                            previous=None, now="2026-01-01T00:00:00Z", zero=zero_state)
    return {c["type"]: c for c in out["conditions"]}["Ready"], out


def test_ready_says_at_zero_will_start_on_demand_and_status_shows_the_held_requests() -> None:
    ready, out = _ready(zero.ZeroState(at_zero=True, held=0))
    assert (ready["status"], ready["reason"]) == ("True", zero.REASON_SCALED_TO_ZERO)
    assert "will start on demand" in ready["message"] and out["held"] == 0
    ready, out = _ready(zero.ZeroState(at_zero=False, held=3))
    assert (ready["status"], ready["reason"]) == ("False", zero.REASON_STARTING_ON_DEMAND)
    assert "3 request(s) held" in ready["message"] and out["held"] == 3


@pytest.mark.parametrize(("sleep", "error"), [
    ({"minAwake": 1}, "spec.pool.sleep.minAwake must be 0 with spec.pool.scaleToZero"),
    ({"minAwake": 0, "afterIdleSeconds": 600},
     "spec.pool.sleep.afterIdleSeconds must be below spec.pool.scaleToZero.afterIdleSeconds"),
])
def test_combinations_that_cannot_work_are_refused_by_name(sleep: dict[str, Any], error: str) -> None:
    with pytest.raises(api.InvalidWarmModel) as caught:
        _spec(sleep=sleep)
    assert any(error in message for message in caught.value.errors), caught.value.errors
    assert _spec(sleep={"minAwake": 0, "afterIdleSeconds": 300}).pool.sleep is not None


def test_scale_to_zero_bounds_are_checked() -> None:
    with pytest.raises(api.InvalidWarmModel) as caught:
        api.parse_spec({"model": {"hostPath": {"path": "/models/m"}},
                        "pool": {"scaleToZero": {"afterIdleSeconds": 0, "maxHeldRequests": 0}}})
    assert {e.split(":")[0] for e in caught.value.errors} >= {
        "spec.pool.scaleToZero.afterIdleSeconds", "spec.pool.scaleToZero.maxHeldRequests"}
    with pytest.raises(api.InvalidWarmModel, match="afterIdleSeconds"):
        api.parse_spec({"model": {"hostPath": {"path": "/models/m"}}, "pool": {"scaleToZero": {}}})


def test_a_pool_gone_to_zero_keeps_its_pods_until_kube_proxy_followed_the_switch() -> None:
    from warmpool_operator.control.zero import ROUTE_SETTLE_SECONDS, ZeroMemory

    memory = ZeroMemory(at_zero=True, went_to_zero=100.0)
    assert memory.settling(100.0 + ROUTE_SETTLE_SECONDS - 0.1)
    assert not memory.settling(100.0 + ROUTE_SETTLE_SECONDS)
    # Read back at zero after a restart (no switch seen), or out of zero: nothing to wait for.
    assert not ZeroMemory(at_zero=True).settling(0.0)
    assert not ZeroMemory(at_zero=False, went_to_zero=100.0).settling(100.0)


def _pod(uid: str, ready: bool, awake: bool = True) -> dict[str, Any]:
    labels = {LABEL_AWAKE: AWAKE_TRUE if awake else "false"}
    return {"metadata": {"uid": uid, "name": f"m-{uid}", "labels": labels},
            "status": {"podIP": f"10.244.0.{len(uid)}", "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_pods_turned_ready_are_routed_first_only_for_a_pool_that_left_zero() -> None:
    pods = {"a": _pod("a", ready=True), "bb": _pod("bb", ready=False), "ccc": _pod("ccc", ready=True, awake=False)}
    refs = [PodRef(uid=uid, name=f"m-{uid}", node="n", ip=f"10.244.0.{len(uid)}") for uid in pods]
    target = Target(name="m", namespace="ns", spec=_spec())
    left = zero_step.ZeroMemory(at_zero=False)
    assert [e.pod for e in zero_step.ready_first(target, left, refs, pods)] == ["m-a"]
    # At zero (its pods still settling, out of the Service), or not known yet: the pass's own step decides.
    assert zero_step.ready_first(target, zero_step.ZeroMemory(at_zero=True), refs, pods) == []
    assert zero_step.ready_first(target, zero_step.ZeroMemory(), refs, pods) == []
    plain = api.parse_spec({"model": {"hostPath": {"path": "/models/m"}}})
    assert zero_step.ready_first(Target(name="m", namespace="ns", spec=plain), left, refs, pods) == []


def test_each_bad_held_value_is_announced_once_and_a_clock_ahead_once_while_it_stays_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    warned: list[str] = []
    # kopf posts Events from its own handler context only; here the message is what counts.
    monkeypatch.setattr(kopf, "event", lambda *_, message, **__: warned.append(message))
    memory, owner = zero_step.ZeroMemory(), {"metadata": {"name": "m", "namespace": "ns"}}
    skewed, garbled = held_annotation("skewed"), held_annotation("garbled")

    def passes(*values: tuple[str, str, float]) -> None:
        for key, value, now in values:
            zero_step.announce_ignored(memory, owner, zero.held_requests({key: value}, 60, now).ignored)

    ahead = HELD_CLOCK_SKEW_SECONDS + 30
    # The skewed activator rewrites its value every few seconds, each time ahead: one Event.
    passes(*((skewed, held_value(1, NOW + step + ahead), NOW + step) for step in range(0, 60, 10)))
    assert len(warned) == 1 and skewed in warned[0] and "ahead of the operator's clock" in warned[0]
    # Garbage: one Event per distinct value, however many passes see it.
    passes((garbled, "\u00b2 1", NOW), (garbled, "\u00b2 1", NOW), (garbled, "\u00b3 1", NOW))
    assert len(warned) == 3 and all(garbled in message for message in warned[1:])


# --------------------------------------------------------------------------- one parser of scaleToZero


def _warmmodel(scale_to_zero: object) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": "m", "uid": "u-1"},
            "spec": {"model": {"hostPath": {"path": "/models/m"}}, "pool": {"scaleToZero": scale_to_zero}}}


def test_scale_to_zero_is_read_by_the_api_model_everywhere_with_its_defaults() -> None:
    """The pass (the whole spec), the activator (its hold policy) and a pass's trace read the same
    fields with the same defaults, from one parser."""
    from warmpool_operator.activator.pools import HoldPolicy, Pools

    body = _warmmodel({"afterIdleSeconds": 30})
    parsed = zero.scale_to_zero_of(body)
    assert parsed == api.parse_spec(body["spec"]).pool.scale_to_zero
    assert parsed is not None and (parsed.hold_timeout_seconds, parsed.max_held_requests) == (
        api.DEFAULT_ZERO_HOLD_TIMEOUT_SECONDS, api.DEFAULT_ZERO_MAX_HELD_REQUESTS)
    pools = Pools()
    pools.warmmodel("ADDED", body)
    pool = pools.pool(("ns", "m"))
    assert pool.scale_to_zero and pool.policy == HoldPolicy(float(parsed.hold_timeout_seconds),
                                                            parsed.max_held_requests)
    assert zero.scale_to_zero_of(_warmmodel(None)) is None


@pytest.mark.parametrize(("scale_to_zero", "named"), [
    ({"afterIdleSeconds": 30, "maxHeldRequests": 0}, "spec.pool.scaleToZero.maxHeldRequests"),
    ({"afterIdleSeconds": 30, "holdTimeoutSeconds": "60"}, "spec.pool.scaleToZero.holdTimeoutSeconds"),
    ({"holdTimeoutSeconds": 60}, "spec.pool.scaleToZero.afterIdleSeconds"),
    ("yes", "spec.pool.scaleToZero: not an object"),
])
def test_a_bad_scale_to_zero_is_refused_by_name_and_the_activator_holds_nothing_for_it(
        scale_to_zero: object, named: str) -> None:
    """The activator used its own defaults for what the API refuses (maxHeldRequests 0 held 100)."""
    from warmpool_operator.activator.pools import Pools

    with pytest.raises(api.InvalidWarmModel, match=named):
        zero.scale_to_zero_of(_warmmodel(scale_to_zero))
    pools = Pools()
    pools.warmmodel("ADDED", _warmmodel(scale_to_zero))
    assert not pools.pool(("ns", "m")).scale_to_zero
    assert zero_step.hold_trace(_warmmodel(scale_to_zero), NOW) is None
