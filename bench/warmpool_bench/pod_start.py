"""A new pod's start on the real node, step by step, for `bench podstart` (and `bench wake`'s
``new_pod`` runs).

Three clocks of one machine, all Unix time, are joined into one chain of instants:

- the API server, as this process sees it: a watch on the pod records when it was first seen,
  bound to the node, and Ready (``PodWatch``; a watch, not polls, so the instants are the
  events' arrival, within milliseconds);
- the node's containerd: ``ctr events`` records when the pod's sandbox (the pause container,
  after the network namespace and CNI) and the worker's container started (``RuntimeEvents``);
  the sandbox is found by the pod UID label containerd puts on it, the worker's container by the
  ID in the pod's status;
- the worker itself: its cold-start phase timestamps (``warmpool_coldstart_phase_timestamp_seconds``).

The steps (`STEPS`) are the gaps between consecutive instants, so they add up to the whole
decision -> pod Ready.  The same worker started as a plain process has the steps from its
interpreter on (`process_steps`), measured from the instant before it was spawned.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from warmpool.contract.pods import WORKER_CONTAINER

#: (step, the instant it ends): each step runs from the previous step's instant to its own.
STEPS: tuple[tuple[str, str], ...] = (
    ("controllers", "pod_created"),  # operator pass, Deployment and ReplicaSet controllers
    ("scheduling", "pod_bound"),
    ("sandbox_cni", "sandbox_started"),  # kubelet sync, volumes, netns, CNI, the pause container
    ("container_start", "container_started"),  # create the worker's container, runc start
    ("imports", "imports_done"),  # interpreter, our imports, torch
    ("weights", "weights_loaded"),  # headers, mapping, the tier's layers
    ("warmup", "ready"),  # warm-up prefills, to the worker's own /readyz 200
    ("readiness", "pod_ready"),  # the kubelet's startup and readiness probes
)
#: What each step is, for the report.
STEP_TITLES: dict[str, str] = {
    "controllers": "decision → pod created (operator, Deployment and ReplicaSet controllers)",
    "scheduling": "pod created → bound to the node (scheduler)",
    "sandbox_cni": "bound → sandbox running (kubelet, volumes, network namespace, CNI, pause)",
    "container_start": "sandbox → worker container running (create, runc start)",
    "imports": "container running → imports done (interpreter, our imports, torch)",
    "weights": "imports → weights loaded (headers, mapping, the tier's layers)",
    "warmup": "weights → worker ready (warm-up prefills)",
    "readiness": "worker ready → pod Ready (kubelet probes)",
}
#: Steps the container runtime and the kubelet around it own (not the worker, not the controllers).
RUNTIME_STEPS = ("sandbox_cni", "container_start")

#: `ctr events` prints Go's time.Time then namespace, topic and the event as JSON.
_CTR_LINE = re.compile(
    r"^(?P<date>\d{4}-\d\d-\d\d) (?P<time>\d\d:\d\d:\d\d)(?:\.(?P<frac>\d+))? (?P<offset>[+-]\d{4}) \S+ "
    r"(?P<namespace>\S+) (?P<topic>/\S+) (?P<payload>\{.*\})\s*$")
SANDBOX_KIND_LABEL = "io.cri-containerd.kind"
POD_UID_LABEL = "io.kubernetes.pod.uid"


@dataclass(frozen=True)
class RuntimeEvent:
    at: float  # Unix time
    namespace: str
    topic: str
    payload: dict[str, Any]


def parse_ctr_event(line: str) -> RuntimeEvent | None:
    """One line of ``ctr events``; None for anything else (a partial line, a warning)."""
    match = _CTR_LINE.match(line.strip())
    if match is None:
        return None
    frac = (match["frac"] or "0")[:6].ljust(6, "0")  # Go trims trailing zeros; microseconds suffice
    try:
        stamp = dt.datetime.strptime(f"{match['date']} {match['time']}.{frac} {match['offset']}",
                                     "%Y-%m-%d %H:%M:%S.%f %z")
        payload = json.loads(match["payload"])
    except ValueError:
        return None
    if not isinstance(payload, dict):
        return None
    return RuntimeEvent(stamp.timestamp(), match["namespace"], match["topic"], payload)


def sandbox_id(events: list[RuntimeEvent], pod_uid: str) -> str | None:
    """The ID of the pod's sandbox: containerd labels it with the pod's UID on its first update."""
    for event in events:
        labels = event.payload.get("labels") or {}
        if (event.topic == "/containers/update" and labels.get(POD_UID_LABEL) == pod_uid
                and labels.get(SANDBOX_KIND_LABEL) == "sandbox"):
            return str(event.payload.get("id"))
    return None


def task_started(events: list[RuntimeEvent], container_id: str) -> float | None:
    """When a container's task started (its process was let run), or None."""
    for event in events:
        if event.topic == "/tasks/start" and event.payload.get("container_id") == container_id:
            return event.at
    return None


