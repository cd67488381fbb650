"""One reconciler per WarmModel: a debounced, level-based pass, run when something changed.

What wakes it: the WarmModel's spec or status changing, an event of one of its children or
worker pods (from the watches), a round of samples from the scrape scheduler, or a kopf
handler that waits for the pass (create, resume, spec update).  Pokes that arrive while a pass
is pending or running cost one more pass, not one each.

A pass reads the watch-fed cache and nothing else from the API server, and runs top to bottom,
each step a function of what came before:

0. the spec parsed (a bad one: ``Degraded=True``, retried only slowly or on a change), its host
   paths checked, the Secret, ConfigMap, Service and PDB made to match the builders (children.py);
1. **observe** the pods of our Deployment and their samples, scraping what is stale (observe.py);
2. **tiers** decided on new samples, sent, announced and annotated (tiers.py);
3. **forecast**: this pass's samples into the demand history, the pods it asks for (forecasting.py);
4. **sleep/wake** by the rules, with this pass's forecast and the requests the activator holds
   (sleep_actions.py);
5. **zero** (spec.pool.scaleToZero): at zero or not, and the Service's EndpointSlices: the awake
   warm pods, else the activator (zero.py);
6. **scale**: the Deployment's replicas, written at most once per pass (scale.py, children.py);
7. **status**, after what the pool learned (learning.py), written only when it changed.

What a restart would forget is read back from the live objects: the extra pods from the
Deployment's replicas, each pod's last tier from its annotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf

from warmpool.contract.telemetry import ATTR_WARMMODEL, ATTR_WARMMODEL_UID, SPAN_APPLY, SPAN_RECONCILE, SPAN_STATUS
from warmpool.kube import KubeError
from warmpool_operator.api.types import InvalidWarmModel, WarmModelSpec, parse_spec
from warmpool_operator.control import children, learning, observe, scale, sleep_actions, tiers
from warmpool_operator.control import zero as zero_step
from warmpool_operator.control.forecasting import PoolForecast, Predicted
from warmpool_operator.control.pass_queue import Asks, PassQueue
from warmpool_operator.control.shared import Shared
from warmpool_operator.control.status_patch import write_status
from warmpool_operator.io import metrics
from warmpool_operator.io.watch_cache import Cache
from warmpool_operator.model import CacheRevision, Obj, Target
from warmpool_operator.rules import builders, heat, host_paths
from warmpool_operator.rules import status as st
from warmpool_operator.rules.node_answers import answer_window
from warmpool_operator.rules.node_health import NodeHealth
from warmpool_operator.rules.object_store_pods import reported_paths, resolved_revision
from warmpool_operator.rules.observation import ColdStarts, PodObservation, pod_fingerprint
from warmpool_operator.rules.zero import Endpoint, ZeroState

log = logging.getLogger("warmpool.operator")

#: How long a poke waits for others before the pass starts: a burst of events is one pass.
DEBOUNCE_SECONDS = 0.05
#: A pool with no pod to scrape (none Running with an IP yet, or none at all) has nothing new from a
#: scrape round: every change to it reaches a pass through the watches.  Its rounds ask for a pass
#: only this often, for the rules that act on elapsed time alone (scale-down holds, idle sleep); at
#: 1,000 such pools a pass every round was most of the operator's idle CPU.
QUIET_ROUNDS_PER_PASS = 6


class Permanent(Exception):
    """Retrying will not help until the WarmModel changes."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.degradation = st.Degradation(reason, message)


class Temporary(Exception):
    """The pass failed for a reason that may pass (an API hiccup): retried after a delay."""


@dataclass
class FailureMemory:
    """The generation that failed permanently, why, and when (monotonic): unprompted passes leave
    it alone until it changes or the permanent retry interval has passed."""

    generation: int | None = None
    reason: str = ""
    at: float = 0.0

    def waiting_out(self, generation: int, now: float, retry_interval: float) -> bool:
        """Whether a permanently failed generation still waits before its next unprompted try.

        A refused child waits ``retry_interval`` (minutes by default), so that an outside fix (an
        admission policy relaxed, a quota raised) heals it without a spec edit and without
        hammering the API server.  A name conflict is looked at every pass: the freed name is
        taken at once."""
        if self.generation != generation or self.reason == st.REASON_CHILD_CONFLICT:
            return False
        return now - self.at < retry_interval


