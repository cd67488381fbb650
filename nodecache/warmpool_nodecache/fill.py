"""Filling one revision into the cache: hottest blocks first, resumable, one download however many race.

1. The manifest comes from the source and is validated; every file's size is checked at the
   source (HEAD) before the cache is touched, so a manifest that lies about sizes, or names a
   file the source lacks, fails with the cache exactly as it was.
2. A published revision is returned at once -- once the fill's trust domain verified every block of
   it (``trust.py``: a domain that has not fetches each block it has not verified from its own
   source first, and only then gets its link to the revision).
3. The fill lease serialises fillers: the one holding it downloads; the others wait, bounded,
   for the revision to be published -- or for the lease to expire (its holder died), and then
   take it over with a higher version.
4. The holder fetches each missing block in the given order (blocks the store holds are skipped
   when its trust domain verified them before, and fetched like any other when not: a block
   digest is not a capability), verifies it on arrival (a corrupt block is fetched again, a
   bounded number of times), writes it into the revision's files in a staging directory, and
   publishes it by renaming it to ``revisions/<digest>`` under the lease's fence.

The fetches overlap (``ordered_pool.OrderedPool``): ``fetch_workers`` threads each fetch, verify
and write one block into the revision's files (``partial.PartialView.write``) -- the only copy of
its bytes the fill writes: there is no block file beside it (``blocks.py``) -- at most
``2 x fetch_workers`` blocks ahead of the one the fill takes next, so memory stays at
``2 x fetch_workers x block size`` of fetched bytes at most.  The fill takes the fetched blocks in
its order (hot-first) and commits them in batches in a commit thread beside the fetches
(``commits.BlockCommits`` -> ``PartialView.place``: fdatasync of the files the batch wrote to,
then the batch appended to the fill's journal and fsynced, ``journal.py``) -- every
``sync_batch_blocks`` blocks, whenever it would otherwise wait for the network, and always,
waited for, before publishing.  So a block is journaled only once verified *and* durable, and the
revision is published only after every block it needs is durable.  A crash (SIGKILL or power)
loses at most the blocks written since the last commit: the next holder of the lease takes the
view over with its journal (``PartialView.create(resume_from=...)``) and fetches the rest.  A
failure other than a corrupt block (the lease lost, the source down) first commits the blocks
already verified and leaves the view to resume from; a corrupt block discards the view (the
revision is wrong).  Both sources are safe to call from several threads: ``HttpSource`` opens a
connection per request and shares nothing mutable; ``S3Source`` shares one boto3 client, which
boto3 documents as thread-safe (its pool holds 10 connections, above the most workers allowed).

Blocks the store already holds -- a published revision's files, or a block file the node agent
fetched for a header -- are cloned into the view where the filesystem shares extents, else copied
(``copy_file_range``).  With ``FillOptions.partial_view`` a progress record inside the view lists
the committed blocks, so a worker can start on the partial revision and fault in the rest;
publishing is the same rename of the whole directory (the same inodes).

Costs, measured (the 0.98 GB synthetic model from loopback SeaweedFS, 2 vCPUs, ext4 without
reflink; ``bench/results/cache.md``): per byte the fill receives, hashes and writes once (the
revision's files) and fdatasyncs it, where boto3's ``download_file`` receives and writes once,
unsynced.  Before the fill wrote each byte twice (a block file and the revision's file).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from warmpool.contract.files import MANIFEST_FILENAME
from warmpool_nodecache.blocks import BlockCorruptError, BlockStore, fsync_dir, verify
from warmpool_nodecache.commits import BlockCommits
from warmpool_nodecache.eviction_lock import gc_lock
from warmpool_nodecache.file_lease import FileLease
from warmpool_nodecache.layout import DEFAULT_DOMAIN, CacheLayout, check_domain
from warmpool_nodecache.manifest import BlockRef, Manifest, ManifestError, parse_manifest
from warmpool_nodecache.order import BlockOrder
from warmpool_nodecache.ordered_pool import OrderedPool
from warmpool_nodecache.partial import PartialView, point_link, remove_views, resumable_view
from warmpool_nodecache.source import Source
from warmpool_nodecache.trust import DomainBlocks, grant, granted, verify_published
from warmpool_nodecache.use import record_use


class FillTimeoutError(TimeoutError):
    """Another filler held the revision's lease past the wait bound without publishing."""


