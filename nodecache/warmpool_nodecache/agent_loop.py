"""The node agent's loop: keep this node's cache in step with the WarmModels that need it.

A pass runs when a watched WarmModel or a worker pod on this node changes, when a fill ends, and
at least every ``interval`` seconds (passes are level-based: a missed event is caught by the next):

1. WarmModels with an http/s3 source are listed (all namespaces, or one); each one's manifest
   is read once per source (its digest names the revision) and this node's entry in the
   WarmModel's ``status.cacheNodes`` is applied -- digest, bytes cached / total, published --
   so the operator can build pods for the revision and show per-node progress.  The entry is
   written as this node's own field manager (server-side apply), never the operator's.
2. For each such WarmModel with a worker pod bound to this node and the revision not yet
   published here, a fill starts (one per revision at a time): under the (node, revision)
   ``coordination.k8s.io`` Lease, the headers' blocks first, then layers hottest first from the
   heat map in the WarmModel's ConfigMap; an agent that loses the Lease race tries again on a
   later pass and finds the revision published.  A fill killed midway resumes from the blocks
   already stored once the Lease expires.
3. The node's labels are made to say which revisions it holds; revisions wanted by pods here
   are pinned, and with a budget the cache is evicted (LRU-2) down to it, never a pinned or
   mapped revision.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmpool import contract
from warmpool_nodecache import agent
from warmpool_nodecache.agent_kube import AgentKube, FillLease, KubeError
from warmpool_nodecache.blocks import BlockStore
from warmpool_nodecache.evict import evict
from warmpool_nodecache.fill import FillOptions, FillResult, fill_revision
from warmpool_nodecache.gclock import CacheBusyError, gc_lock
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.lease import LeaseLostError
from warmpool_nodecache.manifest import Manifest, ManifestError, parse_manifest
from warmpool_nodecache.partial import point_link
from warmpool_nodecache.source import Source, SourceError
from warmpool_nodecache.use import RevisionNotCachedError, pinned

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
    #: ``<cache root>/partial/<digest hex>`` can start before the publish.
    partial_view: bool = False


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


@dataclass
class Agent:
    config: AgentConfig
    kube: AgentKube
    known: dict[str, _Known] = field(default_factory=dict)
    pins: dict[str, contextlib.ExitStack] = field(default_factory=dict)
    downloads: int = 0  # fills this process ran that fetched bytes (reported in the log)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    async def _watch(self, path: str, query: Mapping[str, str]) -> None:
        """Wake the loop on every change of the watched objects; watch again when the server ends it."""
        while True:
            try:
                async for _ in self.kube.watch_events(path, query):
                    self.wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the interval still drives passes; watch again shortly
                log.info("node agent: watch of %s ended (%s: %s)", path, type(error).__name__, error)
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
        while not stop.is_set():
            self.wake.clear()
            try:
                await self.tick()
            except Exception as error:  # one bad pass (API down, cache busy) must not end the agent
                log.warning("node agent: pass failed (%s: %s); trying again", type(error).__name__, error)
            # The next pass: when a watched object changes or a fill ends, else after the interval.
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.wake.wait())]
            await asyncio.wait(waits, timeout=self.config.interval_s, return_when=asyncio.FIRST_COMPLETED)
            for waiting in waits:
                waiting.cancel()
            await asyncio.sleep(min(0.2, self.config.interval_s))  # a burst of events makes one pass
        for watcher in watchers:
            watcher.cancel()
        for known in self.known.values():
            if known.fill is not None:
                known.fill.cancel()
        for stack in self.pins.values():
            stack.close()

    async def tick(self) -> None:
        refs = [r for r in map(agent.model_ref, await self.kube.warmmodels(self.config.namespace)) if r is not None]
        here = {(str(meta.get("namespace")), str((meta.get("labels") or {}).get(contract.LABEL_MODEL)))
                for meta in (p.get("metadata") or {} for p in await self.kube.pods_here(self.config.namespace))}
        wanted: set[str] = set()
        for ref in refs:
            known = self.known.get(ref.key)
            if known is None or known.fingerprint != ref.fingerprint:
                known = self.known[ref.key] = _Known(ref.fingerprint)
            if known.manifest is None or known.source is None:
                await self._read_manifest(ref, known)
            manifest = known.manifest
            if manifest is not None and known.source is not None and (ref.namespace, ref.name) in here:
                wanted.add(manifest.digest_hex)
                busy = known.fill is not None and not known.fill.done()
                retry = time.monotonic() >= known.retry_at
                published = self.layout.revision(manifest.digest_hex)
                if not published.is_dir() and not busy and retry:
                    known.fill = asyncio.create_task(self._fill(ref, known, manifest), name=f"fill {ref.key}")
                elif ref.partial and published.is_dir() and not busy:
                    # Published without a partial view (before startOnPartialCache was set, or by a
                    # fill that did not make one): pods started on partial/<hex> find it there too.
                    link = self.layout.partial_link(manifest.digest_hex)
                    if not link.is_dir():
                        point_link(link, published)
            await self._report(ref, known)
        for key in set(self.known) - {r.key for r in refs}:
            gone = self.known.pop(key)
            if gone.fill is not None:
                gone.fill.cancel()
        self._pin(wanted)
        await self._label()
        filling = any(k.fill is not None and not k.fill.done() for k in self.known.values())
        if self.config.budget_bytes is not None and not filling:  # eviction would wait for the fill
            try:
                result = await asyncio.to_thread(evict, self.layout, self.config.budget_bytes, lock_timeout_s=1.0,
                                                 keep=frozenset(wanted))
            except CacheBusyError as error:  # another process's fill: evict on a later pass
                log.info("node agent: eviction deferred: %s", error)
                return
            if result.evicted:
                log.info("node agent: evicted %s (cache %d -> %d bytes)", result.evicted, result.bytes_before,
                         result.bytes_after)
                await self._label()

    async def _read_manifest(self, ref: agent.ModelRef, known: _Known) -> None:
        try:
            secret = await self._secret(ref)
            source = agent.open_source(ref.source, secret, f"Secret {ref.namespace}/{ref.secret_name}")
            text = await asyncio.to_thread(source.fetch_manifest)
            known.manifest = parse_manifest(text, f"{source.describe()}/{contract.MANIFEST_FILENAME}")
            known.source, known.error = source, None
        except (SourceError, ManifestError, KubeError, OSError) as error:
            known.error = str(error)[:1000]
            log.warning("node agent: %s: %s", ref.key, known.error)

    async def _secret(self, ref: agent.ModelRef) -> dict[str, str] | None:
        """The s3 Secret's ``.data`` as the API returns it (base64 values), or None without a secretRef."""
        if ref.secret_name is None:
            return None
        secret = await self.kube.request("GET", f"/api/v1/namespaces/{ref.namespace}/secrets/{ref.secret_name}")
        return dict(secret.get("data") or {})

    async def _report(self, ref: agent.ModelRef, known: _Known) -> None:
        entry: dict[str, Any] = {"node": self.config.node, "source": ref.fingerprint}
        if known.manifest is not None:
            m = known.manifest
            entry["revision"] = m.digest
            entry["bytesTotal"] = agent.unique_bytes(m)
            entry["bytesCached"] = await asyncio.to_thread(agent.cached_bytes, self.layout, m)
            entry["published"] = self.layout.revision(m.digest_hex).is_dir()
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
        lease = FillLease(self.kube, self.config.lease_namespace, self.config.node, manifest.digest,
                          self.config.lease_duration_s)
        try:
            if self.layout.revision(manifest.digest_hex).is_dir() or not await lease.try_acquire():
                return  # another agent fills it; a later pass finds it published (or the Lease expired)
            log.info("node agent: %s: filling %s (fill Lease %s version %s)", ref.key, manifest.digest,
                     lease.name, lease.version)
            heat = await self.kube.config_map_key(ref.namespace, f"{ref.name}{contract.CONFIGMAP_SUFFIX}",
                                                  contract.CONFIGMAP_KEY_HEATMAP)
            renewer = asyncio.create_task(self._keep_renewing(lease))
            loop = asyncio.get_running_loop()

            def fence() -> None:
                asyncio.run_coroutine_threadsafe(lease.renew(), loop).result(self.config.fence_timeout_s)

            try:
                partial = self.config.partial_view or ref.partial
                result = await asyncio.to_thread(self._fill_blocking, known.source, manifest, heat, fence, partial)
            finally:
                renewer.cancel()
            if result.bytes_fetched:
                self.downloads += 1
            log.info("node agent: %s: published %s (%d blocks, %d bytes fetched here)", ref.key, manifest.digest,
                     result.blocks_fetched, result.bytes_fetched)
        except LeaseLostError as error:
            log.warning("node agent: %s: fill fenced out, nothing published: %s", ref.key, error)
        except Exception as error:  # the pass goes on; the next one retries and the status says why
            known.fill_error = f"fill failed: {error}"[:1000]
            # The wake below makes a pass at once; that pass must not start the same failing
            # fill again (a Lease write and a round of requests to the store, several a second).
            known.retry_at = time.monotonic() + self.config.interval_s
            # That pass opens the source again, from the Secret as it is then: credentials
            # rotated since the manifest was read would otherwise fail every fill until a restart.
            known.source = None
            log.warning("node agent: %s: %s", ref.key, known.fill_error)
        finally:
            await lease.release()
            self.wake.set()  # report, label and pin at once

    async def _keep_renewing(self, lease: FillLease) -> None:
        while True:
            await asyncio.sleep(lease.duration_s / 3)
            try:
                await lease.renew()
            except LeaseLostError:
                return  # the fence refuses the next block and the publish
            except (KubeError, OSError, TimeoutError) as error:
                log.warning("node agent: renewing %s failed (%s); retrying", lease.name, error)

    def _fill_blocking(self, source: Source, manifest: Manifest, heat: str | None, fence: Any,
                       partial: bool) -> FillResult:
        """In a thread: the header blocks, then the fill in heat order, published under both leases."""
        store = BlockStore(self.layout)
        headers: dict[str, Mapping[str, Any]] = {}
        header_blocks = header_bytes = 0
        options = FillOptions(lease_ttl_s=self.config.lease_duration_s, fence=fence,
                              partial_view=partial)
        # Shared, like the fill's own: an eviction meanwhile would free the header blocks (no
        # manifest names them yet) and the fill would fetch them a second time.
        with gc_lock(self.layout, exclusive=False, timeout_s=options.wait_timeout_s):
            for ref in agent.header_blocks(manifest):
                if not store.has(ref.sha256) and store.put(ref.sha256, source.fetch_range(ref.path, ref.offset,
                                                                                         ref.length)):
                    header_blocks, header_bytes = header_blocks + 1, header_bytes + ref.length
                header = agent.safetensors_header(self.layout.block(ref.sha256).read_bytes(), ref.path)
                if header is not None:
                    headers[ref.path] = header
            order = (agent.start_order if partial else agent.heat_order)(manifest, headers, heat)
            result = fill_revision(self.layout, source, order=order, options=options)
        # The header blocks came over the wire too: "fetched here" counts them (a checkpoint of
        # one block per file was reported as 0 bytes fetched, and not as a download).
        return dataclasses.replace(result, blocks_fetched=result.blocks_fetched + header_blocks,
                                   bytes_fetched=result.bytes_fetched + header_bytes)

    def _pin(self, wanted: set[str]) -> None:
        """Hold a pin on each revision a pod here needs, so eviction spares it before it is mapped."""
        for digest in set(self.pins) - wanted:
            self.pins.pop(digest).close()
        for digest in wanted - set(self.pins):
            stack = contextlib.ExitStack()
            try:
                stack.enter_context(pinned(self.layout, digest))
            except RevisionNotCachedError:
                continue  # not published yet: pinned on a later pass
            self.pins[digest] = stack

    async def _label(self) -> None:
        labels = await self.kube.node_labels()
        patch = agent.label_changes(labels, agent.published_digests(self.layout))
        if patch:
            await self.kube.patch_node_labels(patch)
            log.info("node agent: node %s labels %s", self.config.node, patch)


async def run_agent(config: AgentConfig, stop: asyncio.Event | None = None) -> None:
    kube = await AgentKube.connect(config.node)
    started = time.monotonic()
    try:
        a = Agent(config, kube)
        await a.run(stop or asyncio.Event())
    finally:
        await kube.close()
        log.info("node agent: stopped after %.0fs", time.monotonic() - started)
