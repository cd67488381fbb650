"""One reconciler per WarmModel: a debounced, level-based pass, run when something changed.

What wakes it: the WarmModel's spec or status changing, an event of one of its children or
worker pods (from the watches), a round of samples from the scrape scheduler, or a kopf
handler that waits for the pass (create, resume, spec update).  Pokes that arrive while a pass
is pending or running cost one more pass, not one each.

A pass, from the watch-fed cache and nothing else read from the API server:

1. parse the spec (a bad one: ``Degraded=True``, retried only slowly or on a change);
2. Secret, ConfigMap, Service and PDB made to match the builders (children.py);
3. the pod pipeline (pipeline.py): scrape what is stale, decide, direct, annotate, events;
4. the scaling rule (scaling.py) sets the extra pods, and with spec.pool.predictive the forecast
   (predictor.py, on the operator's forecasting thread) raises them; the Deployment is made to
   match **once**;
5. heat learning and learned warm-up lengths, then status (written only when it changed).

What a restart would forget is read back from the live objects: the extra pods from the
Deployment's replicas, each pod's last tier from its annotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf

from warmpool import contract
from warmpool_operator import builders, children, host_paths, metrics, pipeline, scaling, sleeper, tracing
from warmpool_operator import prediction_status as ps
from warmpool_operator import status as st
from warmpool_operator.api import ForecastStatus, InvalidWarmModel, LearnedBucketsStatus, WarmModelSpec, parse_spec
from warmpool_operator.builders import Obj, Target
from warmpool_operator.cache import Cache
from warmpool_operator.cache_source import CacheRevision, resolved_revision
from warmpool_operator.kube import CONFIGMAPS, Kind, Kube, KubeError
from warmpool_operator.predict import decision as pdecision
from warmpool_operator.predictor import Predictor
from warmpool_operator.scheduler import ScrapeScheduler
from warmpool_operator.settings import CONFIG, RETRY_DELAY

log = logging.getLogger("warmpool.operator")

WARMMODELS = Kind(f"/apis/{contract.API_GROUP}/{contract.API_VERSION}", contract.PLURAL)

#: How long a poke waits for others before the pass starts: a burst of events is one pass.
DEBOUNCE_SECONDS = 0.05
#: The Event a pass emits when demand prediction raises the pool above the reactive count.
REASON_PRE_WARM = "PreWarm"


class Permanent(Exception):
    """Retrying will not help until the WarmModel changes."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.degradation = st.Degradation(reason, message)


class Temporary(Exception):
    """The pass failed for a reason that may pass (an API hiccup): retried after a delay."""


@dataclass
class ModelState:
    """What the operator remembers about one WarmModel between passes (in memory only)."""

    pods: pipeline.PodsState = field(default_factory=pipeline.PodsState)
    settled: children.Settled = field(default_factory=children.Settled)
    #: pods added above the asked-for replicas because Ready pods are not verified warm; None
    #: until read back from the live Deployment (an operator restart must not scale the pool down)
    extra: int | None = None
    #: the generation that failed permanently, why, and when (monotonic): unprompted passes
    #: leave it alone until it changes or CONFIG.permanent_retry_interval has passed
    failed_generation: int | None = None
    failed_reason: str = ""
    failed_at: float = 0.0
    #: the parsed spec of the generation last seen (parsing is not free at a thousand pools)
    parsed: tuple[int, WarmModelSpec] | None = None
    passes: int = 0
    #: the pods demand prediction last raised the Deployment to (None: it did not), for its Event
    pre_warmed: int | None = None
    #: the predicted count held against a quick scale-down, and when it was last asked for (monotonic)
    predicted_hold: tuple[int, float] | None = None

    def waiting_out(self, generation: int) -> bool:
        """Whether a permanently failed generation still waits before its next unprompted try.

        A refused child waits ``CONFIG.permanent_retry_interval`` (minutes by default), so that
        an outside fix (an admission policy relaxed, a quota raised) heals it without a spec
        edit and without hammering the API server.  A name conflict is looked at every pass:
        the freed name is taken at once."""
        if self.failed_generation != generation or self.failed_reason == st.REASON_CHILD_CONFLICT:
            return False
        return time.monotonic() - self.failed_at < CONFIG.permanent_retry_interval


