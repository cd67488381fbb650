"""The node agent's loop: keep this node's cache in step with the WarmModels that need it.

A pass runs when a watched WarmModel or a worker pod on this node changes, when a fill or a
manifest read ends, and at least every ``interval`` seconds (passes are level-based: a missed
event is caught by the next).  Each WarmModel's work is its own: whatever one of them raises
goes into its own ``status.cacheNodes`` entry and an Event on it, and the pass goes on to the
others.

1. WarmModels with an http/s3 source are listed (all namespaces, or one).  A manifest is read
   only for a WarmModel that needs this node -- a worker pod of it bound here (a pod is its only
   when its ownerReferences lead, checked, through a ReplicaSet and a Deployment to it:
   ``agent_owners``; the pod's labels count for nothing) -- or, before any
   node has reported its revision, by the one agent holding its read Lease (``agent_reads``).
   Reads run beside the pass, a bounded number at once, each bounded in size and time.  This
   node's entry in the WarmModel's ``status.cacheNodes`` is applied -- digest, bytes cached /
   total, published, the real path of the revision's directory -- so the operator can build pods for
   the revision and show per-node progress.  The entry is written as this node's own field
   manager (server-side apply), never the operator's.
2. For each such WarmModel with a worker pod bound to this node and the revision not yet
   published here, a fill starts (one per revision at a time): under the (node, revision)
   ``coordination.k8s.io`` Lease, the headers' blocks first, then layers hottest first from the
   heat map in the WarmModel's ConfigMap; an agent that loses the Lease race tries again on a
   later pass and finds the revision published.  A fill killed midway resumes from the blocks
   already stored once the Lease expires.
3. The node's labels are made to say which revisions it holds; revisions wanted by pods here
   are pinned -- the current revision of each WarmModel with pods here, and every revision a
   pod here names in its ``warmpool.dev/cache-revision`` annotation (an older revision's pods
   during a rollout) -- and with a budget the cache is evicted (LRU-2) down to it, never a
   pinned revision, nor one a process this agent can see maps, and not at all while a WarmModel
   with pods here has a manifest this agent has not read (its revision is unknown: a
   just-started agent would evict it).  A failure of any of these, of a pass or of a watch is
   an Event on the Node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmpool.contract.files import CONFIGMAP_KEY_HEATMAP
from warmpool.contract.metrics import NODE_AGENT_STAGE_BLOCKS, NODE_AGENT_STAGE_MANIFEST
from warmpool.contract.pods import CONFIGMAP_SUFFIX
from warmpool.kube import KubeError
from warmpool.lease import LeaseLostError, Observed
from warmpool_nodecache import agent, agent_http, cluster_ranges, trust
from warmpool_nodecache import agent_notices as notices
from warmpool_nodecache.agent_fill import fill_blocking, keep_renewing
from warmpool_nodecache.agent_housekeeping import Housekeeping
from warmpool_nodecache.agent_kube import AgentKube, agent_lease, lease_name
from warmpool_nodecache.agent_owners import PodOwners
from warmpool_nodecache.agent_reads import FirstReads, read_manifest, revision_reported
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import Manifest
from warmpool_nodecache.netguard import AddressPolicy
from warmpool_nodecache.partial import point_link
from warmpool_nodecache.source import ReadLimits, Source, SourceError
from warmpool_nodecache.source_errors import unavailable_text
from warmpool_nodecache.spec import ca_bundle_from_secret_data, ca_bundle_ref

log = logging.getLogger("warmpool.node_agent")


@dataclass(frozen=True)
class AgentConfig:
    node: str
    cache_root: Path
    budget_bytes: int | None = None
    namespace: str | None = None  # None: WarmModels of every namespace
    lease_namespace: str = "default"
    interval_s: float = 10.0
    lease_duration_s: float = 15.0
    fence_timeout_s: float = 10.0
    #: Least seconds between two writes of an entry whose only change is bytes cached: each write
    #: wakes the operator's pass over the WarmModel, and a fill moves on every block.
    progress_interval_s: float = 10.0
    #: Fill each revision as a partial view (``partial.py``), in the order a worker started on it
    #: needs (``agent.start_order``), so a worker run with ``--partial-cache`` on
    #: ``<cache root>/domains/<namespace>/partial/<digest hex>`` can start before the publish.
    partial_view: bool = False
    #: Where sources may be read from (``--cluster-network``, ``--source-allow-network``; with
    #: ``policy.discovered`` the agent finds the cluster's networks itself: ``cluster_ranges``).
    policy: AddressPolicy = field(default_factory=AddressPolicy)
    #: Seconds between two discoveries of the cluster's networks (``--cluster-networks-refresh``).
    cluster_networks_refresh_s: float = 60.0
    #: What one read may cost (``--max-manifest-bytes``, ``--max-block-bytes``, ``--source-deadline``).
    limits: ReadLimits = field(default_factory=ReadLimits)
    #: Manifest reads at once (``--manifest-reads``).
    manifest_reads: int = 4
    #: Sign for an s3 source without a secretRef with boto3's default chain of the agent's own
    #: process (``--s3-default-credentials``: web identity, a profile, metadata); off, it reads unsigned.
    s3_default_credentials: bool = False
    #: Where the agent's own endpoints listen (``--bind``): its probes on ``health_port`` and its
    #: Prometheus metrics on ``metrics_port`` (0: not served).
    bind: str = "0.0.0.0"
    health_port: int = 0
    metrics_port: int = 0


@dataclass
class _Known:
    """What the agent holds about one WarmModel's current source."""

    fingerprint: str
    source: Source | None = None
    manifest: Manifest | None = None
    error: str | None = None  # reading the Secret or the manifest failed (cleared by the next read)
    fill_error: str | None = None  # the last fill failed (cleared by a publish, not by a manifest read)
    last_entry: dict[str, Any] | None = None
    last_write: float = 0.0
    fill: asyncio.Task[None] | None = None
    retry_at: float = 0.0  # monotonic time before which no fill starts again (after a failed one)
    read: asyncio.Task[None] | None = None
    read_at: float = 0.0  # monotonic time before which no read starts again (after a failed one)

    def cancel(self) -> None:
        for task in (self.fill, self.read):
            if task is not None:
                task.cancel()


