"""A revision's view while it fills: its files in the staging directory, blocks written in as they land.

Every fill lays the revision out in its staging directory before fetching: every file of several
blocks pre-sized (sparse: ``ftruncate``), an empty file empty.  Each block's bytes get into every
place the revision uses them in one of two ways.  Where the filesystem shares extents
(FICLONERANGE: XFS with reflink, btrfs), the block is cloned from the store once committed (no
bytes written twice).  Elsewhere (ext4, tmpfs, overlayfs) the fetch thread that verified the
block also writes it into the view (``write``: ``pwrite`` of the bytes it holds, beside the
staged block file, in parallel with the other fetches), which costs the same page-cache copy a
copy from the store would, but overlapped with the network instead of a pass at the end; a
block the store already held is copied from it in the kernel.  A file of one block is a hard
link to it, made once it is committed (the name appears whole).  After each commit
(``BlockCommits`` calls ``place`` in its commit thread, after the commit's fsyncs and renames),
the view's files the batch wrote to are fdatasynced there too, so the end of the fill has little
left to flush; ``finish`` fsyncs them all again before the fill publishes.

With ``FillOptions.partial_view`` the view is also offered to a worker while it fills: after
each ``place`` the progress record (``warmpool.fill_progress``, inside the view: a worker's pod
mounts the view alone) is replaced listing the blocks committed so far (a block written early is
listed only once committed).  Blocks the store already held and the fill's trust domain verified
(a resumed fill, blocks shared with another revision; ``trust.py``) are placed before the first
fetch.  So a reader that waits for the record to list a byte range reads only
verified bytes, and the files it opened stay the files that are published: ``finish`` fsyncs
and makes them read-only, the fill renames the whole directory to ``revisions/<digest>`` (same
inodes), and the record then says ``published``.  A failed fill says ``failed`` (and why) before
the view's files are removed (``discard``: the record stays in the emptied view until the next fill
of the revision removes it), so a waiting worker ends with the fill's error instead of waiting on.

``<root>/domains/<domain>/partial/<digest hex>`` is a symbolic link to the current view (and to
the published revision once published), a fixed name a worker's pod mounts (a ``subPath``, which
the kubelet resolves when the container starts) before the fill's lease version is known; it goes
when the fill fails.  Without ``partial_view`` there is no record and
no link: the directory is only the fill's staging until it is published.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from warmpool.contract.nodecache import FILL_PROGRESS_NAME
from warmpool.fill_progress import (
    STATE_FAILED,
    STATE_FILLING,
    STATE_PUBLISHED,
    FileProgress,
    FillProgress,
    merge_intervals,
    progress_path,
    write_progress,
)
from warmpool_nodecache.blocks import BlockStore, fsync_dir
from warmpool_nodecache.manifest import Manifest, ManifestError
from warmpool_nodecache.materialise import clone_range, copy_range


def clones_here(directory: Path) -> bool:
    """Whether files in `directory` can share extents (FICLONERANGE of one page between two probes)."""
    src, dst = directory / ".clone-probe-src", directory / ".clone-probe-dst"
    try:
        src.write_bytes(b"\0" * 4096)
        with src.open("rb") as a, dst.open("wb") as b:
            return clone_range(a.fileno(), b.fileno(), 4096, 0)
    finally:
        for probe in (src, dst):
            with contextlib.suppress(FileNotFoundError):
                probe.unlink()


def point_link(link: Path, target: Path) -> None:
    """Make `link` a symbolic link to `target` (relative), replacing any old one atomically."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(os.path.relpath(target, link.parent), tmp)
    os.rename(tmp, link)