@dataclass
class Predicted:
    """What demand prediction gives a pass: the pods it asks for, and what status reports."""

    replicas: int | None = None
    forecast: ForecastStatus | None = None
    learned: LearnedBucketsStatus | None = None
    conditions: list[tuple[str, str, str, str]] = field(default_factory=list)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    """The pass loop of one WarmModel (a task of its own, stopped when the WarmModel goes)."""

    def __init__(self, body: Mapping[str, Any], kube: Kube, cache: Cache, scheduler: ScrapeScheduler,
                 board: sleeper.PressureBoard | None = None, forecasting: Executor | None = None) -> None:
        self.body: Obj = dict(body)
        #: the operator's one forecasting thread (the registry's); None: no demand prediction
        self.forecasting = forecasting
        self.predictor: Predictor | None = None
        self._stopping: set[asyncio.Task[None]] = set()
        #: every pool's sleepable pods, for memory pressure across WarmModels (the registry's)
        self.board = board if board is not None else sleeper.PressureBoard()
        self.kube = kube
        self.cache = cache
        self.scheduler = scheduler
        self.state = ModelState()
        self._wake = asyncio.Event()
        self._waiters: list[asyncio.Future[None]] = []
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ waking

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"reconcile {self.key}")
            self.poke()

    async def stop(self, *, save: bool = False) -> None:
        """Stop the pass loop; ``save``: the operator shuts down, so the request history is written
        once more (not when the WarmModel is gone: its history goes with it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.predictor is not None:
            await self.predictor.stop(save=save)
        sleeper.cancel_all(self.state.pods.sleep)
        self.board.withdraw(self.key)
        # After the pass loop ended (no pass can set them again): a gone WarmModel, or an operator that
        # stops or lost the lead, reports no forecast.
        metrics.forget_forecast(*self.key)
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
        """Ask for a pass soon (debounced)."""
        self._wake.set()

    async def pass_now(self) -> None:
        """Ask for a pass and wait for it: returns, or raises :class:`Permanent` / :class:`Temporary`."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.poke()
        await waiter

    async def scrape_round(self) -> None:
        """The scheduler's round for this pool: scrape its pods, then a pass decides on the samples."""
        urls = dict(self.state.pods.urls)
        if urls:
            self.state.pods.feed(await self.scheduler.scrape(urls))
        self.poke()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(DEBOUNCE_SECONDS)
            self._wake.clear()
            waiters, self._waiters = self._waiters, []
            try:
                await self.sync(prompted=bool(waiters))
            except Exception as error:
                if not isinstance(error, Permanent | Temporary):
                    log.exception("%s/%s: pass failed", *self.key)
                    error = Temporary(f"{type(error).__name__}: {error}")
                if isinstance(error, Temporary):
                    asyncio.get_running_loop().call_later(RETRY_DELAY, self.poke)
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

    def _spec(self, generation: int) -> WarmModelSpec:
        parsed = self.state.parsed
        if parsed is not None and parsed[0] == generation:
            return parsed[1]
        try:
            spec = parse_spec(self.body.get("spec") or {})
        except InvalidWarmModel as error:
            raise Permanent(st.REASON_INVALID_SPEC, str(error)) from None
        self.state.parsed = (generation, spec)
        return spec

    async def sync(self, prompted: bool) -> None:
        """One level-based pass (see the module docstring).  ``prompted``: a handler waits for it,
        so a permanently failed generation is tried even while it waits out its retry delay."""
        body = self.body
        meta = body["metadata"]
        name, namespace = str(meta["name"]), str(meta["namespace"])
        generation = int(meta.get("generation") or 0)
        state = self.state
        kind = "handler" if prompted else "event"
        if meta.get("deletionTimestamp"):
            return  # going: the garbage collector takes the children
        if not prompted and state.waiting_out(generation):
            return  # failed for good at this generation: wait for a change or the slow retry
        started = time.monotonic()
        state.passes += 1
        try:
            with tracing.span(contract.SPAN_RECONCILE, {contract.ATTR_WARMMODEL_UID: self.uid,
                                                        contract.ATTR_WARMMODEL: f"{namespace}/{name}"}):
                await self._pass(body, name, namespace, generation)
            state.failed_generation = None
        except Permanent as error:
            metrics.RECONCILE_ERRORS.labels(kind, "permanent").inc()
            first = state.failed_generation != generation or state.failed_reason != error.degradation.reason
            state.failed_generation = generation
            state.failed_reason = error.degradation.reason
            state.failed_at = time.monotonic()
            status = st.compute_status(
                name=name,
                spec=None,
                generation=generation,
                pods=(),
                deployment=None,
                cold_starts=state.pods.cold,
                previous=body.get("status"),
                now=_now(),
                degraded=error.degradation,
            )
            await self._write_status(status)
            if first:
                kopf.event(body, type="Warning", reason=error.degradation.reason, message=str(error))  # type: ignore[arg-type]
            raise
        except (KubeError, aiohttp.ClientError, TimeoutError, OSError) as error:
            metrics.RECONCILE_ERRORS.labels(kind, "temporary").inc()
            raise Temporary(f"{type(error).__name__}: {error}") from error
        finally:
            metrics.RECONCILE_SECONDS.labels(kind).observe(time.monotonic() - started)

    @staticmethod
    def _cache_revision(spec: WarmModelSpec, body: Obj) -> CacheRevision | None:
        """For an http/s3 source, the revision the node agents read; Temporary until one has."""
        if spec.model.object_store() is None:
            return None
        digest = resolved_revision(spec, body.get("status"))
        if digest is None:
            raise Temporary(
                "waiting for a node agent (warmpool node-agent) to read the revision's manifest from "
                "spec.model's object store: no node has reported it in status.cacheNodes yet"
            )
        return CacheRevision(CONFIG.block_cache_root, digest, partial=spec.model.start_on_partial_cache)

    async def _pass(self, body: Obj, name: str, namespace: str, generation: int) -> None:
        kube, cache, state = self.kube, self.cache, self.state
        spec = self._spec(generation)
        # Before any child: a node directory outside the allowed prefixes is never mounted.
        refused = host_paths.refusal(spec, CONFIG.allowed_host_paths, CONFIG.block_cache_root)
        if refused is not None:
            raise Permanent(st.REASON_HOST_PATH_NOT_ALLOWED, refused)
        target = Target(name=name, namespace=namespace, spec=spec, cache=self._cache_revision(spec, body))
        try:
            live = children.live_deployment(cache, target, self.uid)
            if live is not None:
                # Before the Service (whose selector asks for the awake label) is brought up to date.
                await sleeper.label_unlabelled(kube, namespace, pipeline.our_pods(
                    cache, target, state.pods, str(live["metadata"]["uid"])))
            with tracing.span(contract.SPAN_APPLY):
                made = await children.ensure_supporting(kube, cache, target, body, state.settled, state.pods.token)
            conflicts = list(made.conflicts)
            state.pods.token = made.token
            observations: list[st.PodObservation] = []
            deployment: Obj | None = None
            predicted = Predicted()
            if not made.mounted_conflict:
                live = children.live_deployment(cache, target, self.uid)
                if state.extra is None:
                    live_replicas = int(((live or {}).get("spec") or {}).get("replicas") or 0)
                    state.extra = scaling.extra_from_live(spec, live_replicas)
                    if spec.pool.predictive is not None and spec.pool.predictive.enabled:
                        # Pods a forecast asked for before a restart stay while the new operator's
                        # own forecast gets going (the scale-down hold), instead of going and coming back.
                        state.predicted_hold = (min(live_replicas, spec.pool.max_replicas), time.monotonic())
                if live is not None and not conflicts:
                    observations = await pipeline.observe(
                        kube, cache, self.scheduler, body, target, state.pods, str(live["metadata"]["uid"]),
                        board=self.board, poke=self.poke,
                    )
                    extra = scaling.extra_pods(observations, spec.pool.min_warm)
                    if extra != state.extra:
                        warm = sum(o.warm for o in observations if not o.terminating)
                        log.info("%s/%s: %d warm of minWarm %d; extra pods %s -> %d", namespace, name, warm,
                                 spec.pool.min_warm, state.extra, extra)
                        state.extra = extra
                    predicted = self._predict(spec, observations)
                # The Deployment is written at most once per pass, with this pass's replicas.
                replicas = scaling.with_prediction(spec, state.extra, predicted.replicas)
                self._announce(body, spec, replicas, predicted)
                try:
                    with tracing.span(contract.SPAN_APPLY):
                        deployment = await children.ensure(
                            kube, cache, builders.build_deployment(target, replicas), body, state.settled
                        )
                except children.ChildConflict as conflict:
                    conflicts.append(conflict)
        except KubeError as error:
            if error.status in (400, 422):
                # The API server refuses a child built from this spec (e.g. requests above limits,
                # or an admission policy): retried slowly and on any change (an outside fix heals it).
                raise Permanent(st.REASON_CHILD_REJECTED, f"the API server refused a child: {error.message}") from None
            raise
        if conflicts or deployment is None:
            names = "; ".join(str(conflict) for conflict in conflicts)
            raise Permanent(st.REASON_CHILD_CONFLICT, f"{names}: left untouched (delete or rename it to let this "
                            "WarmModel create its own)")
        metrics.WARM_PODS.labels(namespace, name).set(sum(o.warm for o in observations if not o.terminating))
        metrics.MIN_WARM_PODS.labels(namespace, name).set(spec.pool.min_warm)
        # The same figures as status.forecast, from the same pass (none: prediction off, their series go).
        metrics.show_forecast(namespace, name, predicted.forecast)
        await pipeline.learn_heat(kube, target, state.pods, observations)
        await self._write_learned_buckets(target, predicted)
        status = st.compute_status(
            name=name,
            spec=spec,
            generation=generation,
            pods=observations,
            deployment=deployment,
            cold_starts=state.pods.cold,
            previous=body.get("status"),
            now=_now(),
            forecast=predicted.forecast,
            learned_buckets=predicted.learned,
            extra_conditions=predicted.conditions,
        )
        with tracing.span(contract.SPAN_STATUS):
            await self._write_status(status)

    # ------------------------------------------------------------------ demand prediction

    def _predictor(self, spec: WarmModelSpec) -> Predictor | None:
        """The WarmModel's predictor while spec.pool.predictive or spec.warmup.learnBuckets is set."""
        wanted = (spec.pool.predictive is not None or spec.warmup.learn_buckets) and self.forecasting is not None
        if not wanted:
            if self.predictor is not None:  # turned off: stop (the stored history stays for later)
                stopping = asyncio.create_task(self.predictor.stop(save=False))
                self._stopping.add(stopping)
                stopping.add_done_callback(self._stopping.discard)
                self.predictor = None
            return None
        if self.predictor is None:
            assert self.forecasting is not None
            self.predictor = Predictor(self.kube, self.body, CONFIG.predict_step_seconds, self.forecasting,
                                       self.poke)
            self.predictor.start()
        return self.predictor

    def _predict(self, spec: WarmModelSpec, observations: list[st.PodObservation]) -> Predicted:
        """Feed this pass's samples to the history; the pods the forecast asks for, and its status."""
        predictor = self._predictor(spec)
        out = Predicted()
        if predictor is None:
            self.state.pods.awake_wanted = 0
            return out
        live = [o for o in observations if not o.terminating]
        predictor.observe({o.uid: (o.name, o.sample) for o in live})
        if spec.warmup.learn_buckets and predictor.loaded:
            out.learned = ps.learned_status(predictor.learned_buckets())
        predictive = spec.pool.predictive
        if predictive is None:
            return out
        wake = st.wake_figures(live)
        lead = pdecision.lead_time(predictive.decision_spec(), self.state.pods.cold.figures().p95_seconds,
                                   wake.p95_seconds if wake is not None else None, sum(o.asleep for o in live))
        predictor.want_horizons(pdecision.horizons(lead.seconds, predictor.step_s))
        prediction = predictor.current()
        capacity = predictor.capacity.capacity_rps()
        decision = scaling.predictive_decision(spec, prediction.p90 if prediction is not None else None,
                                               predictor.step_s, capacity, scaling.autoscaled(self.body))
        last = predictor.last_closed
        report = ps.report(enabled=predictive.enabled, loaded=predictor.loaded, prediction=prediction,
                           decision=decision, lead=lead, step_s=predictor.step_s, history_steps=len(predictor.history),
                           last_count=(last.observation.requests if last is not None and last.observation is not None
                                       else None),
                           capacity_rps=capacity, last_problem=predictor.last_problem)
        out.forecast = report.forecast
        out.conditions.append((contract.CONDITION_PREDICTIVE, report.verdict.status, report.verdict.reason,
                               report.verdict.message))
        acting = predictive.enabled and report.verdict.status == "True" and decision.predicted is not None
        # The pods the forecast asks for (sleeping pods wake first to serve them), held against a quick
        # scale-down: a lower forecast lowers the pool only after a lead time (at least five steps).
        wanted = scaling.awake_wanted(spec, decision) if acting else None
        hold_s = max(lead.seconds, 5.0 * predictor.step_s)
        hold = scaling.held(self.state.predicted_hold, wanted, time.monotonic(), hold_s)
        self.state.predicted_hold = hold
        out.replicas = hold[0] if hold is not None else None
        # Awake: what this forecast asks for (held pods beyond it may sleep; a restart's held pods do not wake).
        self.state.pods.awake_wanted = wanted or 0
        return out

    def _announce(self, body: Obj, spec: WarmModelSpec, replicas: int, predicted: Predicted) -> None:
        """An Event when prediction raises the pool above the reactive count (once per new count)."""
        reactive = scaling.desired_replicas(spec, self.state.extra or 0)
        raised = replicas if predicted.replicas is not None and replicas > reactive else None
        if raised is not None and raised != self.state.pre_warmed:
            message = (f"demand forecast: {reactive} -> {replicas} pods ahead of the load "
                       f"({predicted.forecast.reason if predicted.forecast is not None else ''})")[:1024]
            kopf.event(body, type="Normal", reason=REASON_PRE_WARM, message=message)  # type: ignore[arg-type]
            log.info("%s/%s: %s", *self.key, message)
        self.state.pre_warmed = raised

    async def _write_learned_buckets(self, target: Target, predicted: Predicted) -> None:
        """Put the learned warm-up lengths where new pods read them (the WarmModel's ConfigMap);
        best effort, like the heat map: status must still be written."""
        learned = predicted.learned
        want: str | None = None  # learnBuckets off: the key goes (new pods warm at spec.warmup.buckets)
        if target.spec.warmup.learn_buckets:
            if learned is None or not learned.buckets:
                return  # none learned (yet, or since a restart): what new pods read stays as it is
            want = json.dumps({"format": contract.LEARNED_BUCKETS_FORMAT, "buckets": learned.buckets})
        name = builders.configmap_name(target.name)
        live = self.cache.child("ConfigMap", target.namespace, name)
        have = ((live or {}).get("data") or {}).get(contract.CONFIGMAP_KEY_LEARNED_BUCKETS)
        if live is None or have == want:
            return
        try:
            await self.kube.patch(CONFIGMAPS, target.namespace, name,
                                  {"data": {contract.CONFIGMAP_KEY_LEARNED_BUCKETS: want}})
        except (KubeError, aiohttp.ClientError, TimeoutError) as error:
            log.warning("%s/%s: learned warm-up lengths not written (%s): carrying on", target.namespace,
                        target.name, error)
            return
        log.info("%s/%s: learned warm-up lengths %s", target.namespace, target.name,
                 learned.buckets if learned is not None and want is not None else "removed")

    async def _write_status(self, status: Obj) -> None:
        """Merge-patch the status subresource when it changed (the conditions list is written
        whole: every pass computes all four).  A 409 is retried a few times."""
        old = self.body.get("status") or {}
        for optional in ("forecast", "learnedBuckets"):  # a feature turned off: its figures go (merge patch)
            if optional not in status and old.get(optional) is not None:
                status[optional] = None
        if all(old.get(k) == v for k, v in status.items()):
            return
        meta = self.body["metadata"]
        for attempt in range(3):
            try:
                written = await self.kube.patch(
                    WARMMODELS, meta["namespace"], meta["name"], {"status": status}, subresource="status"
                )
                # Seen at once by the next pass (the watch's echo may come later).
                if written.get("metadata", {}).get("uid") == self.uid:
                    self.body["status"] = written.get("status") or status
                return
            except KubeError as error:
                if error.status == 404:
                    return  # deleted meanwhile
                if error.status != 409 or attempt == 2:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))