class RuntimeEvents:
    """``ctr events`` against the node's containerd while a run lasts; `stop` returns them."""

    def __init__(self, ctr: Path, socket: Path) -> None:
        self.command = [str(ctr), "--address", str(socket), "events"]
        self.events: list[RuntimeEvent] = []
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        stdout = self._proc.stdout
        assert stdout is not None
        self._reader = threading.Thread(target=self._read, args=(stdout,), daemon=True)
        self._reader.start()
        time.sleep(0.2)  # subscribed before the run's first event (ctr prints nothing to wait on)

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            event = parse_ctr_event(line)
            if event is not None:
                self.events.append(event)

    def stop(self) -> list[RuntimeEvent]:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=10)
        return list(self.events)


@dataclass
class PodSeen:
    """When this process first saw each of one pod's transitions (Unix time)."""

    uid: str = ""
    name: str = ""
    created: float | None = None
    bound: float | None = None
    ready: float | None = None
    container_id: str | None = None  # the worker container's, bare (no ``containerd://``)
    ip: str | None = None


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


@dataclass
class PodWatch:
    """A watch on the namespace's pods with a label selector, in a thread, from `start` to `stop`."""

    core: Any
    namespace: str
    selector: str
    timeout_s: float
    seen: dict[str, PodSeen] = field(default_factory=dict)

    def start(self) -> None:
        from kubernetes import watch

        # The client's package is untyped: its watch is handled as Any.
        self._watch: Any = watch.Watch()  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # stopped, or the run ended: what was seen is kept
            for event in self._watch.stream(self.core.list_namespaced_pod, self.namespace,
                                            label_selector=self.selector, timeout_seconds=int(self.timeout_s)):
                self.observe(event["object"], time.time())

    def observe(self, pod: Any, now: float) -> None:
        seen = self.seen.setdefault(pod.metadata.uid, PodSeen(uid=pod.metadata.uid, name=pod.metadata.name))
        seen.created = seen.created or now
        if pod.spec.node_name and seen.bound is None:
            seen.bound = now
        if pod.status.pod_ip:
            seen.ip = pod.status.pod_ip
        for status in pod.status.container_statuses or []:
            if status.name == WORKER_CONTAINER and status.container_id:
                seen.container_id = status.container_id.rsplit("/", 1)[-1]
        if seen.ready is None and _ready(pod):
            seen.ready = now

    def first(self) -> PodSeen | None:
        """The first pod seen (a run starts one)."""
        return min(self.seen.values(), key=lambda s: s.created or 0.0, default=None)

    def stop(self) -> None:
        self._watch.stop()


def pod_instants(decision: float, seen: PodSeen, events: list[RuntimeEvent] | None,
                 phases: Mapping[str, float]) -> dict[str, float | None]:
    """The chain of instants of one pod start (Unix times; None where a source had nothing)."""
    sandbox = sandbox_id(events, seen.uid) if events is not None else None
    return {
        "decision": decision,
        "pod_created": seen.created,
        "pod_bound": seen.bound,
        "sandbox_started": task_started(events, sandbox) if events is not None and sandbox else None,
        "container_started": (task_started(events, seen.container_id)
                              if events is not None and seen.container_id else None),
        "imports_done": phases.get("imports_done"),
        "weights_loaded": phases.get("weights_loaded"),
        "ready": phases.get("ready"),
        "pod_ready": seen.ready,
    }


def steps(instants: Mapping[str, float | None], first: str = "decision") -> dict[str, float | None]:
    """Seconds of each step whose end is one of ``instants``, from ``first`` on: an instant minus the
    one before; None where either is missing (unknown, never 0)."""
    out: dict[str, float | None] = {}
    previous = instants.get(first)
    for step, end in STEPS:
        if end not in instants:
            continue
        here = instants[end]
        out[step] = None if here is None or previous is None else here - previous
        previous = here
    return out


def process_steps(spawned: float, phases: Mapping[str, float]) -> dict[str, float | None]:
    """The plain process's steps: spawn -> imports, weights, warm-up (it has no pod steps)."""
    return steps({"spawned": spawned, "imports_done": phases.get("imports_done"),
                  "weights_loaded": phases.get("weights_loaded"), "ready": phases.get("ready")},
                 first="spawned")
