"""What the live replay watches of one WarmModel's pool while it runs: its pods (for warm capacity and
pod-seconds) and its ``status.forecast`` (for the chart), polled through the API server on a thread.

* **Pods** are listed every :data:`POD_POLL_S`; a pod counts from the first list that shows it (within
  0.5 s of the ReplicaSet creating it, shortly after the scale decision) until it is terminating or
  gone.  A pod that is not warm yet has its worker's ``/readyz`` polled on its pod IP
  (the local node's pods only):
  warm from the first 200.  Its cold start is first seen -> first 200.
* **The WarmModel** is read every :data:`STATUS_POLL_S`: ``spec.pool.replicas`` (what the emulated HPA
  wrote), ``status.replicas`` and ``status.forecast``.

Every poll is bounded (API calls time out after 10 s, ``/readyz`` after 1 s) and the thread stops when
asked, within one poll.
"""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from warmpool.contract.api import API_GROUP, API_VERSION, PLURAL
from warmpool.contract.http import DEFAULT_WORKER_PORT, PATH_READYZ
from warmpool.contract.pods import LABEL_MODEL
from warmpool_bench.dialable import NotDialable, check_dialable

POD_POLL_S = 0.5
STATUS_POLL_S = 2.0
API_TIMEOUT_S = 10


@dataclass
class PodLife:
    name: str
    seen_at: float  # monotonic
    ip: str | None = None
    warm_at: float | None = None
    ended_at: float | None = None

    @property
    def cold_start_s(self) -> float | None:
        return None if self.warm_at is None else self.warm_at - self.seen_at


@dataclass
class StatusSample:
    t: float  # monotonic
    spec_replicas: int | None
    status_replicas: int | None
    forecast: dict[str, Any]


@dataclass
class PoolWatch:
    core: Any
    custom: Any
    namespace: str
    name: str
    pods: dict[str, PodLife] = field(default_factory=dict)
    statuses: list[StatusSample] = field(default_factory=list)
    #: (monotonic, pods alive, pods warm) after every pod poll
    counts: list[tuple[float, int, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=API_TIMEOUT_S * 3)

    def warm_pods(self) -> dict[str, str]:
        """name -> pod IP of each pod warm and not terminating, as of the last poll."""
        with self._lock:
            return {p.name: p.ip for p in self.pods.values()
                    if p.warm_at is not None and p.ended_at is None and p.ip is not None}

    def alive(self) -> list[PodLife]:
        with self._lock:
            return [p for p in self.pods.values() if p.ended_at is None]

    def _run(self) -> None:
        next_status = 0.0
        while not self._stop.is_set():
            try:
                self._poll_pods()
                if time.monotonic() >= next_status:
                    next_status = time.monotonic() + STATUS_POLL_S
                    self._poll_status()
            except Exception as error:  # an API hiccup: noted, and the next poll tries again
                self.errors.append(f"{type(error).__name__}: {str(error)[:200]}")
                del self.errors[:-20]
            self._stop.wait(POD_POLL_S)

    def _poll_pods(self) -> None:
        items = self.core.list_namespaced_pod(self.namespace, label_selector=f"{LABEL_MODEL}={self.name}",
                                              _request_timeout=API_TIMEOUT_S).items
        now = time.monotonic()
        live = {p.metadata.name: p for p in items if p.metadata.deletion_timestamp is None}
        with self._lock:
            for name, pod in live.items():
                life = self.pods.setdefault(name, PodLife(name, now))
                if pod.status.pod_ip and life.ip is None:
                    try:
                        life.ip = check_dialable(pod.status.pod_ip)
                    except NotDialable as error:  # never dialled: the pod stays out of the warm set
                        self.errors.append(str(error))
                        del self.errors[:-20]
            for life in self.pods.values():
                if life.ended_at is None and life.name not in live:
                    life.ended_at = now
            waiting = [p for p in self.pods.values() if p.ended_at is None and p.warm_at is None and p.ip]
        for life in waiting:  # outside the lock: the load generator reads warm_pods() meanwhile
            if _readyz(str(life.ip)):
                with self._lock:
                    life.warm_at = time.monotonic()
        with self._lock:
            alive = [p for p in self.pods.values() if p.ended_at is None]
            self.counts.append((now, len(alive), sum(p.warm_at is not None for p in alive)))

    def _poll_status(self) -> None:
        body = self.custom.get_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace, PLURAL, self.name,
                                                        _request_timeout=API_TIMEOUT_S)
        status = body.get("status") or {}
        self.statuses.append(StatusSample(time.monotonic(), body["spec"]["pool"].get("replicas"),
                                          status.get("replicas"), dict(status.get("forecast") or {})))

    def pod_seconds(self, start: float, end: float) -> float:
        """Pod-seconds within ``[start, end]`` (monotonic), each pod from first seen to gone."""
        with self._lock:
            return sum(max(0.0, min(end, p.ended_at if p.ended_at is not None else end) - max(start, p.seen_at))
                       for p in self.pods.values())


def _readyz(ip: str) -> bool:
    """The worker's /readyz on its pod IP (http.client: no proxy from the environment is ever used)."""
    conn = http.client.HTTPConnection(check_dialable(ip), DEFAULT_WORKER_PORT, timeout=1.0)
    try:
        conn.request("GET", PATH_READYZ)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