class PartialView:
    """The view of one fill (one lease version); see the module docstring for its life.

    `link` None: a fill without ``partial_view`` (no progress record, no link).  `usable`: whether
    the store's copy of a block may go into the view unfetched (the fill's trust domain verified it;
    default: whenever the store holds it)."""

    def __init__(self, store: BlockStore, manifest: Manifest, directory: Path, link: Path | None,
                 usable: Callable[[str], bool] | None = None) -> None:
        if any(f.path.split("/")[0] == FILL_PROGRESS_NAME for f in manifest.files):
            raise ManifestError(f"revision {manifest.digest}: a file may not be named {FILL_PROGRESS_NAME!r} "
                                "(the name of the fill's progress record inside the revision)")
        self.store, self.manifest, self.directory, self.link = store, manifest, directory, link
        self.usable = usable or store.has
        self.record = progress_path(directory)
        self._lock = threading.Lock()
        #: (file, block index) the fetch threads wrote (``write``), so ``place`` only lists them
        self._written: set[tuple[str, int]] = set()
        self._written_lock = threading.Lock()
        self._fds: dict[str, int] = {}  # multi-block files, open for writing until ``finish``
        self._clones = False
        self._present: dict[str, set[int]] = {f.path: set() for f in manifest.files}
        #: sha256 -> every (file, block index) of the revision that holds it
        self._places: dict[str, list[tuple[str, int]]] = {}
        for ref in manifest.block_refs():
            self._places.setdefault(ref.sha256, []).append((ref.path, ref.index))
        self._sizes = {f.path: f.size for f in manifest.files}
        self._blocks = {f.path: len(f.blocks) for f in manifest.files}
        self.methods: dict[str, str] = {}

    # ---- life -------------------------------------------------------------------------------
    def create(self) -> None:
        """The directory and the record in it, every file laid out, what the store holds placed, and
        only then the link (so a worker never finds a view without its record)."""
        self.directory.mkdir()
        self._write(STATE_FILLING)
        self._clones = clones_here(self.directory)
        for f in self.manifest.files:
            dest = self.directory / f.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            if len(f.blocks) == 1:
                continue  # a hard link to its block, made when the block is in the store
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self._fds[f.path] = fd
            os.ftruncate(fd, f.size)
            self.methods[f.path] = "empty" if not f.blocks else ("reflink" if self._clones else "write")
        held = [sha for sha in self._places if self.usable(sha)]
        self.place(held)
        if self.link is not None:
            point_link(self.link, self.directory)

    def write(self, sha: str, data: bytes) -> None:
        """In a fetch thread, `data` verified as block `sha`: written into every multi-block file
        place that uses it, unless the filesystem clones (then ``place`` clones it once committed)."""
        if self._clones:
            return
        for path, index in self._places.get(sha, ()):
            fd = self._fds.get(path)
            if fd is not None:
                view = memoryview(data)
                offset = index * self.manifest.block_size
                while view:  # pwrite may write less than asked (a signal, a full page cache)
                    done = os.pwrite(fd, view, offset)
                    view, offset = view[done:], offset + done
                with self._written_lock:
                    self._written.add((path, index))

    def place(self, shas: Iterable[str]) -> None:
        """Write these committed blocks into every place the revision uses them; then list them."""
        with self._lock:
            touched: set[str] = set()
            for sha in dict.fromkeys(shas):
                for path, index in self._places.get(sha, ()):
                    if index not in self._present[path]:
                        self._put(sha, path, index)
                        self._present[path].add(index)
                        touched.add(path)
            for path in touched & self._fds.keys():
                # Flushed here, in the commit thread beside the fetches, not all at the end.
                os.fdatasync(self._fds[path])
            if touched:
                self._write(STATE_FILLING)

    def _put(self, sha: str, path: str, index: int) -> None:
        with self._written_lock:
            if (path, index) in self._written:
                return  # its fetch thread wrote it (before the block was committed)
        block = self.store.layout.block(sha)
        dest = self.directory / path
        offset = index * self.manifest.block_size
        length = min(self.manifest.block_size, self._sizes[path] - offset)
        if self._blocks[path] == 1:
            try:
                os.link(block, dest)
                self.methods[path] = "hardlink"
                return
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                    raise
            tmp = dest.with_name(f".{dest.name}.tmp")
            self.methods[path] = self._write_range(block, tmp, length, 0, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                                   "reflink")
            os.rename(tmp, dest)  # the name appears whole
            return
        self.methods[path] = self._write_range(block, dest, length, offset, os.O_WRONLY,
                                               self.methods.get(path, "reflink"))

    @staticmethod
    def _write_range(block: Path, dest: Path, length: int, offset: int, flags: int, method: str) -> str:
        """The block's bytes at `offset` of `dest`: cloned, or copied once a clone fails here; how."""
        fd = os.open(dest, flags, 0o644)
        try:
            src_fd = os.open(block, os.O_RDONLY)
            try:
                if not (method == "reflink" and clone_range(src_fd, fd, length, offset)):
                    method = "copy"  # once a clone fails on this filesystem, the rest copy
                    copy_range(src_fd, fd, length, offset)
            finally:
                os.close(src_fd)
        finally:
            os.close(fd)
        return method

    def finish(self) -> tuple[str, ...]:
        """Every block placed: fsync and seal the files (read-only); how each was made, in manifest order."""
        # A block another revision's fill stored after ``create`` looked, which this fill then
        # skipped as held: copied from the store now.
        self.place(sha for sha, places in self._places.items()
                   if any(i not in self._present[p] for p, i in places) and self.usable(sha))
        self.close()
        with self._lock:
            absent = {p: self._blocks[p] - len(s) for p, s in self._present.items() if len(s) != self._blocks[p]}
            if absent:
                raise RuntimeError(f"{self.directory}: blocks never placed in the view: {absent}")
            for f in self.manifest.files:
                dest = self.directory / f.path
                if not f.blocks and not dest.exists():
                    dest.touch(0o644)
                if self.methods.get(f.path) != "hardlink":
                    fd = os.open(dest, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.chmod(dest, 0o444)
            for directory in {(self.directory / f.path).parent for f in self.manifest.files}:
                fsync_dir(directory)
            return tuple(self.methods.get(f.path, "empty") for f in self.manifest.files)

    def close(self) -> None:
        """The files' descriptors closed (``finish`` does it; a failed fill calls it itself)."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def published(self, final: Path) -> None:
        """After the rename: the record says so, and the fixed link names the published revision."""
        if self.link is None:
            return
        with self._lock:
            self.record = progress_path(final)  # renamed with its view
            self._write(STATE_PUBLISHED)
        point_link(self.link, final)

    def failed(self, error: BaseException) -> None:
        """Before the view is removed: a waiting reader learns why, and the link goes -- unless it
        names another view by now (a holder that took the lease over re-points it)."""
        self.close()
        if self.link is None:
            return
        with contextlib.suppress(OSError):
            if os.readlink(self.link) == os.path.relpath(self.directory, self.link.parent):
                self.link.unlink()
        with self._lock, contextlib.suppress(OSError):
            self._write(STATE_FAILED, f"{type(error).__name__}: {error}")

    def discard(self) -> None:
        """A failed fill's view goes -- but for its record, which stays saying why (a worker's pod
        mounts the view itself: the record must outlive the files for it to read) until the next
        fill of the revision or eviction removes the directory (``remove_views``)."""
        if self.link is None or not self.directory.is_dir():
            shutil.rmtree(self.directory, ignore_errors=True)
            return
        for entry in self.directory.iterdir():
            if entry.name == self.record.name:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()

    def _write(self, state: str, error: str | None = None) -> None:
        if self.link is None:
            return  # no worker reads a fill's staging without a partial view
        bs = self.manifest.block_size
        files = {p: FileProgress(self._sizes[p], merge_intervals((i, i + 1) for i in present))
                 for p, present in self._present.items()}
        write_progress(self.record, FillProgress(self.manifest.digest, bs, files, state, error, time.time()))


def remove_views(staging: Path, digest_hex: str) -> None:
    """Every earlier fill's view of this revision, its record inside (a reader finds the record
    gone, and stops), and its staged blocks."""
    for old in sorted(staging.glob(f"{digest_hex}.*")):
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    for old in staging.glob(f"{digest_hex}.*"):
        if not old.is_dir():
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
