"""The sleep and wake rules: which pods of a pool sleep, which wake, and which take the
Service's traffic (pure functions, no I/O, no clock: the caller passes ``now``).

How sleeping pods count: ``spec.pool.replicas`` (and minWarm) count every pod, awake or asleep.
A sleeping pod is warm and Ready: it only gives its accelerator memory back, and a wake is far
below a cold start.  So:

* **Idle sleep.** A pod that received no completion for ``afterIdleSeconds`` (its
  ``warmpool_requests_total`` did not move and nothing was in flight) is put to sleep, idlest
  first, while more than ``minAwake`` pods stay awake.  A pod without a request counter, or an
  engine reporting ``warmpool_sleep_capable 0``, never sleeps.  A pod the operator woke counts
  as active at its wake: it serves for ``afterIdleSeconds`` before it may sleep again.
* **Wake.** Wakes come first; a pass that wakes a pod puts none to sleep.  A pod is woken when
  (a) ``max(replicas, minWarm)`` grew by *k*: *k* sleeping pods wake at once (they serve within
  their wake time), while the Deployment starts *k* new pods, which become the sleeping reserve
  once they are idle in turn; (b) the awake pods hold more completions in flight than there are
  awake pods (requests are queueing); (c) fewer than ``minAwake`` pods are awake (minAwake
  raised, or an awake pod went away); (d) ``spec.pool.sleep`` was removed: every pod wakes.
  A pod that woke itself (a request reached it) is simply seen awake again.
* **Memory pressure.** On a node at the paused tier, the pod idle longest among every pool's
  sleepable pods on that node (any WarmModel with ``spec.pool.sleep``, engine able to sleep,
  nothing in flight and no request since the last scrape, its pool above ``minAwake``) is put
  to sleep, even before ``afterIdleSeconds``: one pod per node at a time, so the busy pods keep
  serving and the memory comes from those that wait.  ``minAwake`` holds under pressure too
  (set it to 0 to let pressure take a pool's last awake pod).
* **Routing.** ``warmpool.dev/awake`` is true on awake pods and false on sleeping ones, with
  one exception: a pool with no awake pod at all (``minAwake`` 0) keeps its sleeping pods in
  the Service, so a request reaches one and wakes it instead of finding no endpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from warmpool_operator.api.types import SleepSpec

WHY_IDLE = "idle"
WHY_PRESSURE = "memory pressure"
WHY_GREW = "pool grew"
WHY_DEMAND = "requests queueing"
WHY_MIN_AWAKE = "below minAwake"
WHY_FORECAST = "demand forecast"
WHY_DISABLED = "sleep turned off"


@dataclass(frozen=True)
class Policy:
    """spec.pool.sleep as the rules read it; ``enabled`` False when the block is absent."""

    enabled: bool
    after_idle_seconds: float | None = None
    min_awake: int = 1
    level: int = 1


def policy_of(sleep: SleepSpec | None) -> Policy:
    """spec.pool.sleep as the rules read it."""
    if sleep is None:
        return Policy(enabled=False)
    return Policy(enabled=True, after_idle_seconds=sleep.after_idle_seconds, min_awake=sleep.min_awake,
                  level=sleep.level)


@dataclass(frozen=True)
class SleepPod:
    """What the rules read of one pod of the pool (from its latest scrape)."""

    uid: str
    name: str
    node: str
    #: Ready and verified warm from its own metrics: only such pods sleep, wake or get relabelled
    serving: bool
    #: 0 awake, 1 or 2 asleep, None when the worker reports no sleep level
    level: int | None
    #: the engine says it can sleep (``warmpool_sleep_capable 1``)
    capable: bool
    #: seconds since its last completion arrived; None: no request counter (never idle)
    idle_seconds: float | None
    in_flight: float
    #: its warmpool.dev/awake label is "true" now
    labelled_awake: bool
    #: a request arrived since the previous scrape, or one is in flight
    busy: bool

    @property
    def awake(self) -> bool:
        return self.level == 0

    @property
    def asleep(self) -> bool:
        return self.level is not None and self.level > 0

    @property
    def sleepable(self) -> bool:
        return self.serving and self.awake and self.capable and not self.busy and self.in_flight <= 0


@dataclass(frozen=True)
class Action:
    uid: str
    why: str
    #: sleep only: take the pod out of the Service (and drain) first; False when it is the pool's
    #: last awake pod and must stay reachable (minAwake 0)
    drain: bool = True


@dataclass(frozen=True)
class Plan:
    sleep: tuple[Action, ...] = ()
    wake: tuple[Action, ...] = ()
    #: uid -> the awake label a pod outside ``sleep``/``wake`` should carry, where it differs
    relabel: Mapping[str, bool] = field(default_factory=dict)


def _wake_order(pod: SleepPod) -> tuple[int, str]:
    # Level 1 wakes from host memory, level 2 from the files: the faster first.
    return (pod.level or 0, pod.name)


def plan(
    pods: Sequence[SleepPod],
    policy: Policy,
    *,
    grew_by: int = 0,
    pressure_picks: Iterable[str] = (),
    awake_wanted: int = 0,
) -> Plan:
    """Who sleeps, who wakes and whose label moves (see the module docstring for the rules).

    ``grew_by``: how much ``max(replicas, minWarm)`` grew since the last pass; ``pressure_picks``:
    this pool's pods that :func:`pressure_picks` chose on paused nodes; ``awake_wanted``: the awake
    pods demand prediction asks for: sleeping pods wake to reach it (a wake is far below a
    cold start), and no pod sleeps for idleness below it."""
    live = [p for p in pods if p.serving and p.level is not None]
    awake = [p for p in live if p.awake]
    asleep = sorted((p for p in live if p.asleep), key=_wake_order)
    # Serving pods whose state is not known this pass (a failed scrape, a sleep or wake under
    # way): counted awake for minAwake, so one missed scrape never wakes another pod.
    unknown = [p for p in pods if p.serving and p.level is None]

    wake: list[Action] = []
    if not policy.enabled:
        wake = [Action(p.uid, WHY_DISABLED) for p in asleep]
    else:
        wanted: list[tuple[int, str]] = []
        if grew_by > 0:
            wanted.append((grew_by, WHY_GREW))
        if len(awake) + len(unknown) < policy.min_awake:
            wanted.append((policy.min_awake - len(awake) - len(unknown), WHY_MIN_AWAKE))
        if awake and sum(p.in_flight for p in awake) > len(awake):
            wanted.append((1, WHY_DEMAND))
        if len(awake) + len(unknown) < awake_wanted:
            wanted.append((awake_wanted - len(awake) - len(unknown), WHY_FORECAST))
        if wanted:
            count, why = max(wanted)
            wake = [Action(p.uid, why) for p in asleep[:count]]

    sleep: list[Action] = []
    if policy.enabled and not wake:
        budget = len(awake) - max(policy.min_awake, awake_wanted)
        picked = set(pressure_picks)
        after = policy.after_idle_seconds
        idle = [
            p for p in awake
            if p.sleepable and p.idle_seconds is not None and after is not None and p.idle_seconds >= after
        ]
        pressured = [p for p in awake if p.sleepable and p.uid in picked]
        chosen: list[tuple[SleepPod, str]] = [(p, WHY_PRESSURE) for p in pressured]
        chosen += [(p, WHY_IDLE) for p in sorted(idle, key=lambda p: -(p.idle_seconds or 0.0)) if p not in pressured]
        chosen = chosen[: max(0, budget)]
        left_awake = len(awake) + len(unknown) - len(chosen)
        sleep = [Action(p.uid, why, drain=left_awake > 0) for p, why in chosen]

    acting = {a.uid for a in (*sleep, *wake)}
    awake_after = len(awake) + len(unknown) - len(sleep)
    relabel: dict[str, bool] = {}
    for pod in live:
        if pod.uid in acting:
            continue
        # No awake pod at all: the sleeping ones stay reachable, a request wakes the one it finds.
        want = pod.awake or awake_after == 0
        if want != pod.labelled_awake:
            relabel[pod.uid] = want
    return Plan(sleep=tuple(sleep), wake=tuple(wake), relabel=relabel)


# --------------------------------------------------------------------------- memory pressure


@dataclass(frozen=True)
class Candidate:
    """A pod some pool could put to sleep under memory pressure, as that pool published it."""

    pool: tuple[str, str]
    uid: str
    node: str
    #: when its last completion arrived (the caller's monotonic clock): the oldest sleeps first
    last_active: float


def pressure_picks(candidates: Iterable[Candidate], paused_nodes: Iterable[str]) -> dict[str, Candidate]:
    """Per paused node, the candidate idle longest across every pool (ties: by pool, then uid)."""
    paused = set(paused_nodes)
    best: dict[str, Candidate] = {}
    for cand in candidates:
        if cand.node not in paused or not cand.node:
            continue
        held = best.get(cand.node)
        if held is None or (cand.last_active, cand.pool, cand.uid) < (held.last_active, held.pool, held.uid):
            best[cand.node] = cand
    return best


# --------------------------------------------------------------------------- activity


@dataclass
class Activity:
    """One pod's request counter as last seen, and when a request was last seen arriving."""

    total: float | None
    last_active: float


