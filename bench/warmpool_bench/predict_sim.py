"""A discrete-event replay of a request trace against a pool of worker pods (pure; no wall clock).

The queueing model (what "TTFT" means in ``warmpool bench predict``):

- **Pods.** A pod asked for at time t serves from ``t + cold_start_s`` (warm: the worker's
  Ready is warm, so a pod serving is a warm pod).  Each warm pod serves up to
  :attr:`ServiceModel.slots` requests at once (the built-in engine's continuous batch).  A
  request's service time is ``prompt / prefill_tokens_per_s + generated / decode speed``,
  where its decode speed is a single request's ``decode_tokens_per_s`` times the batch's
  measured speed-up at the pod's batch size when it starts (itself included) divided by that
  size: fixed for the request once it starts (an approximation: the real engine's speed moves
  as requests join and leave).  Its time to first token is its wait plus its prefill.
- **Queue.** One FCFS queue for the pool (a load balancer that sends each request to the
  least-loaded pod with a free slot, and holds it when none has one): an arrival that finds
  a free slot on a warm pod starts at once (a *warm hit*); otherwise it waits for the first
  slot to free up or a pod to become warm (it *found no warm capacity*).
- **Scaling.** A controller (:mod:`.predict_policies`) sets the desired pod count.  More
  pods: new ones start their cold start now.  Fewer: pods still starting are cancelled
  first (newest first), then idle warm pods; a busy pod drains (finishes its request, then
  stops).  Pod-seconds count from the moment a pod is asked for to the moment it stops,
  cold start included, within the trace's span.
- **Sleep** (``PoolConfig.wake_s`` set): a pod scaled down after it was warm goes to sleep
  instead of stopping; it still holds its accelerator, so it is counted in pod-seconds held
  (:meth:`Simulation.pod_seconds`) until the end, and apart in :meth:`Simulation.asleep_seconds`.
  More pods wake sleepers first (serving after ``wake_s``), then start new ones (``cold_start_s``).
- **From zero** (``min_warm`` 0): a request that arrives while no pod is asked for is held, and
  the pool is raised to one pod at once (the activator asks the operator), whatever the policy.
- **Capacity the controllers see** is *measured*, as the operator measures it
  (:func:`~warmpool_operator.rules.forecast.steps.capacity_curve`): per batch size, requests
  completed per busy pod-second at that size (a second in which the pod serves at least one
  request, as the worker's busy-seconds counters count them), and the best point with enough
  work behind it, over the last ``capacity_window_s``; before any point has enough, completions
  per busy pod-second in all; unknown until the first request completes.  Controllers never
  read the service model.

Every time is simulated; nothing here reads a clock, so the same trace and settings give
the same figures on any machine.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from warmpool_operator.rules.forecast.steps import capacity_curve

from warmpool.contract.metrics import batch_bucket
from warmpool_bench.predict_trace import TraceRequest


@dataclass(frozen=True)
class ServiceModel:
    prefill_tokens_per_s: float
    #: a request served alone
    decode_tokens_per_s: float
    #: aggregate decode speed at batch sizes 1, 2, ... ÷ a single request's (so speedups[0] == 1); its
    #: length is the requests a pod serves at once.  (1.0,): one request at a time.
    speedups: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.decode_tokens_per_s > 0):
            raise ValueError(f"token rates must be positive, got {self}")
        if not self.speedups or self.speedups[0] != 1.0 or min(self.speedups) <= 0:
            raise ValueError(f"batch speed-ups must start at 1.0 and be positive, got {self.speedups}")

    @property
    def slots(self) -> int:
        return len(self.speedups)

    def prefill_s(self, request: TraceRequest) -> float:
        return request.prompt / self.prefill_tokens_per_s

    def service_s(self, request: TraceRequest, batch: int = 1) -> float:
        """Seconds ``request`` takes when it starts with ``batch`` requests on its pod (itself included)."""
        per_request = self.decode_tokens_per_s * self.speedups[batch - 1] / batch
        return self.prefill_s(request) + request.generated / per_request

    @property
    def full_batch_speedup(self) -> float:
        """A pod's decode work at a full batch, in requests served alone (a fixed pool's sizing)."""
        return self.speedups[-1]


@dataclass(frozen=True)
class PoolConfig:
    min_warm: int
    max_replicas: int
    cold_start_s: float
    capacity_window_s: float = 600.0
    #: None: pods scaled down stop; else they sleep, and waking one takes this long
    wake_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.min_warm <= self.max_replicas or self.cold_start_s < 0:
            raise ValueError(f"need 0 <= min_warm <= max_replicas and cold_start_s >= 0, got {self}")
        if self.wake_s is not None and self.wake_s < 0:
            raise ValueError(f"wake_s must be >= 0, got {self.wake_s}")


@dataclass
class Pod:
    index: int
    asked_at: float
    warm_at: float
    initial: bool  # warm when the replay began
    stopped_at: float | None = None
    draining: bool = False
    running: int = 0  # requests it serves now
    first_ttft_s: float | None = None
    served: int = 0
    changed_at: float = 0.0  # when ``running`` last changed
    step_bucket: int = 1  # the batch-size bucket of the last busy slice that took time
    asleep_since: float | None = None  # asleep now, since then (it still holds its accelerator)
    asleep_s: float = 0.0  # seconds asleep before ``asleep_since``

    @property
    def busy(self) -> bool:
        return self.running > 0

    def set_running(self, now: float, running: int) -> tuple[int, float] | None:
        """The busy slice that ends now, as (batch-size bucket, seconds); None when it was idle.

        Changes at one instant are one engine step: requests finishing together finish at the
        batch size the step ran with, as the worker counts them (not at the sizes left between)."""
        ended = None
        if self.running:
            if now > self.changed_at:
                self.step_bucket = batch_bucket(self.running)
            ended = (self.step_bucket, now - self.changed_at)
        self.running, self.changed_at = running, now
        return ended

    @property
    def alive(self) -> bool:
        return self.stopped_at is None and not self.draining


@dataclass(frozen=True)
class Served:
    arrival: float
    start: float
    ttft_s: float
    warm_hit: bool
    first_on_new_pod: bool


class Controller(Protocol):
    """A scaling policy; the simulation calls it and applies the count it returns (None: no change)."""

    @property
    def name(self) -> str: ...

    @property
    def tick_s(self) -> float | None:
        """Period of :meth:`on_tick`, or None for no ticks."""

    def on_tick(self, sim: Simulation) -> int | None: ...

    def on_arrival(self, sim: Simulation) -> int | None: ...


class _Event(IntEnum):  # same-time order: pods freed before arrivals see them, ticks last
    WARM = 0
    DONE = 1
    ARRIVAL = 2
    TICK = 3


@dataclass
class Simulation:
    requests: Sequence[TraceRequest]
    service: ServiceModel
    pool: PoolConfig
    controller: Controller
    now: float = 0.0
    pods: list[Pod] = field(default_factory=list)
    served: list[Served] = field(default_factory=list)
    queue: deque[tuple[int, TraceRequest]] = field(default_factory=deque)
    arrivals: list[float] = field(default_factory=list)  # arrival times so far (what metrics would count)
    pod_timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, warm, asked)
    _events: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, kind, seq, payload)
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    #: busy slices of every pod: (ended at, batch-size bucket, seconds, requests completed at its end)
    _busy: deque[tuple[float, int, float, int]] = field(default_factory=deque)
    _alive: dict[int, Pod] = field(default_factory=dict)  # neither stopped nor draining, by index
    _asleep: dict[int, Pod] = field(default_factory=dict)  # asleep (held, not serving), by index
    _last_capacity: float | None = None
    _running: int = 0  # requests being served (on draining pods too)

    # --- what controllers read ----------------------------------------------------------

    @property
    def desired(self) -> int:
        """Pods asked for and not being removed (starting or warm)."""
        return len(self._alive)

    @property
    def warm(self) -> int:
        return sum(p.warm_at <= self.now for p in self._alive.values())

    @property
    def starting(self) -> int:
        return sum(p.warm_at > self.now for p in self._alive.values())

    @property
    def asleep(self) -> int:
        return len(self._asleep)

    @property
    def in_flight(self) -> int:
        """Requests being served or held in the queue (the workers' and the activator's gauges)."""
        return self._running + len(self.queue)

    def measured_capacity_rps(self) -> float | None:
        """The capacity curve's best point over the recent window, else requests per busy
        pod-second in all; None before any completion.  A window with no work in it is no news:
        the last figure stands (as the operator's CapacityMeter keeps it over idle steps)."""
        while self._busy and self._busy[0][0] < self.now - self.pool.capacity_window_s:
            self._busy.popleft()
        curve = capacity_curve({bucket: (float(done), seconds)} for _, bucket, seconds, done in self._busy)
        busy = sum(seconds for _, _, seconds, _ in self._busy)
        done = sum(done for _, _, _, done in self._busy)
        if curve:
            self._last_capacity = max(curve.values())
        elif busy > 0 and done:
            self._last_capacity = done / busy
        return self._last_capacity

    def arrivals_between(self, start: float, end: float) -> int:
        return bisect.bisect_left(self.arrivals, end) - bisect.bisect_left(self.arrivals, start)

    # --- the run -------------------------------------------------------------------------

    def run(self, end_s: float) -> None:
        """Replay every request; pods are counted up to ``end_s``."""
        for _ in range(self.pool.min_warm):
            self._add(Pod(len(self.pods), 0.0, 0.0, initial=True))
        self._record_pods()
        for index, request in enumerate(self.requests):
            self._push(request.t, _Event.ARRIVAL, index)
        if self.controller.tick_s is not None:
            self._push(self.controller.tick_s, _Event.TICK, 0)
        while self._events:
            t, kind, _, payload = heapq.heappop(self._events)
            if kind == _Event.TICK and t > end_s and not self.queue and not self._running:
                break  # nothing left to serve; ticks would only go on forever
            self.now = t
            self._handle(_Event(kind), payload)
        self.now = max(self.now, end_s)
        for pod in self.pods:
            if pod.asleep_since is not None:
                pod.asleep_s += self.now - pod.asleep_since
                pod.asleep_since = None
            if pod.stopped_at is None:
                pod.stopped_at = self.now

    def pod_seconds(self, end_s: float) -> float:
        """Seconds pods held an accelerator within ``[0, end_s]``: starting, awake or asleep."""
        return sum(max(0.0, min(p.stopped_at if p.stopped_at is not None else end_s, end_s) - p.asked_at)
                   for p in self.pods)

    def asleep_seconds(self) -> float:
        """Seconds pods spent asleep (within :meth:`pod_seconds`); read after :meth:`run`."""
        return sum(p.asleep_s for p in self.pods)

    def _handle(self, kind: _Event, payload: int) -> None:
        if kind == _Event.ARRIVAL:
            request = self.requests[payload]
            self.arrivals.append(self.now)
            self._arrive(payload, request)
            self._apply(self.controller.on_arrival(self))
            if not self._alive:  # at zero: the activator holds the request and asks for a pod
                self._apply(1)
        elif kind == _Event.WARM:
            pod = self.pods[payload]
            if pod.alive:
                self._record_pods()
                self._serve_next(pod)
        elif kind == _Event.DONE:
            pod = self.pods[payload]
            self._busy_slice(pod.set_running(self.now, pod.running - 1), completed=1)
            self._running -= 1
            if pod.draining:
                if not pod.running:
                    self._release(pod)
                return
            self._serve_next(pod)
        else:
            self._apply(self.controller.on_tick(self))
            if self.controller.tick_s is not None:
                self._push(self.now + self.controller.tick_s, _Event.TICK, 0)

    def _arrive(self, index: int, request: TraceRequest) -> None:
        slots = self.service.slots
        free = [p for p in self._alive.values() if p.running < slots and p.warm_at <= self.now]
        if free and not self.queue:
            self._start(min(free, key=lambda p: (p.running, p.index)), request, self.now, warm_hit=True)
        else:
            self.queue.append((index, request))

    def _serve_next(self, pod: Pod) -> None:
        while self.queue and pod.running < self.service.slots:
            _, request = self.queue.popleft()
            self._start(pod, request, request.t, warm_hit=False)

    def _start(self, pod: Pod, request: TraceRequest, arrival: float, warm_hit: bool) -> None:
        ttft = self.now - arrival + self.service.prefill_s(request)
        first = pod.served == 0 and not pod.initial
        self._busy_slice(pod.set_running(self.now, pod.running + 1), completed=0)
        pod.served += 1
        self._running += 1
        if first:
            pod.first_ttft_s = ttft
        self.served.append(Served(arrival, self.now, ttft, warm_hit, first))
        self._push(self.now + self.service.service_s(request, pod.running), _Event.DONE, pod.index)

    def _busy_slice(self, ended: tuple[int, float] | None, completed: int) -> None:
        if ended is not None:
            self._busy.append((self.now, *ended, completed))

    def _apply(self, desired: int | None) -> None:
        if desired is None:
            return
        desired = max(self.pool.min_warm, min(self.pool.max_replicas, desired))
        alive = list(self._alive.values())
        if desired > len(alive):
            for _ in range(desired - len(alive)):
                pod = self._wake_one() or Pod(len(self.pods), self.now, self.now + self.pool.cold_start_s,
                                              initial=False)
                if pod.index == len(self.pods):
                    self.pods.append(pod)
                self._alive[pod.index] = pod
                self._push(pod.warm_at, _Event.WARM, pod.index)
        elif desired < len(alive):
            starting = sorted((p for p in alive if p.warm_at > self.now), key=lambda p: -p.asked_at)
            idle = [p for p in alive if p.warm_at <= self.now and not p.busy]
            busy = [p for p in alive if p.busy]
            for pod in (starting + idle + busy)[: len(alive) - desired]:
                if pod.busy:
                    pod.draining = True
                else:
                    self._release(pod)
                del self._alive[pod.index]
        self._record_pods()

    def _release(self, pod: Pod) -> None:
        """A pod scaled down: asleep where pods sleep and it has been warm, else stopped."""
        if self.pool.wake_s is not None and pod.warm_at <= self.now:
            pod.asleep_since, pod.draining = self.now, False
            self._asleep[pod.index] = pod
        else:
            pod.stopped_at = self.now

    def _wake_one(self) -> Pod | None:
        """The sleeper that slept least long, woken (it serves after ``wake_s``); None when none sleeps."""
        if not self._asleep or self.pool.wake_s is None:
            return None
        pod = self._asleep.pop(max(self._asleep, key=lambda i: self._asleep[i].asleep_since or 0.0))
        assert pod.asleep_since is not None
        pod.asleep_s += self.now - pod.asleep_since
        pod.asleep_since, pod.warm_at = None, self.now + self.pool.wake_s
        return pod

    def _record_pods(self) -> None:
        point = (self.now, self.warm, self.desired)
        if not self.pod_timeline or self.pod_timeline[-1][1:] != point[1:]:
            self.pod_timeline.append(point)

    def _add(self, pod: Pod) -> None:
        self.pods.append(pod)
        self._alive[pod.index] = pod

    def _push(self, t: float, kind: _Event, payload: int) -> None:
        heapq.heappush(self._events, (t, int(kind), next(self._seq), payload))
