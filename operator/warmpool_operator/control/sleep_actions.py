"""Sleep and wake of one WarmModel's pods: the I/O around the rules in rules/sleep_wake.py.

Each pass feeds the latest samples and this pass's forecast in (:func:`act`); the rules decide;
each sleep or wake runs as a task of its own so a pass never waits on a worker:

* sleep: ``warmpool.dev/awake=false`` first (the pod leaves the Service's endpoints), then the
  pod's in-flight completions drain (bounded by :data:`DRAIN_TIMEOUT`), then
  ``POST /control/sleep {"level": N}`` with the control token; an Event says why;
* wake: ``POST /control/wake`` (answers once the engine is awake and checked), then the label
  back to true; an Event says why.

Memory pressure spans WarmModels: every pool publishes its sleepable pods on a
:class:`PressureBoard` held by the registry (kopf's memo), and on a paused node the pod idle
longest, of whichever pool, is the one put to sleep.

What a restart forgets is derived again: a pod's sleep level comes from its metrics, its label
from the pod, and its idleness starts counting when the new operator first sees it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from warmpool.contract.api import Tier
from warmpool.contract.http import PATH_CONTROL_SLEEP, PATH_CONTROL_WAKE, PATH_METRICS
from warmpool.contract.pods import AWAKE_FALSE, AWAKE_TRUE, LABEL_AWAKE
from warmpool.kube import KubeError
from warmpool_operator.io.kube import PODS, Kube
from warmpool_operator.io.worker_client import WorkerClient, worker_url
from warmpool_operator.model import Obj, Sample, Target
from warmpool_operator.rules import gating
from warmpool_operator.rules import sleep_wake as sleeping
from warmpool_operator.settings import DEFAULT_SCRAPE_INTERVAL_SECONDS

log = logging.getLogger("warmpool.operator")

#: Longest wait for a pod's in-flight completions before it is put to sleep anyway (the worker
#: sleeps under its engine lock, so a generation still running finishes first regardless).
DRAIN_TIMEOUT = 30.0

REASON_SLEEPING = "PodSleeping"
REASON_ASLEEP = "PodAsleep"
REASON_WOKEN = "PodWoken"
REASON_WOKE_ON_REQUEST = "PodWokeOnRequest"
REASON_SLEEP_FAILED = "PodSleepFailed"
REASON_WAKE_FAILED = "PodWakeFailed"


# --------------------------------------------------------------------------- the cross-pool board


@dataclass
class PressureBoard:
    """Every pool's sleepable pods, for memory pressure across WarmModels (one per operator)."""

    entries: dict[tuple[str, str], tuple[float, list[sleeping.Candidate]]] = field(default_factory=dict)
    #: node -> when a pod on it was last put to sleep for pressure (monotonic)
    last_sleep: dict[str, float] = field(default_factory=dict)

    def publish(self, pool: tuple[str, str], candidates: list[sleeping.Candidate], now: float) -> None:
        self.entries[pool] = (now, candidates)

    def withdraw(self, pool: tuple[str, str]) -> None:
        self.entries.pop(pool, None)

    def fresh(self, now: float, ttl: float) -> list[sleeping.Candidate]:
        return [c for stamp, cands in self.entries.values() if now - stamp <= ttl for c in cands]

    def cooling(self, node: str, now: float, cooldown: float) -> bool:
        """A pod on this node was just put to sleep: its memory may not show as freed yet."""
        return now - self.last_sleep.get(node, -cooldown - 1) < cooldown

    def slept(self, pool: tuple[str, str], uid: str, node: str, now: float) -> None:
        self.last_sleep[node] = now
        stamp, cands = self.entries.get(pool, (now, []))
        self.entries[pool] = (stamp, [c for c in cands if c.uid != uid])


# --------------------------------------------------------------------------- per-pool state


