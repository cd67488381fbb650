"""Trust domains of the node cache: a block one tenant's source never sent is not another tenant's to use.

A block's SHA-256 names its bytes but proves nothing about who may read them: a manifest listing
another tenant's block hashes, from a source that answers HEAD and never sends a byte, would
otherwise get a revision made of that tenant's bytes.  So every fill runs in a trust domain -- the
WarmModel's namespace (``layout.DEFAULT_DOMAIN`` for fills no namespace asked for) -- and:

* a block the store holds is used by a fill only when its domain fetched and verified those bytes
  itself before (its mark, ``domains/<domain>/blocks/<aa>/<sha256>``); any other block is fetched
  from the fill's own source and verified, and only then linked.  The store still keeps one copy
  (disk dedup across domains); the download is saved only inside a domain;
* a published revision is the domain's -- its link ``domains/<domain>/revisions/<hex>``, the only
  path its pods mount -- only once the domain verified every block of it (:func:`verify_published`
  fetches what it has not verified yet).

A mark or a link that outlives an eviction is harmless: it records that the domain's own source
sent bytes hashing to that digest, which does not stop being true (a revision's digest names every
block of it).  Eviction drops the marks of the blocks it frees all the same, to bound them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from warmpool_nodecache.blocks import BlockCorruptError, BlockStore, verify
from warmpool_nodecache.layout import CacheLayout, check_domain
from warmpool_nodecache.manifest import BlockRef, Manifest
from warmpool_nodecache.ordered_pool import OrderedPool
from warmpool_nodecache.partial import point_link
from warmpool_nodecache.source import Source


class DomainBlocks:
    """The blocks of the store one trust domain may use (see the module docstring)."""

    def __init__(self, store: BlockStore, domain: str) -> None:
        self.store, self.domain = store, check_domain(domain)

    @property
    def layout(self) -> CacheLayout:
        return self.store.layout

    def vouched(self, sha256: str) -> bool:
        return self.layout.vouched(sha256, self.domain).exists()

    def usable(self, sha256: str) -> bool:
        """In the store, and verified by this domain: a fill of this domain may link it unfetched."""
        return self.store.has(sha256) and self.vouched(sha256)

    def vouch(self, sha256: str) -> None:
        """This domain's source sent bytes that hash to `sha256` (call only after ``verify``).

        Not fsynced: a mark lost in a crash only costs a fetch."""
        mark = self.layout.vouched(sha256, self.domain)
        mark.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(mark, os.O_WRONLY | os.O_CREAT, 0o644))

    def unverified(self, manifest: Manifest) -> list[BlockRef]:
        """One ref of each distinct block of the revision this domain has not verified, in manifest order."""
        seen: set[str] = set()
        refs: list[BlockRef] = []
        for ref in manifest.block_refs():
            if ref.sha256 not in seen:
                seen.add(ref.sha256)
                if not self.vouched(ref.sha256):
                    refs.append(ref)
        return refs


def fetch_verified(source: Source, ref: BlockRef, attempts: int) -> bytes:
    """The block's bytes from `source`, checked against its SHA-256 (BlockCorruptError after
    `attempts` bad copies: the manifest or the source is wrong)."""
    for _ in range(attempts):
        data = source.fetch_range(ref.path, ref.offset, ref.length)
        try:
            verify(ref.sha256, data)
        except BlockCorruptError:
            continue
        return data
    raise BlockCorruptError(
        f"{source.describe()}/{ref.path}: block {ref.index} (bytes {ref.offset}+{ref.length}) never matched "
        f"the manifest's SHA-256 in {attempts} fetches; the manifest or the source is wrong")


def verify_published(blocks: DomainBlocks, source: Source, manifest: Manifest, *, attempts: int,
                     workers: int) -> tuple[int, int]:
    """Fetch and verify every block of the revision this domain has not verified yet, marking each;
    (blocks, bytes) fetched.  Nothing in the store changes: the revision is published already."""
    fetched = nbytes = 0

    def check(ref: BlockRef) -> int:
        fetch_verified(source, ref, attempts)
        blocks.vouch(ref.sha256)
        return ref.length

    with OrderedPool(check, workers=workers) as pool:
        for _, length in pool.results(blocks.unverified(manifest)):
            fetched, nbytes = fetched + 1, nbytes + length
    return fetched, nbytes


def granted(layout: CacheLayout, digest_hex: str, domain: str) -> bool:
    """Whether the revision is published and the domain verified it (its pods may mount it)."""
    return layout.granted_link(digest_hex, domain).is_dir()


def grant(layout: CacheLayout, digest_hex: str, domain: str, partial: bool) -> None:
    """The domain's link to the published revision (and its partial link too, for pods started on it)."""
    final = layout.revision(digest_hex)
    point_link(layout.granted_link(digest_hex, domain), final)
    if partial:
        point_link(layout.partial_link(digest_hex, domain), final)


def forget(layout: CacheLayout, shas: Iterable[str], digests: Iterable[str] = ()) -> None:
    """Every domain's marks of these blocks and links to these revisions (eviction freed them)."""
    if not layout.domains.is_dir():
        return
    shas, digests = list(shas), list(digests)
    for home in layout.domains.iterdir():
        try:
            domain = check_domain(home.name)
        except ValueError:
            continue  # not a domain's directory: nothing of ours to drop
        paths: list[Path] = [layout.vouched(sha, domain) for sha in shas]
        paths += [link for d in digests for link in (layout.granted_link(d, domain), layout.partial_link(d, domain))]
        for path in paths:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                path.unlink()