#: boto3's default connection pool holds 10; more threads than that would only queue for a connection.
MAX_FETCH_WORKERS = 8


@dataclass(frozen=True)
class FillOptions:
    lease_ttl_s: float = 60.0
    wait_timeout_s: float = 900.0  # how long a filler waits for another's fill to publish
    poll_s: float = 0.05
    block_attempts: int = 3  # fetches of one block before its bytes are judged wrong at the source
    #: An outer lease's check (the node agent's coordination.k8s.io Lease): called whenever the
    #: file lease is renewed and just before publishing; it raises LeaseLostError once that lease
    #: is lost, so a writer fenced out there neither goes on downloading nor publishes.
    fence: Callable[[], None] | None = None
    #: Blocks fetched at once (memory: ``2 x`` this many blocks of fetched bytes at most).  On the
    #: 2-vCPU dev VM against loopback SeaweedFS, once the fetch threads also wrote the revision's
    #: files (load 1.6-3), 4/6/8 gave 190-297/293-303/260-318 MiB/s over 0.98 GB: 6 was never the
    #: slowest and varied least; 8 gained nothing on 2 cores (the fill is CPU-bound there).
    fetch_workers: int = 6
    #: Verified blocks staged before they are made durable and visible together (x block size
    #: of unsynced bytes at most); a batch is also committed whenever the fill waits for a fetch.
    sync_batch_blocks: int = 32
    #: Lay the revision out in staging and write each block in as it is committed, with a progress
    #: record a worker started on the partial view waits on (``partial.py``).
    partial_view: bool = False
    #: The trust domain the fill runs in (the WarmModel's namespace; ``trust.py``): blocks it did
    #: not fetch are linked only when this domain verified them before.
    domain: str = DEFAULT_DOMAIN

    def check(self) -> None:
        """ValueError naming the option that is out of bounds."""
        check_domain(self.domain)
        if not 1 <= self.fetch_workers <= MAX_FETCH_WORKERS:
            raise ValueError(f"FillOptions.fetch_workers must be 1..{MAX_FETCH_WORKERS}, got {self.fetch_workers}")
        if self.sync_batch_blocks < 1:
            raise ValueError(f"FillOptions.sync_batch_blocks must be >= 1, got {self.sync_batch_blocks}")
        if self.block_attempts < 1:
            raise ValueError(f"FillOptions.block_attempts must be >= 1, got {self.block_attempts}")


@dataclass(frozen=True)
class FillResult:
    digest: str
    path: Path
    blocks_fetched: int
    bytes_fetched: int
    filled_here: bool  # False: another filler (or an earlier fill) published it
    methods: tuple[str, ...] = ()  # how each file was materialised, in manifest order


def _ordered(manifest: Manifest, order: BlockOrder | None) -> list[BlockRef]:
    refs = list(manifest.block_refs())
    if order is None:
        return refs
    first = list(order(manifest))
    chosen = {(r.path, r.index) for r in first}
    return first + [r for r in refs if (r.path, r.index) not in chosen]


def _check_sizes(manifest: Manifest, source: Source) -> None:
    for f in manifest.files:
        # The source's own figure stays out of the message (it may reach a status): the
        # manifest's, which its author wrote, says enough to find the file.
        if source.size(f.path) != f.size:
            raise ManifestError(
                f"{source.describe()}: the manifest says {f.path!r} has {f.size} bytes, the source has "
                "another size"
            )