@dataclass
class SleepState:
    """What the pool's sleep handling remembers (in memory only; see the module docstring)."""

    activity: dict[str, sleeping.Activity] = field(default_factory=dict)
    busy: dict[str, bool] = field(default_factory=dict)
    #: the sample each pod's activity was last updated from (a pass without a new scrape is no news)
    seen_sample: dict[str, Sample] = field(default_factory=dict)
    #: uid -> the sleep level last seen (a sleeping pod back at 0 without our wake woke itself)
    levels: dict[str, int] = field(default_factory=dict)
    pending: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    #: uid -> when our last sleep or wake of it finished (monotonic): a sample sent before then
    #: shows the pod as it was, and is not read for its sleep state
    acted_at: dict[str, float] = field(default_factory=dict)
    #: max(replicas, minWarm) at the last pass; None until the first (a restart is no growth)
    last_want: int | None = None
    #: wakes the pool's growth still asks for, and until when (monotonic): a pass whose samples
    #: are a scrape behind (a pod that fell asleep since, or one mid-sleep) must not use the
    #: growth up and leave it unserved
    owed_wakes: int = 0
    owed_until: float = 0.0

    def last_active(self) -> float | None:
        """When any pod of the pool last had a request arriving (monotonic; a pod counts from when
        it was first seen); None while no pod's activity is known."""
        return max((a.last_active for a in self.activity.values()), default=None)

    def forget(self, live: set[str]) -> None:
        for table in (self.activity, self.busy, self.seen_sample, self.levels, self.acted_at):
            for uid in set(table) - live:
                del table[uid]


@dataclass(frozen=True)
class Context:
    """What a sleep or wake task needs of the pass that started it."""

    kube: Kube
    workers: WorkerClient
    body: Mapping[str, Any]
    target: Target
    token: str
    #: drops the pod's sample and asks for a pass (its state changed: rescrape it now)
    refresh: Callable[[str], None]
    #: seconds between scrape rounds: what "recent" means for pressure and for a pool's growth
    scrape_interval: float = DEFAULT_SCRAPE_INTERVAL_SECONDS
    clock: Callable[[], float] = time.monotonic

    @property
    def cooldown(self) -> float:
        """How long after a pressure sleep a node's memory may still show as used."""
        return 3 * self.scrape_interval

    @property
    def pressure_min_idle(self) -> float:
        """Under pressure a pod must have had no request for two scrape rounds: one quiet round is
        not enough to call a pod that is serving idle."""
        return 2 * self.scrape_interval

    @property
    def owed_window(self) -> float:
        """How long a growth keeps asking for wakes: a few scrape rounds, so every pod's state has
        been read again since the growth (then the new pods the Deployment starts are the answer)."""
        return max(30.0, 3 * self.scrape_interval)


def _label_patch(awake: bool) -> Obj:
    return {"metadata": {"labels": {LABEL_AWAKE: AWAKE_TRUE if awake else AWAKE_FALSE}}}


async def set_label(kube: Kube, namespace: str, name: str, awake: bool) -> bool:
    """Best effort (logged); True when written or the pod is gone."""
    try:
        await kube.patch(PODS, namespace, name, _label_patch(awake))
    except KubeError as error:
        if error.status == 404:
            return True
        log.warning("pod %s/%s: %s not set (%s)", namespace, name, LABEL_AWAKE, error)
        return False
    except (aiohttp.ClientError, TimeoutError) as error:
        log.warning("pod %s/%s: %s not set (%s: %s)", namespace, name, LABEL_AWAKE,
                    type(error).__name__, error)
        return False
    return True


def _event(ctx: Context, pod: Mapping[str, Any], reason: str, message: str, warning: bool = False) -> None:
    pod_ref = {"apiVersion": "v1", "kind": "Pod", "metadata": pod.get("metadata") or {}}
    kopf.event([ctx.body, pod_ref], type="Warning" if warning else "Normal",  # type: ignore[list-item]
               reason=reason, message=message)
    log.info("%s/%s: %s", ctx.target.namespace, ctx.target.name, message)