@dataclass
class PoolMemory:
    """What the operator remembers about one WarmModel between passes (in memory only), by concern."""

    #: the parsed spec of the generation last seen (parsing is not free at a thousand pools)
    parsed: tuple[int, WarmModelSpec] | None = None
    failure: FailureMemory = field(default_factory=FailureMemory)
    children: children.ChildrenMemory = field(default_factory=children.ChildrenMemory)
    scrapes: observe.ScrapeMemory = field(default_factory=observe.ScrapeMemory)
    tiers: tiers.TierMemory = field(default_factory=tiers.TierMemory)
    cold: ColdStarts = field(default_factory=ColdStarts)
    sleep: sleep_actions.SleepState = field(default_factory=sleep_actions.SleepState)
    scale: scale.ScaleMemory = field(default_factory=scale.ScaleMemory)
    heat: heat.HeatState = field(default_factory=heat.HeatState)
    zero: zero_step.ZeroMemory = field(default_factory=zero_step.ZeroMemory)


@dataclass
class Outcome:
    """What the pass's steps leave for its status."""

    observations: list[PodObservation] = field(default_factory=list)
    predicted: Predicted = field(default_factory=Predicted)
    deployment: Obj | None = None
    conflicts: list[children.ChildConflict] = field(default_factory=list)
    #: scale to zero: the pods the Service may route to, and this pass's decision (None: not such a pool)
    endpoints: list[Endpoint] = field(default_factory=list)
    zero: ZeroState | None = None