def observe_activity(previous: Activity | None, total: float | None, in_flight: float | None,
                     now: float) -> tuple[Activity, bool]:
    """(the pod's activity after this scrape, whether it was busy since the previous one).

    A pod first seen counts as active now: after an operator restart no pod sleeps before
    ``afterIdleSeconds`` have passed under the new operator's eyes (nothing is persisted, and
    sleeping a pod too late costs memory for a while, too early costs a client a wake)."""
    if previous is None:
        return Activity(total, now), bool(in_flight and in_flight > 0)
    moved = total is not None and (previous.total is None or total != previous.total)
    busy = moved or bool(in_flight and in_flight > 0)
    return Activity(total, now if busy else previous.last_active), busy


# --------------------------------------------------------------------------- wake figures


def merge_buckets(histograms: Iterable[Mapping[float, float]]) -> dict[float, float]:
    """Cumulative bucket counts summed over pods (the same bounds: one worker version)."""
    out: dict[float, float] = {}
    for buckets in histograms:
        for bound, count in buckets.items():
            out[bound] = out.get(bound, 0.0) + count
    return out


def quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """The q-quantile (0..1) of a cumulative histogram, interpolated inside its bucket as
    Prometheus' histogram_quantile does; None without observations.  A quantile in the +Inf
    bucket is the largest finite bound."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                finite = [b for b in bounds if not math.isinf(b)]
                return finite[-1] if finite else None
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return None