async def _drain(ctx: Context, ip: str) -> float:
    """Wait (bounded) until the pod holds no completion; the in-flight count left."""
    metrics_url = worker_url(ip, ctx.target.spec.pod.port, PATH_METRICS)
    deadline = ctx.clock() + DRAIN_TIMEOUT
    left = 0.0
    while True:
        sample = await ctx.workers.metrics(metrics_url)
        left = (sample.requests_in_flight or 0.0) if sample.ok else 0.0
        if left <= 0 or ctx.clock() >= deadline:
            return left
        await asyncio.sleep(0.2)


async def sleep_pod(ctx: Context, pod: Mapping[str, Any], ref: gating.PodRef, action: sleeping.Action,
                    level: int, detail: str, state: SleepState) -> None:
    ns, name = ctx.target.namespace, ref.name
    try:
        if action.drain:
            if not await set_label(ctx.kube, ns, name, awake=False):
                return  # still in the Service: putting it to sleep now would cost clients a wake
            # The endpoints controller drops the pod; completions already sent finish first.
            left = await _drain(ctx, ref.ip)
            if left > 0:
                log.info("pod %s/%s: %g completion(s) still in flight after %gs: sleeping anyway",
                         ns, name, left, DRAIN_TIMEOUT)
        _event(ctx, pod, REASON_SLEEPING, f"pod {name} on {ref.node or '?'}: going to sleep at level {level} "
               f"({action.why}: {detail})")
        error = await ctx.workers.sleep(worker_url(ref.ip, ctx.target.spec.pod.port, PATH_CONTROL_SLEEP),
                                        ctx.token, level)
        if error is not None:
            await set_label(ctx.kube, ns, name, awake=True)
            _event(ctx, pod, REASON_SLEEP_FAILED, f"pod {name}: sleep refused or failed ({error}): kept awake",
                   warning=True)
            return
        _event(ctx, pod, REASON_ASLEEP, f"pod {name} on {ref.node or '?'}: asleep at level {level} ({action.why})")
    finally:
        state.acted_at[ref.uid] = ctx.clock()
        ctx.refresh(ref.uid)


async def wake_pod(ctx: Context, pod: Mapping[str, Any], ref: gating.PodRef, action: sleeping.Action,
                   state: SleepState) -> None:
    ns, name = ctx.target.namespace, ref.name
    try:
        started = ctx.clock()
        error = await ctx.workers.wake(worker_url(ref.ip, ctx.target.spec.pod.port, PATH_CONTROL_WAKE),
                                       ctx.token)
        if error is not None:
            _event(ctx, pod, REASON_WAKE_FAILED, f"pod {name}: wake failed ({error})", warning=True)
            return
        state.levels[ref.uid] = 0
        # Its idle clock starts again: a pod woken for a grown pool or for queueing requests serves
        # for afterIdleSeconds before it may sleep again, instead of going straight back to sleep.
        woken_at = ctx.clock()
        if ref.uid in state.activity:
            state.activity[ref.uid] = sleeping.Activity(state.activity[ref.uid].total, woken_at)
        # Awake and checked by the worker before it answered: now it may take traffic again.
        await set_label(ctx.kube, ns, name, awake=True)
        _event(ctx, pod, REASON_WOKEN, f"pod {name} on {ref.node or '?'}: awake in "
               f"{ctx.clock() - started:.2f}s ({action.why})")
    finally:
        state.acted_at[ref.uid] = ctx.clock()
        ctx.refresh(ref.uid)


def _spawn(state: SleepState, uid: str, job: Any) -> None:
    task: asyncio.Task[None] = asyncio.ensure_future(job)
    state.pending[uid] = task

    def done(finished: asyncio.Task[None]) -> None:
        if state.pending.get(uid) is finished:
            del state.pending[uid]
        if not finished.cancelled() and finished.exception() is not None:
            log.error("sleep/wake of pod %s failed: %r", uid, finished.exception())

    task.add_done_callback(done)


