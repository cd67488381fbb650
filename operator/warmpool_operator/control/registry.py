"""The operator-wide set of reconcilers (kept in kopf's memo), and the routing of watch events
to the one WarmModel they concern."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from warmpool.contract.zero import LABEL_SERVICE_NAME
from warmpool.kube import KubeError
from warmpool_operator.control import node_probe, nodes, resync
from warmpool_operator.control.pass_queue import PassQueue
from warmpool_operator.control.reconciler import Reconciler
from warmpool_operator.control.shared import Shared
from warmpool_operator.control.sleep_actions import PressureBoard
from warmpool_operator.control.zero import ActivatorBoard
from warmpool_operator.io.kube import ENDPOINTSLICES, Kube
from warmpool_operator.io.list_watch import list_watch
from warmpool_operator.io.scrape_scheduler import ScrapeScheduler
from warmpool_operator.io.tracing import Tracing
from warmpool_operator.io.watch_cache import Cache, model_key, slim, uid_of, warmmodel_owner
from warmpool_operator.io.worker_client import WorkerClient, knock
from warmpool_operator.rules.control_token import KEY_BYTES
from warmpool_operator.rules.node_answers import answer_window
from warmpool_operator.rules.node_health import NodeBoard
from warmpool_operator.settings import OperatorConfig

log = logging.getLogger("warmpool.operator")


@dataclass
class Registry:
    kube: Kube
    workers: WorkerClient
    scheduler: ScrapeScheduler
    config: OperatorConfig = field(default_factory=OperatorConfig)
    tracing: Tracing = field(default_factory=Tracing)
    cache: Cache | None = None
    by_key: dict[tuple[str, str], Reconciler] = field(default_factory=dict)
    scheduling: asyncio.Task[None] | None = None
    #: every pool's sleepable pods by node: memory pressure puts the idlest to sleep, whichever pool
    board: PressureBoard = field(default_factory=PressureBoard)
    #: reconcilers of WarmModels deleted and made again under the same name, while they stop
    stopping: set[asyncio.Task[None]] = field(default_factory=set)
    #: the one thread every WarmModel's forecasts and model training run on: prediction costs
    #: at most one core, and never the event loop
    forecasting: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="warmpool-forecast"))
    #: uids a resync found deleted while a watch was down: every Cache made shares this set (resync.py)
    gone: set[str] = field(default_factory=set)
    #: uids of the objects the watches have shown (a listed one seen before: that watch listed again)
    known: set[str] = field(default_factory=set)
    resync_wanted: asyncio.Event = field(default_factory=asyncio.Event)
    #: the order passes run in when more are asked for than run at once (news before the backlog)
    queue: PassQueue = field(default_factory=PassQueue)
    resyncing: asyncio.Task[None] | None = None
    #: the key of the workers' control tokens (io/control_key.py); random unless given
    control_key: bytes = field(default_factory=lambda: secrets.token_bytes(KEY_BYTES))
    #: the activator's addresses (scale to zero), from the watch of its Service's EndpointSlices
    activators: ActivatorBoard = field(default_factory=ActivatorBoard)
    activator_watch: asyncio.Task[None] | None = None
    #: lost and cordoned nodes, from the Node watch (control/nodes.py)
    nodes: NodeBoard = field(default_factory=NodeBoard)
    node_watch: asyncio.Task[None] | None = None
    node_lease_watch: asyncio.Task[None] | None = None
    node_knocks: asyncio.Task[None] | None = None
    #: what every reconciler gets (made from the fields above)
    shared: Shared = field(init=False)

    def __post_init__(self) -> None:
        self.shared = Shared(kube=self.kube, workers=self.workers, scheduler=self.scheduler, config=self.config,
                             tracing=self.tracing, board=self.board, forecasting=self.forecasting,
                             control_key=self.control_key, activators=self.activators, nodes=self.nodes)

    def start_scheduler(self) -> None:
        if self.scheduling is None:
            self.scheduling = asyncio.create_task(self.scheduler.run(self.rounds), name="scrape scheduler")

    def start_activator_watch(self) -> None:
        """Follow the activator's Service's EndpointSlices (--activator-service): their own small
        watch, since the activator's namespace need not be one kopf watches WarmModels in."""
        if self.activator_watch is not None or self.config.activator_service is None:
            return
        namespace, name = self.config.activator_service

        def changed(event_type: str, body: Mapping[str, Any]) -> None:
            if self.activators.update(event_type, body):
                self.poke_scale_to_zero()

        def relisted() -> None:  # the list that follows brings back what is still there
            if self.activators.slices:
                self.activators.slices.clear()
                self.poke_scale_to_zero()

        self.activator_watch = asyncio.create_task(list_watch(
            self.kube, ENDPOINTSLICES.path(namespace), f"{LABEL_SERVICE_NAME}={name}", changed, relisted,
            asyncio.Event()), name="activator addresses")

    def start_node_watch(self) -> None:
        """Follow the Nodes and their Leases: a node lost, silent or cordoned wakes the pools with
        pods on it."""
        if self.node_watch is None:
            self.node_watch = asyncio.create_task(nodes.follow_nodes(self.kube, self.nodes, self.poke_pools_on),
                                                  name="nodes")
        grace = self.config.node_lease_grace_seconds
        if self.node_lease_watch is None and grace > 0:
            self.node_lease_watch = asyncio.create_task(
                nodes.follow_node_leases(self.kube, self.nodes, self.poke_pools_on, grace), name="node leases")
        interval = self.config.node_probe_interval
        if self.node_knocks is None and interval > 0:
            limit = min(interval, self.config.scrape_timeout)
            window = answer_window(self.config.scrape_interval, self.config.scrape_timeout)
            self.node_knocks = asyncio.create_task(node_probe.knock_between_scrapes(
                self.shared.answers, lambda url: knock(url, limit), self.poke_pools_on, interval, window),
                name="node knocks")

    def poke_pools_on(self, names: set[str]) -> None:
        for key in nodes.pools_on(self.cache, names):
            rec = self.by_key.get(key)
            if rec is not None:
                rec.poke()

    def start_resync(self) -> None:
        if self.resyncing is None:
            self.resyncing = asyncio.create_task(self._resync_loop(self.config.resync_interval), name="resync")

    def saw(self, event_type: str | None, uid: str) -> None:
        """Note a watch event.  A listed object (type None) seen before means its watch broke and
        listed again: what was deleted meanwhile got no DELETED event, so a resync is asked for."""
        if event_type == "DELETED":
            self.known.discard(uid)
            return
        if event_type is None and uid in self.known and not self.resync_wanted.is_set():
            log.info("a watch listed its objects again (it broke and lost its place): resync in %gs",
                     resync.SETTLE_SECONDS)
            self.resync_wanted.set()
        self.known.add(uid)

    async def _resync_loop(self, interval: float) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.resync_wanted.wait(), interval)
            if self.resync_wanted.is_set():
                await asyncio.sleep(resync.SETTLE_SECONDS)
            self.resync_wanted.clear()
            try:
                await self.resync()
            except (KubeError, aiohttp.ClientError, TimeoutError) as error:
                log.warning("resync failed (%s: %s): tried again at the next relist or in %gs",
                            type(error).__name__, error, interval)

    async def resync(self) -> None:
        """Find what was deleted while a watch was down; restore it through its WarmModel's pass."""
        cache = self.cache
        if cache is None:
            return  # no WarmModel seen yet: nothing of ours is held
        for deleted in await resync.deleted_children(self.kube, cache):
            uid = uid_of(deleted.obj)
            self.gone.add(uid)
            self.known.discard(uid)
            meta = deleted.obj.get("metadata") or {}
            owner = warmmodel_owner(deleted.obj)
            key = owner[:2] if owner is not None else model_key(deleted.namespace, meta.get("labels") or {})
            rec = self.get(*key) if key is not None else None
            log.info("resync: %s %s/%s was deleted while a watch was down%s", deleted.kind, deleted.namespace,
                     deleted.name, f": WarmModel {key[0]}/{key[1]} reconciled" if rec and key else "")
            if rec is not None:
                rec.poke()
        for body in await resync.deleted_warmmodels(self.kube, [rec.body for rec in list(self.by_key.values())]):
            meta = body["metadata"]
            log.info("resync: WarmModel %s/%s was deleted while a watch was down: its reconciler stops",
                     meta["namespace"], meta["name"])
            await self.forget(str(meta["namespace"]), str(meta["name"]), str(meta["uid"]))
        # A hidden object the index no longer holds needs hiding no more.
        self.gone.intersection_update(cache.stored_uids())

    def poke_scale_to_zero(self) -> None:
        """A pass for every pool with spec.pool.scaleToZero (the activator's addresses changed)."""
        for rec in list(self.by_key.values()):
            if ((rec.body.get("spec") or {}).get("pool") or {}).get("scaleToZero") is not None:
                rec.poke()

    def rounds(self) -> Iterator[Callable[[], Awaitable[None]]]:
        return (rec.scrape_round for rec in list(self.by_key.values()))

    def get(self, namespace: str, name: str, uid: str | None = None) -> Reconciler | None:
        rec = self.by_key.get((namespace, name))
        if rec is None or (uid is not None and rec.uid != uid):
            return None
        return rec

    def ensure(self, body: Mapping[str, Any], cache: Cache, *, listed: bool = False) -> Reconciler:
        """The WarmModel's reconciler, made and started on first sight; ``body`` becomes its view
        (io/watch_cache.py's slim copy: no managed fields, no kubectl or kopf copy of its content).
        ``listed``: first seen in a watch's initial list, so its first pass goes after news
        (control/pass_queue.py)."""
        body = slim(body)
        meta = body["metadata"]
        key = (str(meta["namespace"]), str(meta["name"]))
        rec = self.by_key.get(key)
        if rec is not None and rec.uid != str(meta["uid"]):  # deleted and made again under the same name
            self.by_key.pop(key, None)
            stopping = asyncio.create_task(rec.stop())
            self.stopping.add(stopping)
            stopping.add_done_callback(self.stopping.discard)
            rec = None
        if rec is None:
            self.cache = cache
            rec = Reconciler(body, self.shared, cache, self.queue)
            self.by_key[key] = rec
            rec.start(listed=listed)
        else:
            rec.body = body
        return rec

    async def forget(self, namespace: str, name: str, uid: str) -> None:
        rec = self.get(namespace, name, uid)
        if rec is not None:
            self.by_key.pop((namespace, name), None)
            await rec.stop()

    async def close(self) -> None:
        for task in (self.scheduling, self.resyncing, self.activator_watch, self.node_watch,
                     self.node_lease_watch, self.node_knocks):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for rec in list(self.by_key.values()):
            await rec.stop(save=True)  # the request histories are written once more before the exit
        self.by_key.clear()
        self.forecasting.shutdown(wait=False, cancel_futures=True)
