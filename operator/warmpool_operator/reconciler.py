"""One reconciler per WarmModel: a debounced, level-based pass, run when something changed.

What wakes it: the WarmModel's spec or status changing, an event of one of its children or
worker pods (from the watches), a round of samples from the scrape scheduler, or a kopf
handler that waits for the pass (create, resume, spec update).  Pokes that arrive while a pass
is pending or running cost one more pass, not one each.

A pass, from the watch-fed cache and nothing else read from the API server:

1. parse the spec (a bad one: ``Degraded=True``, retried only slowly or on a change);
2. Secret, ConfigMap, Service and PDB made to match the builders (children.py);
3. the pod pipeline (pipeline.py): scrape what is stale, decide, direct, annotate, events;
4. the scaling rule (scaling.py) sets the extra pods; the Deployment is made to match **once**;
5. heat learning, then status (written only when it changed).

What a restart would forget is read back from the live objects: the extra pods from the
Deployment's replicas, each pod's last tier from its annotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf

from warmpool import contract
from warmpool_operator import builders, children, host_paths, metrics, pipeline, scaling
from warmpool_operator import status as st
from warmpool_operator.api import InvalidWarmModel, WarmModelSpec, parse_spec
from warmpool_operator.builders import Obj, Target
from warmpool_operator.cache import Cache
from warmpool_operator.kube import Kind, Kube, KubeError
from warmpool_operator.scheduler import ScrapeScheduler
from warmpool_operator.settings import CONFIG, RETRY_DELAY

log = logging.getLogger("warmpool.operator")

WARMMODELS = Kind(f"/apis/{contract.API_GROUP}/{contract.API_VERSION}", contract.PLURAL)

#: How long a poke waits for others before the pass starts: a burst of events is one pass.
DEBOUNCE_SECONDS = 0.05


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

    def waiting_out(self, generation: int) -> bool:
        """Whether a permanently failed generation still waits before its next unprompted try.

        A refused child waits ``CONFIG.permanent_retry_interval`` (minutes by default), so that
        an outside fix (an admission policy relaxed, a quota raised) heals it without a spec
        edit and without hammering the API server.  A name conflict is looked at every pass:
        the freed name is taken at once."""
        if self.failed_generation != generation or self.failed_reason == st.REASON_CHILD_CONFLICT:
            return False
        return time.monotonic() - self.failed_at < CONFIG.permanent_retry_interval


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    """The pass loop of one WarmModel (a task of its own, stopped when the WarmModel goes)."""

    def __init__(self, body: Mapping[str, Any], kube: Kube, cache: Cache, scheduler: ScrapeScheduler) -> None:
        self.body: Obj = dict(body)
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

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
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

    async def _pass(self, body: Obj, name: str, namespace: str, generation: int) -> None:
        kube, cache, state = self.kube, self.cache, self.state
        spec = self._spec(generation)
        # Before any child: a node directory outside the allowed prefixes is never mounted.
        refused = host_paths.refusal(spec, CONFIG.allowed_host_paths)
        if refused is not None:
            raise Permanent(st.REASON_HOST_PATH_NOT_ALLOWED, refused)
        target = Target(name=name, namespace=namespace, spec=spec)
        try:
            made = await children.ensure_supporting(kube, cache, target, body, state.settled, state.pods.token)
            conflicts = list(made.conflicts)
            state.pods.token = made.token
            observations: list[st.PodObservation] = []
            deployment: Obj | None = None
            if not made.mounted_conflict:
                live = children.live_deployment(cache, target, self.uid)
                if state.extra is None:
                    live_replicas = int(((live or {}).get("spec") or {}).get("replicas") or 0)
                    state.extra = scaling.extra_from_live(spec, live_replicas)
                if live is not None and not conflicts:
                    observations = await pipeline.observe(
                        kube, cache, self.scheduler, body, target, state.pods, str(live["metadata"]["uid"])
                    )
                    extra = scaling.extra_pods(observations, spec.pool.min_warm)
                    if extra != state.extra:
                        warm = sum(o.warm for o in observations if not o.terminating)
                        log.info("%s/%s: %d warm of minWarm %d; extra pods %s -> %d", namespace, name, warm,
                                 spec.pool.min_warm, state.extra, extra)
                        state.extra = extra
                # The Deployment is written at most once per pass, with this pass's replicas.
                replicas = scaling.desired_replicas(spec, state.extra)
                try:
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
        await pipeline.learn_heat(kube, target, state.pods, observations)
        status = st.compute_status(
            name=name,
            spec=spec,
            generation=generation,
            pods=observations,
            deployment=deployment,
            cold_starts=state.pods.cold,
            previous=body.get("status"),
            now=_now(),
        )
        await self._write_status(status)

    async def _write_status(self, status: Obj) -> None:
        """Merge-patch the status subresource when it changed (the conditions list is written
        whole: every pass computes all four).  A 409 is retried a few times."""
        old = self.body.get("status") or {}
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