def cancel_all(state: SleepState) -> None:
    for task in state.pending.values():
        task.cancel()


# --------------------------------------------------------------------------- one pass


async def act(
    ctx: Context,
    state: SleepState,
    board: PressureBoard,
    refs: list[gating.PodRef],
    pods: Mapping[str, Obj],
    samples: Mapping[str, Sample],
    decisions: Mapping[str, gating.Decision],
    readiness: Mapping[str, bool],
    awake_wanted: int = 0,
) -> None:
    """Feed this pass's samples to the rules and start what they decide (never waits on a pod).
    ``awake_wanted``: the awake pods this pass's forecast asks for (sleep_wake.plan)."""
    policy = sleeping.policy_of(ctx.target.spec.pool.sleep)
    now = ctx.clock()
    _note_growth(ctx, state, now)
    state.forget({ref.uid for ref in refs} | set(state.pending))
    views = [_view(ctx, state, ref, pods[ref.uid], samples.get(ref.uid), readiness, now) for ref in refs]
    mine = _pressure_picks(ctx, state, board, policy, views, decisions, now)
    made = sleeping.plan(views, policy, grew_by=state.owed_wakes, pressure_picks=mine, awake_wanted=awake_wanted)
    state.owed_wakes = max(0, state.owed_wakes - len(made.wake))
    await _start(ctx, state, board, policy, made, {ref.uid: ref for ref in refs}, pods, now)


def _note_growth(ctx: Context, state: SleepState, now: float) -> None:
    """Wakes a growth of ``max(replicas, minWarm)`` asks for, owed for a few rounds."""
    spec = ctx.target.spec
    want = max(spec.pool.replicas, spec.pool.min_warm)
    grew = 0 if state.last_want is None else want - state.last_want
    state.last_want = want
    if grew < 0 or now > state.owed_until:
        state.owed_wakes = 0
    if grew > 0:
        state.owed_wakes += grew
        state.owed_until = now + ctx.owed_window