@dataclass
class Agent:
    config: AgentConfig
    kube: AgentKube
    known: dict[str, _Known] = field(default_factory=dict)
    downloads: int = 0  # fills this process ran that fetched bytes (reported in the log)
    passes: int = 0  # passes finished without an error (the first one makes the agent ready)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: what this agent saw of each fill Lease another agent held, by Lease name (expiry is
    #: judged by this process's own clock, across its attempts)
    fill_leases_seen: dict[str, Observed] = field(default_factory=dict)
    notices: notices.Notices = field(init=False)
    first_reads: FirstReads = field(init=False)
    reads: asyncio.Semaphore = field(init=False)
    housekeeping: Housekeeping = field(init=False)
    owners: PodOwners = field(init=False)

    def __post_init__(self) -> None:
        self.notices = notices.Notices(self.kube, self.config.node)
        self.owners = PodOwners(self.kube)
        self.housekeeping = Housekeeping(self.kube, self.layout, self.notices, self.config.budget_bytes)
        # The read Lease outlives a pass or two, so a holder that is slow between passes keeps it.
        self.first_reads = FirstReads(self.kube, self.config.lease_namespace, self.config.node,
                                      max(self.config.lease_duration_s, 3 * self.config.interval_s))
        self.reads = asyncio.Semaphore(self.config.manifest_reads)

    async def _watch(self, path: str, query: Mapping[str, str]) -> None:
        """Wake the loop on every change of the watched objects; watch again when the server ends it."""
        while True:
            try:
                async for _ in self.kube.watch_events(path, query):
                    self.wake.set()
                self.notices.clear(self.notices.node_object(), notices.REASON_WATCH_FAILED)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the interval still drives passes; watch again shortly
                log.info("node agent: watch of %s ended (%s: %s)", path, type(error).__name__, error)
                await self.notices.warn(self.notices.node_object(), notices.REASON_WATCH_FAILED,
                                        f"the watch of {path} failed ({type(error).__name__}: {error}); "
                                        f"passes run every {self.config.interval_s:g}s until it is back"[:1000])
                await asyncio.sleep(self.config.interval_s)

    @property
    def layout(self) -> CacheLayout:
        return CacheLayout(self.config.cache_root)

    async def run(self, stop: asyncio.Event) -> None:
        pods_path, pods_query = self.kube.pods_here_query(self.config.namespace)
        watchers = [
            asyncio.create_task(self._watch(self.kube.warmmodels_path(self.config.namespace), {})),
            asyncio.create_task(self._watch(pods_path, pods_query)),
        ]
        if (live := self.config.policy.discovered) is not None:  # known before the first read
            await cluster_ranges.refresh(self.kube, live, self.notices)
            watchers.append(asyncio.create_task(cluster_ranges.keep_discovering(
                self.kube, live, self.notices, self.config.cluster_networks_refresh_s)))
        while not stop.is_set():
            self.wake.clear()
            try:
                await self.tick()
                self.passes += 1
                self.notices.clear(self.notices.node_object(), notices.REASON_PASS_FAILED)
            except Exception as error:  # one bad pass (API down, cache busy) must not end the agent
                log.warning("node agent: pass failed (%s: %s); trying again", type(error).__name__, error)
                await self.notices.warn(self.notices.node_object(), notices.REASON_PASS_FAILED,
                                        f"a pass failed ({agent.failure_text(error)}); trying again")
            # The next pass: when a watched object changes or a fill ends, else after the interval.
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.wake.wait())]
            await asyncio.wait(waits, timeout=self.config.interval_s, return_when=asyncio.FIRST_COMPLETED)
            for waiting in waits:
                waiting.cancel()
            await asyncio.sleep(min(0.2, self.config.interval_s))  # a burst of events makes one pass
        for watcher in watchers:
            watcher.cancel()
        for known in self.known.values():
            known.cancel()
        self.housekeeping.close()
        await self.first_reads.close()

    async def tick(self) -> None:
        objects = await self.kube.warmmodels(self.config.namespace)
        # Only pods a listed WarmModel's Deployment owns count (agent_owners): labels prove nothing.
        models = {str(meta.get("uid")): (str(meta.get("namespace")), str(meta.get("name")))
                  for meta in (o.get("metadata") or {} for o in objects)}
        owned = await self.owners.owned(await self.kube.pods_here(self.config.namespace), models)
        here = {model for _, model in owned}
        # Every revision a pod here mounts, an older revision's pods during a rollout included.
        wanted: set[str] = agent.mounted_revisions(pod for pod, _ in owned)
        keys: set[str] = set()
        unread: set[str] = set()  # WarmModels with pods here whose revision is not known yet
        for obj in objects:
            ref = agent.model_ref(obj)
            if ref is None:
                continue
            keys.add(ref.key)
            on_node = (ref.namespace, ref.name) in here
            try:
                await self._serve(ref, obj, on_node, wanted)
            except Exception as error:  # this WarmModel's failure is its own: the others go on
                await self._failed(ref, error)
            if on_node and (known := self.known.get(ref.key)) is not None and known.manifest is None:
                unread.add(ref.key)
        for key in set(self.known) - keys:
            self.known.pop(key).cancel()
            await self.first_reads.release(key)
        filling = any(k.fill is not None and not k.fill.done() for k in self.known.values())
        await self.housekeeping.run(wanted, filling, frozenset(unread))

    def _known(self, ref: agent.ModelRef) -> _Known:
        known = self.known.get(ref.key)
        if known is None or known.fingerprint != ref.fingerprint:
            if known is not None:
                known.cancel()
            known = self.known[ref.key] = _Known(ref.fingerprint)
            agent_http.show_model(ref.namespace, ref.name)
        return known

    async def _serve(self, ref: agent.ModelRef, obj: Mapping[str, Any], on_node: bool, wanted: set[str]) -> None:
        """One WarmModel's part of the pass: read, fill, report (see the module docstring)."""
        known = self._known(ref)
        reported = revision_reported(obj, ref.fingerprint)
        if known.manifest is None or known.source is None:
            await self._maybe_read(ref, known, on_node, reported)
        elif reported:
            self.first_reads.rest(ref.key)
        manifest = known.manifest
        if manifest is not None and known.source is not None and on_node:
            wanted.add(manifest.digest_hex)
            busy = known.fill is not None and not known.fill.done()
            retry = time.monotonic() >= known.retry_at
            # Published and verified by this WarmModel's trust domain (trust.py); a revision another
            # domain published is verified from this one's own source by the fill before it is linked.
            granted = trust.granted(self.layout, manifest.digest_hex, ref.domain)
            if not granted and not busy and retry:
                known.fill = asyncio.create_task(self._fill(ref, known, manifest), name=f"fill {ref.key}")
            elif ref.partial and granted and not busy:
                # Published without a partial view (before startOnPartialCache was set, or by a
                # fill that did not make one): pods started on the domain's partial link find it there too.
                link = self.layout.partial_link(manifest.digest_hex, ref.domain)
                if not link.is_dir():
                    point_link(link, self.layout.revision(manifest.digest_hex))
        if manifest is not None or known.error is not None or known.fill_error is not None:
            await self._report(ref, known)

    async def _maybe_read(self, ref: agent.ModelRef, known: _Known, on_node: bool, reported: bool) -> None:
        if known.read is not None and not known.read.done():
            return
        if time.monotonic() < known.read_at:
            return
        if not on_node and not await self.first_reads.may_read(ref, reported):
            return  # not needed here, and another agent reads (or read) the first digest
        known.read = asyncio.create_task(self._read(ref, known), name=f"read {ref.key}")

    async def _read(self, ref: agent.ModelRef, known: _Known) -> None:
        """In the background, one slot of ``reads``: the Secret, the source, its manifest."""
        async with self.reads:
            if self.known.get(ref.key) is not known:
                return  # the source changed while this read waited for a slot
            source: Source | None = None
            try:
                secret = await self._secret(ref)
                ca_bundle = await self._ca_bundle(ref)
                source = agent.open_source(ref.source, secret, f"Secret {ref.namespace}/{ref.secret_name}",
                                           policy=self.config.policy, limits=self.config.limits,
                                           ca_bundle=ca_bundle, default_chain=self.config.s3_default_credentials)
                known.manifest = await read_manifest(source, self.config.limits)
                known.source, known.error = source, None
                self.notices.clear(self.notices.model_object(ref), notices.REASON_READ_FAILED)
            except Exception as error:  # said in the entry and an Event; read again after the interval
                # A failure before the source opened is the spec's or the Secret's: no address was read.
                known.error = agent.failure_text(error) if source is None else said_of(error, source)
                known.read_at = time.monotonic() + self.config.interval_s
                agent_http.FILL_FAILURES.labels(ref.namespace, ref.name, NODE_AGENT_STAGE_MANIFEST).inc()
                log.warning("node agent: %s: %s", ref.key, agent.failure_text(error))
                await self.notices.warn(self.notices.model_object(ref), notices.REASON_READ_FAILED, known.error)
            finally:
                self.wake.set()  # report (and fill) at once

    async def _failed(self, ref: agent.ModelRef, error: Exception) -> None:
        """A WarmModel's part of the pass raised: its entry and an Event say so, the pass goes on."""
        text = agent.failure_text(error)
        log.warning("node agent: %s: %s", ref.key, text)
        await self.notices.warn(self.notices.model_object(ref), notices.REASON_READ_FAILED, text)
        known = self._known(ref)
        if known.error != text:
            known.error = text
            with contextlib.suppress(Exception):  # the API may be what failed: the next pass tries again
                await self._report(ref, known)

    async def _secret(self, ref: agent.ModelRef) -> dict[str, str] | None:
        """The s3 Secret's ``.data`` as the API returns it (base64 values), or None without a secretRef."""
        if ref.secret_name is None:
            return None
        return await self._secret_data(ref.namespace, ref.secret_name, "spec.model.s3.secretRef")

    async def _ca_bundle(self, ref: agent.ModelRef) -> str | None:
        """The PEM text spec.model.s3.caBundle names, or None without one."""
        named = ca_bundle_ref(ref.source)
        if named is None:
            return None
        data = await self._secret_data(ref.namespace, named[0], "spec.model.s3.caBundle")
        return ca_bundle_from_secret_data(data, named[1], f"Secret {ref.namespace}/{named[0]}")

    async def _secret_data(self, namespace: str, name: str, field: str) -> dict[str, str]:
        try:
            secret = await self.kube.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
        except KubeError as error:
            if error.status == 403:  # the chart's nodeAgent.secretNamespaces leaves this namespace out
                raise SourceError(f"the node agent may not read Secret {namespace}/{name} "
                                  f"({field}): let it read Secrets in this namespace (the chart's "
                                  "nodeAgent.secretNamespaces)") from None
            raise
        return dict(secret.get("data") or {})

    async def _report(self, ref: agent.ModelRef, known: _Known) -> None:
        entry: dict[str, Any] = {"node": self.config.node, "source": ref.fingerprint}
        if known.manifest is not None:
            m = known.manifest
            entry["revision"] = m.digest
            entry["bytesTotal"] = agent.unique_bytes(m)
            entry["bytesCached"] = await asyncio.to_thread(agent.cached_bytes, self.layout, m, ref.domain)
            entry["published"] = trust.granted(self.layout, m.digest_hex, ref.domain)
            path = await asyncio.to_thread(agent.revision_path, self.layout, m.digest_hex, ref.domain)
            if path is not None:
                entry["path"] = path
            if entry["published"]:  # by this fill or another agent's: an earlier failure is over
                known.fill_error = None
        message = known.error or known.fill_error
        if message is not None:
            entry["message"] = message
        if entry == known.last_entry:
            return
        last = known.last_entry or {}
        only_progress = {k: v for k, v in entry.items() if k != "bytesCached"} == {
            k: v for k, v in last.items() if k != "bytesCached"}
        if only_progress and time.monotonic() - known.last_write < self.config.progress_interval_s:
            return
        await self.kube.apply_cache_entry(ref.namespace, ref.name, entry)
        known.last_entry, known.last_write = entry, time.monotonic()

    async def _fill(self, ref: agent.ModelRef, known: _Known, manifest: Manifest) -> None:
        assert known.source is not None
        source = known.source  # what a failure names (known.source is dropped after one)
        name = lease_name(self.config.node, manifest.digest)
        lease = agent_lease(self.kube, self.config.lease_namespace, name, self.config.lease_duration_s,
                            self.fill_leases_seen.setdefault(name, Observed()))
        try:
            if trust.granted(self.layout, manifest.digest_hex, ref.domain):
                self.fill_leases_seen.pop(name, None)
                return
            if not await lease.try_acquire():
                return  # another agent fills it; a later pass finds it published (or the Lease expired)
            self.fill_leases_seen.pop(name, None)
            log.info("node agent: %s: filling %s (fill Lease %s version %s)", ref.key, manifest.digest,
                     lease.name, lease.version)
            heat = await self.kube.config_map_key(ref.namespace, f"{ref.name}{CONFIGMAP_SUFFIX}",
                                                  CONFIGMAP_KEY_HEATMAP)
            renewer = asyncio.create_task(keep_renewing(lease))
            loop = asyncio.get_running_loop()

            def fence() -> None:
                asyncio.run_coroutine_threadsafe(lease.renew(), loop).result(self.config.fence_timeout_s)

            try:
                partial = self.config.partial_view or ref.partial
                result = await asyncio.to_thread(fill_blocking, self.layout, known.source, manifest, heat, fence,
                                                 partial, self.config.lease_duration_s, ref.domain)
            finally:
                renewer.cancel()
            if result.bytes_fetched:
                self.downloads += 1
            agent_http.FILLS.labels(ref.namespace, ref.name).inc()
            self.notices.clear(self.notices.model_object(ref), notices.REASON_FILL_FAILED)
            log.info("node agent: %s: published %s (%d blocks, %d bytes fetched here)", ref.key, manifest.digest,
                     result.blocks_fetched, result.bytes_fetched)
        except LeaseLostError as error:
            log.warning("node agent: %s: fill fenced out, nothing published: %s", ref.key, error)
        except Exception as error:  # the pass goes on; the next one retries and the status says why
            known.fill_error = f"fill failed: {said_of(error, source)}"[:1000]
            agent_http.FILL_FAILURES.labels(ref.namespace, ref.name, NODE_AGENT_STAGE_BLOCKS).inc()
            # The wake below makes a pass at once; that pass must not start the same failing
            # fill again (a Lease write and a round of requests to the store, several a second).
            known.retry_at = time.monotonic() + self.config.interval_s
            # That pass opens the source again, from the Secret as it is then: credentials
            # rotated since the manifest was read would otherwise fail every fill until a restart.
            known.source = None
            log.warning("node agent: %s: fill failed: %s", ref.key, agent.failure_text(error))
            await self.notices.warn(self.notices.model_object(ref), notices.REASON_FILL_FAILED, known.fill_error)
        finally:
            if lease.version is not None:
                with contextlib.suppress(Exception):  # a release that fails leaves the Lease to expire
                    await lease.release()
            self.wake.set()  # report, label and pin at once

def said_of(error: BaseException, source: Source) -> str:
    """What a WarmModel's status and Events say of ``error``, met reading ``source``: the one
    text of every failed source (``source_errors``), whatever the source did; the agent's log
    keeps ``agent.failure_text(error)``.  A manifest or block that came back wrong still says so."""
    return unavailable_text(source.describe()) if isinstance(error, SourceError) else agent.failure_text(error)


async def run_agent(config: AgentConfig, stop: asyncio.Event | None = None) -> None:
    kube = await AgentKube.connect(config.node)
    started = time.monotonic()
    probes = None
    try:
        a = Agent(config, kube)
        agent_http.serve_metrics(config.bind, config.metrics_port)
        probes = await agent_http.serve_probes(config.bind, config.health_port, lambda: a.passes > 0)
        await a.run(stop or asyncio.Event())
    finally:
        if probes is not None:
            await probes.cleanup()
        await kube.close()
        log.info("node agent: stopped after %.0fs", time.monotonic() - started)
