"""The content-addressed block store: where a verified copy of each block lives, found by its SHA-256.

A block is held in one of two places, and a fill writes each byte it downloads to disk once:

* inside a published revision's file (``revisions/<digest>/<path>`` at the block's offset, as its
  cached manifest lists it).  A fill writes every block it fetches straight into the revision's
  files (``partial.PartialView``); published, those files are the blocks' only copy on disk, and
  another revision that shares a block copies (or, where the filesystem shares extents, clones)
  it from there.  Published files are sealed (read-only, fsynced) and never written again: their
  bytes stay the verified ones until eviction removes the whole revision, which no fill can
  meet (fills hold the cache-wide lock shared, eviction exclusive);
* a block file ``blocks/<aa>/<sha256>`` (``put``): the header blocks the node agent fetches
  before a fill to learn the fill's order.  Written to a temporary file in its shard, fsynced,
  checked against its hash and renamed into place, so a block file that exists is always whole
  and correct.  Read-only; a revision's file never shares its inode (no hard links): a copy or
  a clone, so neither path can change the other's bytes.

Neither place says who may use a block: ``trust.DomainBlocks`` adds that.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import ManifestError, parse_manifest


class BlockCorruptError(ValueError):
    """Bytes that do not hash to the block they were fetched as."""


def fsync_dir(path: os.PathLike[str] | str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(sha256: str, data: bytes) -> None:
    # The message never carries what the bytes did hash to, nor their length: a source that
    # a WarmModel names could otherwise read any endpoint back through the status, a hash at a time.
    if hashlib.sha256(data).hexdigest() != sha256:
        raise BlockCorruptError(f"block {sha256}: the bytes fetched do not hash to it")


@dataclass(frozen=True)
class Place:
    """Where a held block's bytes are: ``length`` bytes of ``path`` from ``offset``."""

    path: Path
    offset: int
    length: int


class BlockStore:
    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self._lock = threading.Lock()
        self._published: tuple[str, ...] | None = None
        self._in_revisions: dict[str, Place] = {}

    def has(self, sha256: str) -> bool:
        return self.locate(sha256) is not None

    def locate(self, sha256: str) -> Place | None:
        """Where the store holds the block's verified bytes, or None."""
        block = self.layout.block(sha256)
        try:
            return Place(block, 0, block.stat().st_size)
        except FileNotFoundError:
            return self._revision_blocks().get(sha256)

    def read(self, sha256: str) -> bytes:
        """The held block's bytes (FileNotFoundError naming it when the store does not hold it)."""
        place = self.locate(sha256)
        if place is None:
            raise FileNotFoundError(f"block {sha256} is not in the cache at {self.layout.root}")
        fd = os.open(place.path, os.O_RDONLY)
        try:
            return os.pread(fd, place.length, place.offset)
        finally:
            os.close(fd)

    def _revision_blocks(self) -> dict[str, Place]:
        """Every block of the published revisions, by SHA-256; read again when the set of revisions changed."""
        try:
            published = tuple(sorted(p.name for p in self.layout.revisions.iterdir() if p.is_dir()))
        except FileNotFoundError:
            published = ()
        with self._lock:
            if published != self._published:
                index: dict[str, Place] = {}
                for digest_hex in published:
                    try:
                        manifest = parse_manifest(self.layout.manifest(digest_hex).read_bytes())
                    except (OSError, ManifestError):
                        continue  # its blocks are fetched again; the revision itself stays whole
                    if manifest.digest_hex != digest_hex:
                        continue
                    for ref in manifest.block_refs():
                        index.setdefault(ref.sha256, Place(self.layout.revision(digest_hex) / ref.path, ref.offset,
                                                           ref.length))
                self._published, self._in_revisions = published, index
            return self._in_revisions

    def put(self, sha256: str, data: bytes) -> bool:
        """Store `data` as block `sha256`; False if it was already there. BlockCorruptError if it does not hash so."""
        verify(sha256, data)
        final = self.layout.block(sha256)
        if final.is_file():
            return False
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o444)
            os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        fsync_dir(final.parent)
        return True

    def remove(self, sha256: str) -> int:
        """Delete a block; the bytes freed (0 if it was absent)."""
        path = self.layout.block(sha256)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        return size

    def all_blocks(self) -> set[str]:
        """The block files (what eviction frees); blocks inside revisions go with their revision."""
        if not self.layout.blocks.is_dir():
            return set()
        return {p.name for shard in self.layout.blocks.iterdir() if shard.is_dir() for p in shard.iterdir()
                if not p.name.startswith(".tmp-")}
