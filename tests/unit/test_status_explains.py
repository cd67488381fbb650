"""A status that explains (issue 42, item 4), its pure rules: `kubectl get wm`'s columns, each
pod's cold-start progress (bounded), status.url, the Ready transitions that post Events, and a
failing pod's own last words (its termination message) in the Ready condition."""

from __future__ import annotations

from typing import Any

import pytest
from warmpool_operator.api import crdgen
from warmpool_operator.api.types import MAX_LISTED_PODS, WarmModelSpec, WarmModelStatus, parse_spec
from warmpool_operator.io.worker_metrics import parse_metrics
from warmpool_operator.model import Sample
from warmpool_operator.rules import progress
from warmpool_operator.rules import status as st
from warmpool_operator.rules.builders import build_deployment
from warmpool_operator.rules.observation import ColdStarts, PodObservation, pod_failure, pod_state

from warmpool.contract.pods import TERMINATION_MESSAGE_PATH, WORKER_CONTAINER

pytestmark = pytest.mark.unit

NOW = "2026-01-01T00:00:00Z"
DENIED = ("model load failed: /models/m/model.safetensors: cannot read: [Errno 13] Permission denied: "
          "'/models/m/model.safetensors'")


def _spec(min_warm: int = 1) -> WarmModelSpec:
    return parse_spec({"model": {"hostPath": {"path": "/m"}}, "pool": {"replicas": 2, "minWarm": min_warm}})


def _warm(name: str) -> PodObservation:
    sample = Sample(ready=True, phase_durations={"ready": 12.0}, phase_timestamps={"ready": 1000.0},
                    layers_resident=4, layers_total=4)
    return PodObservation(name, name, ready=True, terminating=False, sample=sample, decision=None)


def _warming(name: str, started: float) -> PodObservation:
    sample = Sample(ready=False, layers_resident=2, layers_total=4,
                    phase_durations={"process_start": 0.0, "imports_done": 1.0, "weights_mapped": 2.0},
                    phase_timestamps={"process_start": started},
                    prefills={"32": 1.0, "128": 0.0}, planned_prefills={"32": 2.0, "128": 2.0})
    return PodObservation(name, name, ready=False, terminating=False, sample=sample, decision=None, state="Starting")