class Reconciler:
    """The pass loop of one WarmModel (a task of its own, stopped when the WarmModel goes)."""

    def __init__(self, body: Mapping[str, Any], shared: Shared, cache: Cache, queue: PassQueue | None = None) -> None:
        self.body: Obj = dict(body)
        self.shared = shared
        self.cache = cache
        #: asks for the next pass, in the operator's one pass queue (control/pass_queue.py)
        self._asks = Asks(queue)
        self.memory = PoolMemory()
        self.forecast = PoolForecast(shared.kube, self.body, shared.config.predict_step_seconds, shared.forecasting,
                                     self.poke, shared.wall)
        #: uid -> what the watch last showed of a worker pod that a pass reads (saw_pod compares)
        self._fingerprints: dict[str, tuple[object, ...]] = {}
        self._wake = self._asks.wake
        # Scrape rounds since the last pass a quiet round asked for.  Started at an offset of the
        # pool's own, so that pools made together do not all pass in the same round.
        self._quiet_rounds = zlib.crc32(str(self.body["metadata"].get("uid", "")).encode()) % QUIET_ROUNDS_PER_PASS
        self._waiters: list[asyncio.Future[None]] = []
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ waking

    def start(self, *, listed: bool = False) -> None:
        """Start the pass loop; ``listed``: seen in a watch's initial list, a backlog news overtakes."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"reconcile {self.key}")
            self._asks.ask(routine=listed)

    async def stop(self, *, save: bool = False) -> None:
        """Stop the pass loop; ``save``: the operator shuts down, so the request history is written
        once more (not when the WarmModel is gone: its history goes with it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.forecast.stop(save=save)
        sleep_actions.cancel_all(self.memory.sleep)
        self.shared.board.withdraw(self.key)
        # After the pass loop ended (no pass can set them again): a gone WarmModel, or an operator that
        # stops or lost the lead, reports no forecast.
        metrics.forget_forecast(*self.key)
        metrics.forget_degraded(*self.key)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.cancel()

    @property
    def key(self) -> tuple[str, str]:
        meta = self.body["metadata"]
        return str(meta["namespace"]), str(meta["name"])

    @property
    def uid(self) -> str:
        return str(self.body["metadata"]["uid"])

    def poke(self) -> None:
        """Ask for a pass soon (debounced): news, which goes before routine passes."""
        self._asks.ask(routine=False)

    def poke_routine(self) -> None:
        """Ask for a pass that news may overtake (the initial list, a scrape round)."""
        self._asks.ask(routine=True)

    def saw_pod(self, event_type: str | None, pod: Mapping[str, Any]) -> bool:
        """Note a watch event of one of the pool's pods (or ReplicaSets); True when it changed
        what a pass reads (an annotation of ours changes nothing)."""
        uid = str((pod.get("metadata") or {}).get("uid"))
        fingerprint = pod_fingerprint(pod, deleted=event_type == "DELETED")
        if self._fingerprints.get(uid) == fingerprint:
            return False
        self._fingerprints[uid] = fingerprint
        if event_type == "DELETED":
            self._fingerprints.pop(uid, None)
        return True

    def is_echo(self, child: Mapping[str, Any]) -> bool:
        """Whether a child's watch event only echoes the version our last write settled on."""
        return self.memory.children.is_echo(child)

    async def pass_now(self) -> None:
        """Ask for a pass and wait for it: returns, or raises :class:`Permanent` / :class:`Temporary`."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        # The class it was asked for with stays (a listed WarmModel's resume); asked for by nothing else, news.
        self._asks.ask(routine=self._asks.routine_pending)
        await waiter

    async def scrape_round(self) -> None:
        """The scheduler's round for this pool: scrape its pods, then a pass decides on the samples
        (with no pod to scrape, a pass every QUIET_ROUNDS_PER_PASS rounds)."""
        urls = dict(self.memory.scrapes.urls)
        if urls:
            self.memory.scrapes.feed(await self.shared.scheduler.scrape(urls))
            self._quiet_rounds = 0
            self.poke_routine()
            return
        self._quiet_rounds += 1
        if self._quiet_rounds >= QUIET_ROUNDS_PER_PASS:
            self._quiet_rounds = 0
            self.poke_routine()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(DEBOUNCE_SECONDS)
            async with self._asks.turn():  # the pass queue's order (control/pass_queue.py)
                waiters, self._waiters = self._waiters, []
                try:
                    await self.sync(prompted=bool(waiters))
                except Exception as error:
                    if not isinstance(error, Permanent | Temporary):
                        log.exception("%s/%s: pass failed", *self.key)
                        error = Temporary(f"{type(error).__name__}: {error}")
                    if isinstance(error, Temporary):
                        asyncio.get_running_loop().call_later(self.shared.config.retry_delay, self.poke)
                        if not waiters:
                            log.info("%s/%s: pass: %s", *self.key, error)
                    for waiter in waiters:
                        if not waiter.done():
                            waiter.set_exception(error)
                else:
                    for waiter in waiters:
                        if not waiter.done():
                            waiter.set_result(None)

    # ------------------------------------------------------------------ the pass

    async def sync(self, prompted: bool) -> None:
        """One level-based pass (see the module docstring).  ``prompted``: a handler waits for it,
        so a permanently failed generation is tried even while it waits out its retry delay."""
        meta = self.body["metadata"]
        generation = int(meta.get("generation") or 0)
        failure = self.memory.failure
        kind = "handler" if prompted else "event"
        if meta.get("deletionTimestamp"):
            return  # going: the garbage collector takes the children
        now = self.shared.monotonic()
        if not prompted and failure.waiting_out(generation, now, self.shared.config.permanent_retry_interval):
            return  # failed for good at this generation: wait for a change or the slow retry
        attributes = {ATTR_WARMMODEL_UID: self.uid, ATTR_WARMMODEL: "/".join(self.key)}
        hold = zero_step.hold_trace(self.body, self.shared.wall())  # a pass for held requests joins their trace
        try:
            with self.shared.tracing.span(SPAN_RECONCILE, attributes, hold):
                await self._pass(generation)
            failure.generation = None
            metrics.show_degraded(*self.key, None)
        except Permanent as error:
            metrics.RECONCILE_ERRORS.labels(kind, "permanent").inc()
            metrics.show_degraded(*self.key, error.degradation.reason)
            metrics.show_failed_pass(*self.key, self._min_warm_parsed(generation))
            first = failure.generation != generation or failure.reason != error.degradation.reason
            failure.generation, failure.reason, failure.at = generation, error.degradation.reason, now
            await write_status(self.shared.kube, self.body, _status(self, None, generation, Outcome(),
                                                                    error.degradation))
            if first:
                kopf.event(self.body, type="Warning", reason=error.degradation.reason,  # type: ignore[arg-type]
                           message=str(error))
            raise
        except (KubeError, aiohttp.ClientError, TimeoutError, OSError) as error:
            metrics.RECONCILE_ERRORS.labels(kind, "temporary").inc()
            metrics.show_failed_pass(*self.key, self._min_warm_parsed(generation))
            raise Temporary(f"{type(error).__name__}: {error}") from error
        except Temporary:  # e.g. waiting for a node agent to read the source's manifest
            metrics.RECONCILE_ERRORS.labels(kind, "temporary").inc()
            metrics.show_failed_pass(*self.key, self._min_warm_parsed(generation))
            raise
        except Exception:  # a bug: the loop logs it and retries as Temporary
            metrics.RECONCILE_ERRORS.labels(kind, "unexpected").inc()
            metrics.show_failed_pass(*self.key, self._min_warm_parsed(generation))
            raise
        finally:
            metrics.RECONCILE_SECONDS.labels(kind).observe(self.shared.monotonic() - now)

    async def _pass(self, generation: int) -> None:
        spec = self._spec(generation)
        target = self._target(spec)
        try:
            outcome = await self._children_and_pods(target)
        except KubeError as error:
            if error.status in (400, 422):
                # The API server refuses a child built from this spec (e.g. requests above limits,
                # or an admission policy): retried slowly and on any change (an outside fix heals it).
                raise Permanent(st.REASON_CHILD_REJECTED, f"the API server refused a child: {error.message}") from None
            raise
        if outcome.conflicts or outcome.deployment is None:
            names = "; ".join(str(conflict) for conflict in outcome.conflicts)
            raise Permanent(st.REASON_CHILD_CONFLICT, f"{names}: left untouched (delete or rename it to let this "
                            "WarmModel create its own)")
        self._show(spec, outcome)
        config = self.shared.config
        await learning.write_heat(self.shared.kube, target, self.memory.heat, outcome.observations,
                                  config.heat_write_interval, self.shared.wall())
        await learning.write_learned_buckets(self.shared.kube, self.cache, target, outcome.predicted.learned)
        with self.shared.tracing.span(SPAN_STATUS):
            await write_status(self.shared.kube, self.body, _status(self, spec, generation, outcome), announce=True)

    async def _children_and_pods(self, target: Target) -> Outcome:
        """The children, then the pass's steps over the pods: observe, tiers, forecast, sleep/wake, scale."""
        kube, memory, shared, settled = self.shared.kube, self.memory, self.shared, self.memory.children.settled
        live = children.live_deployment(self.cache, target, self.uid)
        if live is not None:
            # Before the Service (whose selector asks for the awake label) is brought up to date.
            await sleep_actions.label_unlabelled(kube, target.namespace, observe.our_pods(
                self.cache, target, memory.scrapes, str(live["metadata"]["uid"])))
        with shared.tracing.span(SPAN_APPLY):
            made = await children.ensure_supporting(kube, self.cache, target, self.body, settled,
                                                    shared.control_key, memory.children.token,
                                                    shared.config.worker_policy_ingress)
        memory.children.token = made.token
        outcome = Outcome(conflicts=list(made.conflicts))
        if made.mounted_conflict:
            return outcome  # no Deployment: its pods would mount someone else's Secret or ConfigMap
        live = children.live_deployment(self.cache, target, self.uid)
        scale.restore(memory.scale, target.spec, live, shared.monotonic())
        if live is not None and not outcome.conflicts:
            await self._pods(target, str(live["metadata"]["uid"]), outcome)
        if target.spec.pool.scale_to_zero is not None:
            outcome.zero = zero_step.decide_and_announce(memory.zero, target, self.body, live, outcome.observations,
                                                         memory.sleep.last_active(), shared.monotonic(), shared.wall())
        at_zero = outcome.zero is not None and outcome.zero.at_zero
        stopping = at_zero and not memory.zero.settling(shared.monotonic())  # out of the Service first, then stopped
        replicas = scale.replicas(memory.scale, target.spec, outcome.predicted, self.body, shared.monotonic(), stopping)
        desired = builders.build_deployment(target, replicas, zero_step.cold_start_trace(
            memory.zero, target, self.body, live, replicas, shared.wall()))
        with shared.tracing.span(SPAN_APPLY):
            routed = None if outcome.zero is None else [] if at_zero else outcome.endpoints
            outcome.conflicts += await zero_step.follow(kube, self.cache, target, self.body, settled, routed,
                                                        shared.activators)
            try:
                outcome.deployment = await children.ensure(kube, self.cache, desired, self.body, settled)
            except children.ChildConflict as conflict:
                outcome.conflicts.append(conflict)
        return outcome

    async def _pods(self, target: Target, deployment_uid: str, outcome: Outcome) -> None:
        shared, memory, config = self.shared, self.memory, self.shared.config
        spec = target.spec
        pods = observe.our_pods(self.cache, target, memory.scrapes, deployment_uid)
        refs, by_uid = observe.scrapeable(target, pods, config)  # held requests wait on pods routed: before the rest
        await zero_step.route_ready_first(shared.kube, self.cache, target, self.body, memory.children.settled,
                                          memory.zero, refs, by_uid, shared.activators)
        nodes = node_health(shared, memory.scrapes)  # pods on lost nodes are not warm, on cordoned ones leaving
        pool = await observe.observe(memory.scrapes, pods, target, shared.scheduler, config, shared.tracing, nodes)
        decisions = await tiers.decide_and_direct(memory.tiers, pool, target, self.body, memory.children.token,
                                                  shared.workers, config.ttl(), shared.tracing)
        if memory.tiers.token_refused:
            # The Secret changed under us (edited, or made with another key): the next pass writes
            # our token into it again, and workers read theirs per call.
            log.warning("%s/%s: a worker refused the control token: writing it into the Secret again",
                        target.namespace, target.name)
            memory.children.token = ""
            memory.tiers.token_refused = False
        outcome.observations = observe.observations(pool, decisions, nodes)
        for obs in outcome.observations:
            memory.cold.record(obs.uid, obs.sample)
        await tiers.annotate(shared.kube, target, pool, outcome.observations)
        outcome.predicted = self.forecast.step(spec, self.body, outcome.observations,
                                               memory.cold.figures().p95_seconds, memory.zero.at_zero is True)
        outcome.endpoints = zero_step.pod_endpoints(target, pool.refs, pool.pods, pool.readiness)
        # Requests the activator holds want an awake pod: a sleeping one wakes before any is started.
        awake_wanted = max(outcome.predicted.awake_wanted, zero_step.wake_wanted(target, self.body, shared.wall()))
        await sleep_actions.act(_sleep_context(self, target), memory.sleep, shared.board, pool.refs, pool.pods,
                                pool.samples, decisions, pool.readiness, awake_wanted=awake_wanted)
        scale.react(memory.scale, spec, outcome.observations, self.key)

    def _spec(self, generation: int) -> WarmModelSpec:
        parsed = self.memory.parsed
        if parsed is not None and parsed[0] == generation:
            return parsed[1]
        try:
            spec = parse_spec(self.body.get("spec") or {})
        except InvalidWarmModel as error:
            raise Permanent(st.REASON_INVALID_SPEC, str(error)) from None
        self.memory.parsed = (generation, spec)
        return spec

    def _target(self, spec: WarmModelSpec) -> Target:
        """The WarmModel as the builders take it; a node directory outside the allowed prefixes is
        refused before any child is made (it is never mounted)."""
        config = self.shared.config
        refused = host_paths.refusal(spec, config.allowed_host_paths, config.block_cache_root,
                                     reported_paths(spec, self.body.get("status")))
        if refused is not None:
            raise Permanent(st.REASON_HOST_PATH_NOT_ALLOWED, refused)
        namespace, name = self.key
        return Target(name=name, namespace=namespace, spec=spec, cache=_cache_revision(self, spec),
                      default_worker_image=config.worker_image)

    def _min_warm_parsed(self, generation: int) -> int | None:
        """pool.minWarm of this generation's spec, when a failed pass got as far as parsing it."""
        parsed = self.memory.parsed
        return parsed[1].pool.min_warm if parsed is not None and parsed[0] == generation else None

    def _show(self, spec: WarmModelSpec, outcome: Outcome) -> None:
        """The pass's figures in the operator's own metrics (the forecast's as in status.forecast)."""
        namespace, name = self.key
        metrics.WARM_PODS.labels(namespace, name).set(sum(o.warm for o in outcome.observations if not o.terminating))
        metrics.MIN_WARM_PODS.labels(namespace, name).set(spec.pool.min_warm)
        metrics.show_forecast(namespace, name, outcome.predicted.forecast)



def _cache_revision(reconciler: Reconciler, spec: WarmModelSpec) -> CacheRevision | None:
    """For an http/s3 source, the revision the node agents read; Temporary until one has."""
    if spec.model.object_store() is None:
        return None
    digest = resolved_revision(spec, reconciler.body.get("status"))
    if digest is None:
        raise Temporary(
            "waiting for a node agent (warmpool node-agent) to read the revision's manifest from "
            "spec.model's object store: no node has reported it in status.cacheNodes yet"
        )
    return CacheRevision(reconciler.shared.config.block_cache_root, digest, reconciler.key[0],
                         partial=spec.model.start_on_partial_cache)


def _status(reconciler: Reconciler, spec: WarmModelSpec | None, generation: int, outcome: Outcome,
            degraded: st.Degradation | None = None) -> Obj:
    """The status this pass observed (rules/status.py), by the operator's clock."""
    (namespace, name), wall = reconciler.key, reconciler.shared.wall()
    now = datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return st.compute_status(
        name=name, spec=spec, generation=generation, pods=outcome.observations,
        deployment=outcome.deployment, cold_starts=reconciler.memory.cold, previous=reconciler.body.get("status"),
        now=now, degraded=degraded, forecast=outcome.predicted.forecast, learned_buckets=outcome.predicted.learned,
        extra_conditions=outcome.predicted.conditions, zero=outcome.zero, wall=wall,
        url=None if spec is None else st.pool_url(name, namespace, spec.pod.port),
    )


def _sleep_context(reconciler: Reconciler, target: Target) -> sleep_actions.Context:
    """What the sleep actions need of one pool's pass; a pod they act on is scraped again at once."""
    def refresh(uid: str) -> None:
        reconciler.memory.scrapes.drop(uid)
        reconciler.poke()

    shared = reconciler.shared
    return sleep_actions.Context(shared.kube, shared.workers, reconciler.body, target, reconciler.memory.children.token,
                                 refresh, shared.config.scrape_interval, shared.monotonic)


def node_health(shared: Shared, scrapes: observe.ScrapeMemory) -> NodeHealth:
    """The nodes a pass treats as lost or leaving, those no pod of ours answers on included: by
    every pool's latest scrapes (rules/node_answers.py, which ``scrapes`` feeds from now on), over
    two scrape rounds and a scrape's timeout, the time a round needs to reach every pod."""
    scrapes.answers = shared.answers
    window = answer_window(shared.config.scrape_interval, shared.config.scrape_timeout)
    now = time.monotonic()  # the clock each scrape's sent_at is stamped with
    shared.answers.forget_older_than(now - 3 * window)
    unanswering = set(shared.answers.unanswering(now, window))
    for node in sorted(unanswering - shared.nodes.unanswering):
        log.warning("node %s: no worker pod there answers its scrapes while pods on other nodes do: its pods "
                    "count as not warm and are replaced", node)
    for node in sorted(shared.nodes.unanswering - unanswering):
        log.info("node %s: a worker pod there answers its scrapes again", node)
    shared.nodes.unanswering = unanswering
    return shared.nodes.health()
