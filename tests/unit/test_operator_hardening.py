"""The operator's pure hardening rules (issue #12): whose pods are scraped, which pods make the
pool grow, what counts as a drifted child, and what status says when metrics cannot be read."""

from __future__ import annotations

from typing import Any

import pytest
from warmpool_operator.api.types import WarmModelSpec, parse_spec
from warmpool_operator.io import worker_metrics as scrape
from warmpool_operator.model import Sample, Target
from warmpool_operator.rules import scaling
from warmpool_operator.rules import status as st
from warmpool_operator.rules.builders import build_deployment, build_service
from warmpool_operator.rules.drift import child_drifted, covers
from warmpool_operator.rules.observation import ColdStarts, PodObservation
from warmpool_operator.rules.ownership import deployment_pods, owned_by

from warmpool.contract.metrics import METRIC_READY

pytestmark = pytest.mark.unit

DEPLOYMENT_UID = "dep-uid"


def _ref(kind: str, uid: str, controller: bool = True) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": kind, "name": "x", "uid": uid, "controller": controller}


def _pod(name: str, owner: dict[str, Any] | None, host_network: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}"}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"metadata": meta, "spec": {"hostNetwork": host_network} if host_network else {}}


def test_only_pods_of_our_deployment_through_its_replicaset_are_ours() -> None:
    replicasets = [
        {"metadata": {"uid": "rs-ours", "ownerReferences": [_ref("Deployment", DEPLOYMENT_UID)]}},
        {"metadata": {"uid": "rs-foreign", "ownerReferences": [_ref("Deployment", "someone-else")]}},
    ]
    pods = [
        _pod("ours", _ref("ReplicaSet", "rs-ours")),
        _pod("labelled-only", None),  # carries our labels, owned by nobody
        _pod("foreign-rs", _ref("ReplicaSet", "rs-foreign")),
        _pod("not-controller", _ref("ReplicaSet", "rs-ours", controller=False)),
        _pod("host-network", _ref("ReplicaSet", "rs-ours"), host_network=True),
    ]
    ours, others = deployment_pods(pods, replicasets, DEPLOYMENT_UID)
    assert [p["metadata"]["name"] for p in ours] == ["ours"]
    assert {p["metadata"]["name"] for p in others} == {"labelled-only", "foreign-rs", "not-controller",
                                                       "host-network"}


def test_ownership_is_the_uid_not_the_name() -> None:
    obj = {"metadata": {"name": "m", "ownerReferences": [{"kind": "WarmModel", "name": "m", "uid": "old"}]}}
    assert not owned_by(obj, "new") and owned_by(obj, "old") and not owned_by({"metadata": {}}, "new")


def _spec(**pool: int) -> WarmModelSpec:
    return parse_spec({"model": {"hostPath": {"path": "/m"}},
                       "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": 3, **pool}})