def _fetch_block(blocks: DomainBlocks, source: Source, ref: BlockRef, attempts: int, view: PartialView) -> None:
    """Fetch and verify one block, mark it verified by the fill's domain and write it into the view
    (in a pool thread); BlockCorruptError after `attempts` bad copies."""
    for attempt in range(1, attempts + 1):
        data = source.fetch_range(ref.path, ref.offset, ref.length)
        try:
            verify(ref.sha256, data)
        except BlockCorruptError:
            if attempt == attempts:
                raise BlockCorruptError(
                    f"{source.describe()}/{ref.path}: block {ref.index} (bytes {ref.offset}+{ref.length}) "
                    f"never matched the manifest's SHA-256 in {attempts} fetches; the manifest or the "
                    "source is wrong"
                ) from None
            continue
        blocks.vouch(ref.sha256)
        view.write(ref.sha256, data)  # verified: its only copy, in the revision's files
        return
    raise AssertionError("unreachable")


def _missing(blocks: DomainBlocks, view: PartialView, manifest: Manifest, order: BlockOrder | None,
             ) -> Iterator[BlockRef]:
    """The blocks to fetch, in order, each once; checked lazily, as the pool takes them."""
    seen: set[str] = set()
    for ref in _ordered(manifest, order):
        if ref.sha256 not in seen:
            seen.add(ref.sha256)
            if not (view.has(ref.sha256) or blocks.usable(ref.sha256)):
                yield ref


def _write_manifest(layout: CacheLayout, manifest: Manifest) -> None:
    layout.manifests.mkdir(parents=True, exist_ok=True)
    final = layout.manifest(manifest.digest_hex)
    tmp = final.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(manifest.to_text())
    os.rename(tmp, final)


def _roll_back(layout: CacheLayout, manifest: Manifest) -> None:
    """Undo a fill of a bad revision: its manifest (the view and its journal go with ``discard``)."""
    with contextlib.suppress(FileNotFoundError):
        layout.manifest(manifest.digest_hex).unlink()


def _fill_holding_lease(
    layout: CacheLayout, source: Source, manifest: Manifest, lease: FileLease, order: BlockOrder | None,
    options: FillOptions,
) -> FillResult:
    store = BlockStore(layout)
    blocks = DomainBlocks(store, options.domain)
    final = layout.revision(manifest.digest_hex)
    assert lease.version is not None
    with gc_lock(layout, exclusive=False, timeout_s=options.wait_timeout_s):
        _write_manifest(layout, manifest)
        layout.staging.mkdir(parents=True, exist_ok=True)
        earlier = resumable_view(layout.staging, manifest.digest_hex)  # a holder's that died or failed midway
        remove_views(layout.staging, manifest.digest_hex, keep=earlier)
        staging = layout.staging / f"{manifest.digest_hex}.{lease.version}"
        view = PartialView(store, manifest, staging,
                           layout.partial_link(manifest.digest_hex, options.domain) if options.partial_view else None,
                           usable=blocks.usable, vouched=blocks.vouched)
        batch = BlockCommits(view.place, options.sync_batch_blocks)
        last_renew = time.monotonic()

        def keep_lease() -> None:
            nonlocal last_renew
            if time.monotonic() - last_renew > options.lease_ttl_s / 3:
                lease.renew()
                if options.fence is not None:
                    options.fence()
                last_renew = time.monotonic()

        def idle() -> None:  # the next block is still on its way: start making the fetched ones durable
            keep_lease()
            batch.submit()

        def fetch(ref: BlockRef) -> None:
            _fetch_block(blocks, source, ref, options.block_attempts, view)

        try:
            view.create(resume_from=earlier)
            with OrderedPool(fetch, workers=options.fetch_workers) as pool:
                for ref, _ in pool.results(_missing(blocks, view, manifest, order), idle=idle):
                    batch.add(ref)
                    keep_lease()
            batch.finish()  # the durability point: every block is on disk, and journaled, before publishing
            methods = view.finish()
            fsync_dir(staging)
            layout.revisions.mkdir(parents=True, exist_ok=True)
            if options.fence is not None:
                options.fence()
            lease.publish(staging, final)
        except BlockCorruptError as exc:
            with contextlib.suppress(OSError):
                batch.finish(commit_pending=False)  # the commits under way end before the view goes
            view.failed(exc)  # before the view goes: a worker waiting on it learns why
            view.discard()
            _roll_back(layout, manifest)
            raise
        except BaseException as exc:
            # The pool's threads have ended (its exit waits): the verified blocks fetched so far are
            # committed -- durable and journaled in the view, which stays -- so a later fill resumes
            # from them; a failing commit loses only those.
            with contextlib.suppress(OSError):
                batch.finish()
            view.failed(exc)
            raise
        finally:
            batch.close()
        with contextlib.suppress(OSError):  # published already: the record is for waiting readers
            view.published(final)
        grant(layout, manifest.digest_hex, options.domain, options.partial_view)
    record_use(layout, manifest.digest_hex)
    return FillResult(manifest.digest, final, len(batch.stored), batch.bytes, True, methods)


