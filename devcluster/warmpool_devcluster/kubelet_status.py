"""Pure pod-status bookkeeping: container records in, the pod ``status`` a kubelet would report out."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Obj = Mapping[str, Any]

#: Waiting reason for a container whose command cannot run on this machine.
COMMAND_NOT_RUNNABLE = "CommandNotRunnable"
CONFIG_ERROR = "CreateContainerConfigError"
CRASH_LOOP = "CrashLoopBackOff"
CREATING = "ContainerCreating"

#: Condition types this kubelet owns, in the order a kubelet lists them.
OWNED_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


def rfc3339(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def exit_code(returncode: int) -> int:
    """asyncio reports death by signal N as -N; a container runtime reports 128+N."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class ContainerRecord:
    """What the kubelet knows about one container, kept in the API's ContainerStatus shape."""

    name: str
    image: str
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": CREATING}})
    last_state: dict[str, Any] = field(default_factory=dict)
    restart_count: int = 0
    started: bool = False
    ready: bool = False
    has_run: bool = False
    #: Terminated and will not be restarted (restartPolicy Never/OnFailure).
    finished: bool = False
    container_id: str | None = None

    def set_waiting(self, reason: str, message: str = "") -> None:
        waiting: dict[str, Any] = {"reason": reason}
        if message:
            waiting["message"] = message
        self.state = {"waiting": waiting}
        self.started = False
        self.ready = False

    def set_running(self, started_at: float, container_id: str) -> None:
        if self.has_run:
            self.restart_count += 1
        self.has_run = True
        self.container_id = container_id
        self.state = {"running": {"startedAt": rfc3339(started_at)}}
        self.started = False
        self.ready = False

    def set_terminated(self, returncode: int, started_at: float, finished_at: float, *, final: bool) -> None:
        """Record an exit: it becomes lastState, and the state itself when it is final."""
        code = exit_code(returncode)
        terminated: dict[str, Any] = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": rfc3339(started_at),
            "finishedAt": rfc3339(finished_at),
        }
        if self.container_id:
            terminated["containerID"] = self.container_id
        self.started = False
        self.ready = False
        if final:
            self.state = {"terminated": terminated}
            self.finished = True
        else:
            self.last_state = {"terminated": terminated}

    def exit_code(self) -> int | None:
        terminated = self.state.get("terminated")
        return int(terminated["exitCode"]) if terminated else None

    def to_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "name": self.name,
            "image": self.image,
            "imageID": f"warmpool-local://{self.image}",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status


def initialized(init_records: Sequence[ContainerRecord]) -> bool:
    return all(r.finished and r.exit_code() == 0 for r in init_records)


def pod_phase(records: Sequence[ContainerRecord], init_records: Sequence[ContainerRecord] = ()) -> str:
    """Pending until every container has run; Succeeded/Failed once all have finished for good."""
    if any(r.finished and r.exit_code() != 0 for r in init_records):
        return "Failed"  # an init container failed and will not be retried
    if not initialized(init_records):
        return "Pending"
    if records and all(r.finished for r in records):
        return "Succeeded" if all(r.exit_code() == 0 for r in records) else "Failed"
    if records and all(r.has_run for r in records):
        return "Running"
    return "Pending"


def _condition(
    previous: Mapping[str, Obj], kind: str, ok: bool, now: str, reason: str = "", message: str = ""
) -> dict[str, Any]:
    value = "True" if ok else "False"
    before = previous.get(kind)
    # Keep lastTransitionTime unless the status really changes, as a kubelet does.
    since = before.get("lastTransitionTime") if before and before.get("status") == value else None
    condition: dict[str, Any] = {"type": kind, "status": value, "lastTransitionTime": since or now}
    # In a strategic merge patch null deletes a key: a condition that turns True drops the
    # reason and message it had while False.
    condition["reason"] = reason if not ok and reason else None
    condition["message"] = message if not ok and message else None
    return condition


def build_status(
    pod: Obj,
    records: Sequence[ContainerRecord],
    *,
    sandbox_ready: bool,
    start_time: str,
    now: float,
    init_records: Sequence[ContainerRecord] = (),
) -> dict[str, Any]:
    """The ``status`` body to patch: phase, our conditions, containerStatuses, startTime.

    Conditions are patched by strategic merge (merge key ``type``), so PodScheduled and
    any readiness-gate conditions written by others are kept; containerStatuses has no
    merge key and is replaced whole, which is what we want.
    """
    stamp = rfc3339(now)
    previous = {c.get("type", ""): c for c in (pod.get("status") or {}).get("conditions") or []}
    phase = pod_phase(records, init_records)
    pending_init = [r.name for r in init_records if not (r.finished and r.exit_code() == 0)]
    unready = [r.name for r in records if not r.ready]
    containers_ready = not unready
    gates = [g.get("conditionType", "") for g in (pod.get("spec") or {}).get("readinessGates") or []]
    gates_ok = all((previous.get(g) or {}).get("status") == "True" for g in gates)
    terminal = phase in ("Succeeded", "Failed")
    not_ready_reason = "PodCompleted" if terminal else "ContainersNotReady"
    not_ready_message = "" if terminal else f"containers with unready status: [{' '.join(unready)}]"
    ready_reason, ready_message = not_ready_reason, not_ready_message
    if containers_ready and not gates_ok:
        ready_reason = "ReadinessGatesNotReady"
        ready_message = "corresponding condition of pod readiness gate"
    conditions = [
        _condition(previous, "PodReadyToStartContainers", sandbox_ready and not terminal, stamp),
        _condition(previous, "Initialized", not pending_init, stamp, "ContainersNotInitialized",
                   f"containers with incomplete status: [{' '.join(pending_init)}]"),
        _condition(previous, "ContainersReady", containers_ready and not terminal, stamp,
                   not_ready_reason, not_ready_message),
        _condition(previous, "Ready", containers_ready and gates_ok and not terminal, stamp,
                   ready_reason, ready_message),
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "containerStatuses": [r.to_status() for r in records],
        "startTime": start_time,
    }
    if init_records:
        status["initContainerStatuses"] = [r.to_status() for r in init_records]
    return status