def _view(ctx: Context, state: SleepState, ref: gating.PodRef, pod: Mapping[str, Any], sample: Sample | None,
          readiness: Mapping[str, bool], now: float) -> sleeping.SleepPod:
    """What the rules read of one pod this pass (its activity and sleep level noted on the way)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    labelled_awake = labels.get(LABEL_AWAKE) == AWAKE_TRUE
    stale = sample is not None and sample.sent_at < state.acted_at.get(ref.uid, 0.0)
    if sample is None or not sample.ok or stale:
        # State unknown this pass (no sample, or a sample sent before our last sleep or wake
        # finished): the rules count it awake for minAwake and touch nothing of it.
        return _unknown(ref, readiness, labelled_awake)
    if state.seen_sample.get(ref.uid) is not sample:
        state.seen_sample[ref.uid] = sample
        activity, busy = sleeping.observe_activity(state.activity.get(ref.uid), sample.requests_total,
                                                   sample.requests_in_flight, now)
        state.activity[ref.uid] = activity
        state.busy[ref.uid] = busy
    level = sample.sleep_level
    if ref.uid in state.pending:
        # A sleep or wake is under way: its outcome is read at the next scrape.  Its sample, sent
        # before it finished, would record the old level (and the first one after would read as
        # a pod that woke itself), so the level is left as our action will leave it.
        return _unknown(ref, readiness, labelled_awake)
    previous = state.levels.get(ref.uid)
    if level is not None:
        if previous is not None and previous > 0 and level == 0:
            _event(ctx, pod, REASON_WOKE_ON_REQUEST, f"pod {ref.name}: woke itself for a request")
        state.levels[ref.uid] = level
    return sleeping.SleepPod(
        uid=ref.uid, name=ref.name, node=ref.node,
        serving=sample.ready and not (pod.get("metadata") or {}).get("deletionTimestamp"),
        level=level, capable=bool(sample.sleep_capable),
        idle_seconds=None if sample.requests_total is None else now - state.activity[ref.uid].last_active,
        in_flight=sample.requests_in_flight or 0.0, labelled_awake=labelled_awake,
        busy=state.busy.get(ref.uid, True),
    )


def _unknown(ref: gating.PodRef, readiness: Mapping[str, bool], labelled_awake: bool) -> sleeping.SleepPod:
    return sleeping.SleepPod(uid=ref.uid, name=ref.name, node=ref.node, serving=readiness.get(ref.uid, False),
                             level=None, capable=False, idle_seconds=None, in_flight=0.0,
                             labelled_awake=labelled_awake, busy=True)


def _pressure_picks(ctx: Context, state: SleepState, board: PressureBoard, policy: sleeping.Policy,
                    views: list[sleeping.SleepPod], decisions: Mapping[str, gating.Decision], now: float) -> set[str]:
    """Memory pressure: publish this pool's sleepable pods, then see whom the board picks, of
    every pool's, on the paused nodes; this pool's picks."""
    key = (ctx.target.namespace, ctx.target.name)
    awake = sum(v.serving and v.awake for v in views)
    candidates: list[sleeping.Candidate] = []
    if policy.enabled and awake > policy.min_awake:
        candidates = [
            sleeping.Candidate(key, v.uid, v.node, state.activity[v.uid].last_active)
            for v in views
            if v.sleepable and v.idle_seconds is not None and v.idle_seconds >= ctx.pressure_min_idle
        ]
    board.publish(key, candidates, now)
    paused = {d.pod.node for d in decisions.values() if d.node_tier is Tier.PAUSED and d.pod.node}
    paused = {node for node in paused if not board.cooling(node, now, ctx.cooldown)}
    picks = sleeping.pressure_picks(board.fresh(now, max(10.0, 3 * ctx.scrape_interval)), paused)
    return {c.uid for c in picks.values() if c.pool == key}


async def _start(ctx: Context, state: SleepState, board: PressureBoard, policy: sleeping.Policy,
                 made: sleeping.Plan, by_ref: Mapping[str, gating.PodRef], pods: Mapping[str, Obj],
                 now: float) -> None:
    """Start the plan's wakes and sleeps (tasks of their own) and write its relabels."""
    key = (ctx.target.namespace, ctx.target.name)
    for action in made.wake:
        _spawn(state, action.uid, wake_pod(ctx, pods[action.uid], by_ref[action.uid], action, state))
    for action in made.sleep:
        ref = by_ref[action.uid]
        idle = now - state.activity[action.uid].last_active
        if action.why == sleeping.WHY_PRESSURE:
            board.slept(key, action.uid, ref.node, now)
            detail = f"node {ref.node} at the paused tier, idle {idle:.0f}s, the longest on the node"
        else:
            detail = f"no request for {idle:.0f}s (afterIdleSeconds {policy.after_idle_seconds})"
        _spawn(state, action.uid, sleep_pod(ctx, pods[action.uid], ref, action, policy.level, detail, state))
    for uid, awake_label in made.relabel.items():
        await set_label(ctx.kube, ctx.target.namespace, by_ref[uid].name, awake_label)


async def label_unlabelled(kube: Kube, namespace: str, pods: list[Obj]) -> None:
    """Upgrade safety: pods made before the awake label existed get it (true) *before* the
    Service's selector asks for it, so no Ready pod drops out of the endpoints.  A failed
    write raises, so the pass stops before it touches the Service (and is retried)."""
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp") or LABEL_AWAKE in (meta.get("labels") or {}):
            continue
        try:
            await kube.patch(PODS, namespace, str(meta.get("name")), _label_patch(True))
        except KubeError as error:
            if error.status != 404:
                raise
        log.info("pod %s/%s: labelled %s=true (made before the label existed)", namespace, meta.get("name"),
                 LABEL_AWAKE)