def _live(desired: dict[str, Any]) -> dict[str, Any]:
    """What the API server gives back: desired plus defaults and server-set fields, zero values omitted."""
    import copy

    live = copy.deepcopy(desired)
    live["metadata"].update(uid="u", resourceVersion="7", generation=1)
    live["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "1"
    spec = live["spec"]
    spec.pop("minReadySeconds")  # omitempty: 0 comes back as absent
    container = spec["template"]["spec"]["containers"][0]
    container["terminationMessagePath"] = "/dev/termination-log"
    container["imagePullPolicy"] = "IfNotPresent"
    spec["template"]["spec"]["dnsPolicy"] = "ClusterFirst"
    live["status"] = {"replicas": 1}
    return live


def test_a_defaulted_live_child_is_not_drift() -> None:
    desired = build_deployment(Target("m", "ns", _spec()))
    assert not child_drifted(_live(desired), desired)


@pytest.mark.parametrize("edit", ["image", "args", "extra-arg", "replicas", "port", "extra-port", "selector"])
def test_hand_edits_are_drift(edit: str) -> None:
    desired = build_deployment(Target("m", "ns", _spec()))
    live = _live(desired)
    container = live["spec"]["template"]["spec"]["containers"][0]
    if edit == "image":
        container["image"] = "evil:latest"
    elif edit == "args":
        container["args"][0] = "--host=0.0.0.0"
    elif edit == "extra-arg":
        container["args"].append("--debug")
    elif edit == "replicas":
        live["spec"]["replicas"] = 5
    elif edit == "port":
        container["ports"][0]["containerPort"] = 9999
    elif edit == "extra-port":
        container["ports"].append({"name": "x", "containerPort": 1, "protocol": "TCP"})
    elif edit == "selector":
        live["spec"]["selector"]["matchLabels"]["extra"] = "1"
    assert child_drifted(live, desired), edit


def test_service_selector_and_ports_drift() -> None:
    desired = build_service(Target("m", "ns", _spec()))
    live = _live_service(desired)
    assert not child_drifted(live, desired)
    live["spec"]["selector"] = {"app": "someone-else"}
    assert child_drifted(live, desired)


def _live_service(desired: dict[str, Any]) -> dict[str, Any]:
    import copy

    live = copy.deepcopy(desired)
    live["spec"].update(clusterIP="10.0.0.1", type="ClusterIP", sessionAffinity="None")
    live["spec"].pop("publishNotReadyAddresses")  # false is omitted
    live["spec"]["ports"][0]["targetPort"] = "http"
    return live


def test_covers_treats_omitted_zero_values_as_equal() -> None:
    assert covers(None, 0) and covers(None, False) and covers(None, {}) and covers({}, {"a": False})
    assert not covers(None, 1) and not covers([1, 2], [1]) and covers({"a": 1, "b": 2}, {"a": 1})


def _sample(ready: bool) -> Sample:
    return scrape.parse_metrics(f"{METRIC_READY} {1 if ready else 0}\n")


def _obs(name: str, *, ready: bool, sample: Sample | None) -> PodObservation:
    return PodObservation(uid=name, name=name, ready=ready, terminating=False, sample=sample, decision=None)


def test_unreadable_pods_never_make_the_pool_grow() -> None:
    unreadable = [_obs("a", ready=True, sample=None), _obs("b", ready=True, sample=Sample(error="timeout"))]
    assert scaling.extra_pods(unreadable, min_warm=2) == 0
    # Pods whose own metrics say "not warm yet" do count, up to what minWarm lacks.
    warming = [_obs("c", ready=True, sample=_sample(False)), _obs("d", ready=True, sample=_sample(False))]
    assert scaling.extra_pods(warming, min_warm=1) == 1
    assert scaling.extra_pods([*warming, _obs("e", ready=True, sample=_sample(True))], min_warm=1) == 0
    assert scaling.extra_pods([*warming, *unreadable], min_warm=3) == 2


def test_ready_says_metrics_unavailable_with_the_pod_names() -> None:
    pods = [_obs("cold-start", ready=False, sample=None), _obs("silent", ready=True, sample=None)]
    deployment = {"metadata": {"generation": 1}, "spec": {"replicas": 2},
                  "status": {"observedGeneration": 1, "updatedReplicas": 2, "replicas": 2}}
    out = st.compute_status(name="m", spec=_spec(), generation=1, pods=pods, deployment=deployment,
                            cold_starts=ColdStarts(), previous=None, now="2026-01-01T00:00:00Z")
    ready = {c["type"]: c for c in out["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == st.REASON_METRICS_UNAVAILABLE
    assert "silent" in ready["message"] and "cold-start" not in ready["message"]
    # A pod still starting (not Ready, not yet answering) is ordinary warming, not a metrics problem.
    out = st.compute_status(name="m", spec=_spec(), generation=1, pods=pods[:1], deployment=deployment,
                            cold_starts=ColdStarts(), previous=None, now="2026-01-01T00:00:00Z")
    assert {c["type"]: c for c in out["conditions"]}["Ready"]["reason"] == st.REASON_BELOW_MIN_WARM


def test_a_restarted_operator_keeps_the_extra_pods_the_live_deployment_runs() -> None:
    spec = _spec(replicas=1, minWarm=2, maxReplicas=4)  # asks for 2 pods
    assert scaling.extra_from_live(spec, 3) == 1
    assert scaling.extra_from_live(spec, 2) == 0 and scaling.extra_from_live(spec, 0) == 0
    assert scaling.extra_from_live(spec, 9) == 2  # never above maxReplicas