def _crashing_pod(termination_message: str) -> dict[str, Any]:
    """A pod as the kubelet reports one whose worker exited 1 and now waits in back-off."""
    return {"status": {"phase": "Running", "containerStatuses": [{
        "name": WORKER_CONTAINER, "ready": False, "restartCount": 3,
        "state": {"waiting": {"reason": "CrashLoopBackOff",
                              "message": "back-off 40s restarting failed container=worker pod=m-0"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": termination_message}},
    }]}}


def _failing(name: str, termination_message: str = DENIED) -> PodObservation:
    pod = _crashing_pod(termination_message)
    return PodObservation(name, name, ready=False, terminating=False, sample=None, decision=None,
                          failure=pod_failure(pod), state=pod_state(pod))


def _conditions(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in out["conditions"]}


def test_kubectl_get_shows_ready_warm_beside_min_warm_and_the_reason_by_default() -> None:
    columns = crdgen.printer_columns()
    default = [c["name"] for c in columns if not c.get("priority")]
    assert default[:3] == ["Ready", "Warm", "Min-Warm"] and "Status" in default
    by_name = {c["name"]: c for c in columns}
    assert by_name["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert by_name["Status"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].reason'
    assert by_name["URL"]["jsonPath"] == ".status.url" and by_name["URL"]["priority"] == 1


def test_a_crash_loops_termination_message_wins_over_the_kubelets_back_off_line() -> None:
    failure = pod_failure(_crashing_pod(DENIED))
    assert failure is not None
    assert "CrashLoopBackOff (exit code 1, 3 restarts)" in failure
    assert "model.safetensors" in failure and "Permission denied" in failure and "back-off" not in failure
    # The kubelet's fallback (the log's tail, many lines): the last lines, bounded.
    tail = "\n".join([f"line {i}" for i in range(80)] + [DENIED, "worker stopped (exit 1)"])
    failure = pod_failure(_crashing_pod(tail))
    assert failure is not None and "Permission denied" in failure and "line 0 " not in failure
    assert len(failure) < 700


def test_a_container_that_just_exited_on_an_error_is_failing_before_its_first_restart() -> None:
    def exited(terminated: dict[str, Any]) -> dict[str, Any]:
        return {"status": {"phase": "Running", "containerStatuses": [{
            "name": WORKER_CONTAINER, "ready": False, "restartCount": 0, "state": {"terminated": terminated}}]}}

    failure = pod_failure(exited({"exitCode": 1, "reason": "Error", "message": DENIED}))
    assert failure is not None and "Error (exit code 1, 0 restarts)" in failure and "Permission denied" in failure
    assert pod_failure(exited({"exitCode": 0, "reason": "Completed"})) is None


def test_below_min_warm_the_ready_condition_names_the_failing_pods_and_their_last_words() -> None:
    pods = [_failing(f"m-{i}") for i in range(5)]
    out = st.compute_status(name="m", spec=_spec(), generation=1, pods=pods, deployment=None,
                            cold_starts=ColdStarts(), previous=None, now=NOW)
    ready = _conditions(out)["Ready"]
    assert ready["status"] == "False" and ready["reason"] == st.REASON_BELOW_MIN_WARM
    assert "m-0: container worker CrashLoopBackOff" in ready["message"] and "Permission denied" in ready["message"]
    assert f"and {5 - st.FAILURES_SHOWN} more" in ready["message"] and "m-4" not in ready["message"]


def test_a_pod_on_a_lost_node_is_named_with_its_nodes_failure_though_its_ready_was_never_updated() -> None:
    """A dead node's kubelet never turns its pods' Ready False: the operator's own judgement of the
    node (rules/node_health.py) is what the Ready condition shows, not "metrics unavailable"."""
    lost = PodObservation("m-lost", "m-lost", ready=True, terminating=False, sample=Sample(error="timeout"),
                          decision=None, failure="node b: no worker pod there answers its scrapes while pods on "
                                                 "other nodes do: replaced on another node", node_lost=True)
    out = st.compute_status(name="m", spec=_spec(min_warm=2), generation=1, pods=[_warm("m-a"), lost],
                            deployment=None, cold_starts=ColdStarts(), previous=None, now=NOW)
    ready = _conditions(out)["Ready"]
    assert ready["reason"] == st.REASON_BELOW_MIN_WARM, ready
    assert "m-lost: node b: no worker pod there answers its scrapes" in ready["message"]


def test_each_pods_progress_stage_layers_prefills_and_time_left_from_the_pools_past_cold_starts() -> None:
    cold = ColdStarts()
    for i, seconds in enumerate((30.0, 40.0, 50.0)):
        cold.record(f"old{i}", Sample(phase_durations={"ready": seconds}, phase_timestamps={"ready": 900.0 + i}))
    pods = [_warm("m-a"), _warming("m-b", started=1000.0), _failing("m-c")]
    out = st.compute_status(name="m", spec=_spec(), generation=1, pods=pods, deployment=None, cold_starts=cold,
                            previous=None, now=NOW, wall=1015.0)
    listed = out["pods"]
    assert [p["name"] for p in listed] == ["m-c", "m-b", "m-a"]  # failing, warming, warm
    failing, warming, warm = listed
    assert failing["stage"] == "CrashLoopBackOff" and "Permission denied" in failing["message"]
    assert "secondsLeft" not in failing
    # Median past cold start 40 s, 15 s in: 25 s left.  1 of 4 planned prefills done.
    assert warming == {"name": "m-b", "stage": "weights_mapped", "warm": False, "layersResident": 2,
                       "layersTotal": 4, "prefillsDone": 1, "prefillsPlanned": 4, "secondsLeft": 25}
    assert warm["stage"] == "ready" and warm["warm"] is True and "secondsLeft" not in warm
    assert "podsNotListed" not in out
    WarmModelStatus.model_validate(out)  # what the CRD's schema takes
    # No past cold start: no estimate, rather than a guess.
    fresh = st.compute_status(name="m", spec=_spec(), generation=1, pods=pods, deployment=None,
                              cold_starts=ColdStarts(), previous=None, now=NOW, wall=1015.0)
    assert "secondsLeft" not in fresh["pods"][1]


def test_a_large_pools_progress_is_bounded_and_the_rest_counted() -> None:
    pods = [_warm(f"w-{i:03d}") for i in range(200)] + [_warming("x-cold", started=1.0)]
    found = progress.pool_progress(pods, None, None)
    assert len(found.pods) == MAX_LISTED_PODS and found.not_listed == 201 - MAX_LISTED_PODS
    assert found.pods[0].name == "x-cold"  # the pod that is not warm is never the one left out


def test_status_url_is_the_pool_services_in_cluster_address() -> None:
    out = st.compute_status(name="m", spec=_spec(), generation=1, pods=(), deployment=None,
                            cold_starts=ColdStarts(), previous=None, now=NOW,
                            url=st.pool_url("m", "team-a", _spec().pod.port))
    assert out["url"] == f"http://m.team-a.svc:{_spec().pod.port}"


def test_events_once_per_ready_transition() -> None:
    def status(*pods: PodObservation, previous: dict[str, Any] | None = None) -> dict[str, Any]:
        return st.compute_status(name="m", spec=_spec(), generation=1, pods=pods, deployment=None,
                                 cold_starts=ColdStarts(), previous=previous, now=NOW)

    cold = status(_warming("m-0", 1.0))
    assert st.ready_transitions(None, cold) == []  # never was Ready: nothing fell
    warm = status(_warm("m-0"), previous=cold)
    (event,) = st.ready_transitions(cold, warm)
    assert (event.type, event.reason) == ("Normal", st.EVENT_POOL_READY) and "MinWarmReached" in event.message
    assert st.ready_transitions(warm, status(_warm("m-0"), previous=warm)) == []  # still Ready: no repeat
    fallen = status(_failing("m-0"), previous=warm)
    (event,) = st.ready_transitions(warm, fallen)
    assert (event.type, event.reason) == ("Warning", st.EVENT_BELOW_MIN_WARM)
    assert "Permission denied" in event.message
    assert st.ready_transitions(fallen, status(_failing("m-0"), previous=fallen)) == []
    # A Degraded spec posts its own Event: no second one for the Ready it takes down.
    degraded = st.compute_status(name="m", spec=None, generation=2, pods=(), deployment=None,
                                 cold_starts=ColdStarts(), previous=warm, now=NOW,
                                 degraded=st.Degradation(st.REASON_INVALID_SPEC, "bad"))
    assert st.ready_transitions(warm, degraded) == []


def test_the_worker_reports_planned_prefills_and_the_operator_reads_them() -> None:
    from warmpool_worker.metrics import WorkerMetrics

    worker = WorkerMetrics(process_start=1000.0)
    worker.set_planned({32: 2, 128: 3})
    worker.warmup_prefill_done(32)
    worker.warmup_prefill_done(32)
    worker.set_layers(3, 4)
    sample = parse_metrics(worker.render().decode())
    assert sample.planned_prefills == {"32": 2.0, "128": 3.0} and sample.prefills == {"32": 2.0}
    assert (sample.layers_resident, sample.layers_total) == (3, 4)
    assert sample.phase_timestamps["process_start"] == 1000.0


def test_the_worker_container_leaves_its_last_error_where_the_kubelet_reads_it() -> None:
    from warmpool_operator.model import Target

    target = Target(name="m", namespace="ns", spec=_spec(), cache=None, default_worker_image="w:1")
    (worker,) = [c for c in build_deployment(target, 1)["spec"]["template"]["spec"]["containers"]
                 if c["name"] == WORKER_CONTAINER]
    assert worker["terminationMessagePath"] == TERMINATION_MESSAGE_PATH
    assert worker["terminationMessagePolicy"] == "FallbackToLogsOnError"
