"""Container records and the pod status the local kubelet patches."""

from __future__ import annotations

from typing import Any

import pytest
from warmpool_devcluster.kubelet_status import ContainerRecord, build_status, pod_phase

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0


def _pod(conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "p"}, "spec": {"containers": []}, "status": {"conditions": conditions or []}}


def _conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status["conditions"]}


def test_lifecycle_of_a_container_record() -> None:
    record = ContainerRecord("web", "img")
    assert pod_phase([record]) == "Pending"
    record.set_running(T0, "warmpool://1")
    assert record.restart_count == 0 and pod_phase([record]) == "Running"
    record.set_terminated(-9, T0, T0 + 5, final=False)  # killed, will restart
    assert record.last_state["terminated"]["exitCode"] == 137
    assert record.last_state["terminated"]["reason"] == "Error"
    record.set_waiting("CrashLoopBackOff", "back-off 10s")
    record.set_running(T0 + 15, "warmpool://2")
    assert record.restart_count == 1
    record.set_terminated(0, T0 + 15, T0 + 20, final=True)
    assert record.finished and pod_phase([record]) == "Succeeded"
    failed = ContainerRecord("b", "img", has_run=True)
    failed.set_terminated(1, T0, T0, final=True)
    assert pod_phase([record, failed]) == "Failed"


def test_ready_only_when_every_container_is_ready() -> None:
    a, b = ContainerRecord("a", "img"), ContainerRecord("b", "img")
    for record in (a, b):
        record.set_running(T0, "x")
    a.ready = True
    status = build_status(_pod(), [a, b], sandbox_ready=True, start_time="t", now=T0)
    assert _conditions(status) == {
        "PodReadyToStartContainers": "True", "Initialized": "True", "ContainersReady": "False", "Ready": "False"}
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "ContainersNotReady" and ready["message"] == "containers with unready status: [b]"
    b.ready = True
    status = build_status(_pod(), [a, b], sandbox_ready=True, start_time="t", now=T0)
    assert _conditions(status)["Ready"] == "True"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] is None  # null clears the old reason in a strategic merge patch
    assert [s["ready"] for s in status["containerStatuses"]] == [True, True]


def test_transition_time_is_kept_while_status_is_unchanged() -> None:
    record = ContainerRecord("a", "img")
    earlier = [{"type": "Ready", "status": "False", "lastTransitionTime": "2020-01-01T00:00:00Z"}]
    status = build_status(_pod(earlier), [record], sandbox_ready=True, start_time="t", now=T0)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    record.set_running(T0, "x")
    record.ready = True
    status = build_status(_pod(earlier), [record], sandbox_ready=True, start_time="t", now=T0)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["lastTransitionTime"] == "2023-11-14T22:13:20Z"


def test_readiness_gates_hold_ready_back() -> None:
    record = ContainerRecord("a", "img")
    record.set_running(T0, "x")
    record.ready = True
    pod = _pod([{"type": "example.com/gate", "status": "False"}])
    pod["spec"]["readinessGates"] = [{"conditionType": "example.com/gate"}]
    status = build_status(pod, [record], sandbox_ready=True, start_time="t", now=T0)
    assert _conditions(status)["ContainersReady"] == "True" and _conditions(status)["Ready"] == "False"


def test_init_containers_gate_initialized_and_phase() -> None:
    init, main = ContainerRecord("init", "img"), ContainerRecord("main", "img")
    init.set_running(T0, "x")
    status = build_status(_pod(), [main], sandbox_ready=True, start_time="t", now=T0, init_records=[init])
    assert status["phase"] == "Pending" and _conditions(status)["Initialized"] == "False"
    assert [s["name"] for s in status["initContainerStatuses"]] == ["init"]
    init.set_terminated(0, T0, T0 + 1, final=True)
    main.set_running(T0 + 1, "y")
    status = build_status(_pod(), [main], sandbox_ready=True, start_time="t", now=T0, init_records=[init])
    assert status["phase"] == "Running" and _conditions(status)["Initialized"] == "True"
    failed = ContainerRecord("init", "img", has_run=True)
    failed.set_terminated(2, T0, T0 + 1, final=True)
    assert pod_phase([ContainerRecord("main", "img")], [failed]) == "Failed"
