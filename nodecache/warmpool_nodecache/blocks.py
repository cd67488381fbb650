"""The content-addressed block store: each block stored once under its SHA-256, shared by every revision.

A block is written to a temporary file in its shard, fsynced, checked against its hash and
renamed into place, so a block file that exists is always whole and correct (a crash leaves
at most a temporary file, which the next write of that block replaces).  Block files are
read-only: a single-block model file may be a hard link to its block, and nothing may write
through it.

A fill stores many blocks at once with ``stage`` + ``commit`` instead of ``put``: each block
is verified and written, without fsync, to a private staging directory (its fetch thread does
this, in parallel with the others); ``commit`` then makes a batch durable -- fsync of every
file, then the renames into the shards, then an fsync of each shard touched -- so the same
invariant holds for a crash of the process *and* of the machine: a name under ``blocks/``
only ever points at bytes that were verified and on disk before the name existed.  A crash
before the commit leaves staged files only, which the next holder of the fill's lease removes
with the rest of the fill's staging.  One fsync per block remains, but in batches, issued in
parallel (the journal commits of concurrent fsyncs are shared) and off the fetch path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from warmpool_nodecache.layout import CacheLayout


class BlockCorruptError(ValueError):
    """Bytes that do not hash to the block they were fetched as."""


def fsync_dir(path: os.PathLike[str] | str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: os.PathLike[str] | str) -> None:
    fd = os.open(path, os.O_RDONLY)  # fsync through a read-only descriptor flushes the file's data too
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(sha256: str, data: bytes) -> None:
    # The message never carries what the bytes did hash to, nor their length: a source that
    # a WarmModel names could otherwise read any endpoint back through the status, a hash at a time.
    if hashlib.sha256(data).hexdigest() != sha256:
        raise BlockCorruptError(f"block {sha256}: the bytes fetched do not hash to it")


class BlockStore:
    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout

    def has(self, sha256: str) -> bool:
        return self.layout.block(sha256).is_file()

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

    def stage(self, sha256: str, data: bytes, directory: Path) -> Path:
        """Verify `data` as block `sha256` and write it, read-only and not yet fsynced, as `directory/sha256`.

        Nothing under ``blocks/`` changes: ``commit`` makes it durable and visible.  Safe to call
        from several threads for different blocks (each writes its own file)."""
        verify(sha256, data)
        path = directory / sha256
        # Created read-only: the descriptor that created it may still write (POSIX), nobody else can.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        try:
            with os.fdopen(fd, "wb", closefd=True) as fh:
                fh.write(data)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise
        return path

    def commit(self, staged: Sequence[tuple[str, Path]], fsync_threads: int = 8) -> list[str]:
        """Make staged blocks durable, then visible; the blocks stored (those not already there).

        Order is what makes it crash-safe: (1) every staged file's bytes are fsynced, (2) only then
        is each renamed to its name under ``blocks/`` (atomic), (3) the shards (and ``blocks/``
        when a shard was made) are fsynced so the names survive a power cut too.  A crash between
        (1) and (3) leaves each block either at its name, whole, or in staging."""
        if not staged:
            return []
        if len(staged) == 1 or fsync_threads <= 1:
            for _, path in staged:
                fsync_file(path)
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(fsync_threads, len(staged))) as pool:
                list(pool.map(fsync_file, [path for _, path in staged]))  # list(): re-raises an error
        stored: list[str] = []
        shards: set[Path] = set()
        new_shard = False
        for sha256, path in staged:
            final = self.layout.block(sha256)
            if final.is_file():  # another revision's fill stored it meanwhile: same bytes
                path.unlink()
                continue
            if not final.parent.is_dir():
                final.parent.mkdir(parents=True, exist_ok=True)
                new_shard = True
            os.rename(path, final)
            stored.append(sha256)
            shards.add(final.parent)
        for shard in shards:
            fsync_dir(shard)
        if new_shard:
            fsync_dir(self.layout.blocks)
        return stored

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
        if not self.layout.blocks.is_dir():
            return set()
        return {p.name for shard in self.layout.blocks.iterdir() if shard.is_dir() for p in shard.iterdir()
                if not p.name.startswith(".tmp-")}