def _already_published(layout: CacheLayout, source: Source, manifest: Manifest, options: FillOptions) -> FillResult:
    """Published (by this domain or another): the domain's link to it, once the domain verified every
    block of it -- fetching from its own source what it has not (``trust.verify_published``)."""
    final = layout.revision(manifest.digest_hex)
    fetched = nbytes = 0
    if not granted(layout, manifest.digest_hex, options.domain):
        with gc_lock(layout, exclusive=False, timeout_s=options.wait_timeout_s):
            # Under the shared lock, so eviction (exclusive) cannot take the revision meanwhile.
            fetched, nbytes = verify_published(DomainBlocks(BlockStore(layout), options.domain), source, manifest,
                                               attempts=options.block_attempts, workers=options.fetch_workers)
            if options.fence is not None:
                options.fence()  # a holder fenced out of its outer lease links nothing
            grant(layout, manifest.digest_hex, options.domain, options.partial_view)
    elif options.partial_view:  # a worker pointed at the fixed partial name finds the revision there
        point_link(layout.partial_link(manifest.digest_hex, options.domain), final)
    record_use(layout, manifest.digest_hex)
    return FillResult(manifest.digest, final, fetched, nbytes, False)


def fill_revision(
    layout: CacheLayout, source: Source, *, order: BlockOrder | None = None, options: FillOptions | None = None
) -> FillResult:
    """Make the source's revision published in the cache (see the module's docstring for how)."""
    options = options or FillOptions()
    options.check()
    manifest_url = f"{source.describe()}/{MANIFEST_FILENAME}"
    manifest = parse_manifest(source.fetch_manifest(), manifest_url)
    final = layout.revision(manifest.digest_hex)
    if final.is_dir():
        return _already_published(layout, source, manifest, options)
    if order is not None:
        order(manifest)  # an order naming unknown files is an error before anything is fetched
    _check_sizes(manifest, source)
    lease = FileLease(layout.leases, manifest.digest_hex, options.lease_ttl_s)
    deadline = time.monotonic() + options.wait_timeout_s
    while not lease.try_acquire():
        if final.is_dir():
            return _already_published(layout, source, manifest, options)
        if time.monotonic() >= deadline:
            held = lease.read()
            raise FillTimeoutError(
                f"revision {manifest.digest}: another filler ({held.holder if held else '?'}) did not publish "
                f"within {options.wait_timeout_s}s"
            )
        time.sleep(options.poll_s)
    try:
        if final.is_dir():  # published between our check and our lease
            return _already_published(layout, source, manifest, options)
        return _fill_holding_lease(layout, source, manifest, lease, order, options)
    finally:
        lease.release()
