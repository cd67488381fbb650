"""A revision's view while it fills: its files in the staging directory, blocks written in as they land.

Every fill lays the revision out in its staging directory before fetching: every file with bytes
pre-sized (sparse: ``ftruncate``), an empty file empty.  The fetch thread that verified a block
writes it into every place the revision uses it (``write``: ``pwrite`` of the bytes it holds, in
parallel with the other fetches), and that is the only time the fill writes those bytes: no block
file is written beside them (``blocks.py``: once published, the revision's files hold its blocks
for every later fill).  A block the store already held (a block file, or a place in another
published revision) is cloned from there where the filesystem shares extents (FICLONERANGE: XFS
with reflink, btrfs), else copied in the kernel (``copy_file_range``).  After each commit
(``BlockCommits`` calls ``place`` in its commit thread) the files the batch wrote to are
fdatasynced and only then the batch is appended to the fill's journal (``journal.py``), so a fill
killed midway leaves its view with a list of the blocks already durable in it, and the next
holder of the lease resumes from that view (``create(resume_from=...)``: the blocks its trust
domain verified before are kept, the rest fetched again).  ``finish`` fsyncs every file again
before the fill publishes.

With ``FillOptions.partial_view`` the view is also offered to a worker while it fills: after
each ``place`` the progress record (``warmpool.fill_progress``, inside the view: a worker's pod
mounts the view alone) is replaced listing the blocks committed so far (a block written early is
listed only once committed).  Blocks the store already held and the fill's trust domain verified
(a resumed fill, blocks shared with another revision; ``trust.py``) are placed before the first
fetch.  So a reader that waits for the record to list a byte range reads only
verified bytes, and the files it opened stay the files that are published: ``finish`` fsyncs
and makes them read-only, the fill renames the whole directory to ``revisions/<digest>`` (same
inodes), and the record then says ``published``.  A failed fill says ``failed`` (and why), so a
waiting worker ends with the fill's error instead of waiting on; its files stay for the next fill
to resume from, unless the revision itself was wrong (a corrupt block: ``discard`` empties the
view, the record staying until the next fill of the revision or eviction removes the directory).

``<root>/domains/<domain>/partial/<digest hex>`` is a symbolic link to the current view (and to
the published revision once published), a fixed name a worker's pod mounts (a ``subPath``, which
the kubelet resolves when the container starts) before the fill's lease version is known; it goes
when the fill fails.  Without ``partial_view`` there is no record and
no link: the directory is only the fill's staging until it is published.
"""

from __future__ import annotations

import contextlib
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
from warmpool_nodecache.journal import FillJournal, journal_path, read_journal
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
    default: whenever the store holds it).  `vouched`: whether the fill's domain verified a block
    itself, so a resumed view's journaled copy of it may stay (default: always)."""

    def __init__(self, store: BlockStore, manifest: Manifest, directory: Path, link: Path | None,
                 usable: Callable[[str], bool] | None = None, vouched: Callable[[str], bool] | None = None) -> None:
        if any(f.path.split("/")[0] == FILL_PROGRESS_NAME for f in manifest.files):
            raise ManifestError(f"revision {manifest.digest}: a file may not be named {FILL_PROGRESS_NAME!r} "
                                "(the name of the fill's progress record inside the revision)")
        self.store, self.manifest, self.directory, self.link = store, manifest, directory, link
        self.usable = usable or store.has
        self.vouched = vouched or (lambda _sha: True)
        self.record = progress_path(directory)
        self._lock = threading.Lock()
        #: (file, block index) whose bytes are in the file already (written by a fetch thread, or
        #: kept from a resumed view), so ``place`` only syncs and lists them
        self._written: set[tuple[str, int]] = set()
        self._written_lock = threading.Lock()
        self._fds: dict[str, int] = {}  # files with bytes, open for writing until ``finish``
        self._journal: FillJournal | None = None
        self._clones = False
        self._present: dict[str, set[int]] = {f.path: set() for f in manifest.files}
        #: sha256 -> every (file, block index) of the revision that holds it
        self._places: dict[str, list[tuple[str, int]]] = {}
        for ref in manifest.block_refs():
            self._places.setdefault(ref.sha256, []).append((ref.path, ref.index))
        self._sizes = {f.path: f.size for f in manifest.files}
        self._blocks = {f.path: len(f.blocks) for f in manifest.files}
        #: per file, how its blocks got there: "write" (fetched), "copy" / "reflink" (held), "resumed"
        self._how: dict[str, set[str]] = {f.path: set() for f in manifest.files}
        #: blocks kept from a resumed view (journaled there, verified by this fill's domain)
        self.resumed: frozenset[str] = frozenset()

    # ---- life -------------------------------------------------------------------------------
    def create(self, resume_from: Path | None = None) -> None:
        """The directory and the record in it, every file laid out, what the store holds placed, and
        only then the link (so a worker never finds a view without its record).  `resume_from`: an
        earlier fill's view of the revision, taken over (renamed to this view) with what its journal
        lists when its files are all there."""
        resumed = resume_from is not None and self._take_over(resume_from)
        if not resumed:
            self.directory.mkdir()
        self._write(STATE_FILLING)
        self._clones = clones_here(self.directory)
        for f in self.manifest.files:
            dest = self.directory / f.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not f.blocks:
                continue  # made empty by ``finish``
            if resumed:
                os.chmod(dest, 0o644)  # sealed by a fill that died between finish and publish
                self._fds[f.path] = os.open(dest, os.O_WRONLY)
            else:
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                self._fds[f.path] = fd
                os.ftruncate(fd, f.size)
        for directory in {(self.directory / f.path).parent for f in self.manifest.files}:
            fsync_dir(directory)  # the files' names are durable before the journal lists a byte of them
        fsync_dir(self.directory.parent)
        self._journal = FillJournal(journal_path(self.directory))
        with self._written_lock:
            for sha in self.resumed:
                self._written.update(self._places[sha])
        held = [sha for sha in self._places if sha in self.resumed or self.usable(sha)]
        self.place(held)
        if self.link is not None:
            point_link(self.link, self.directory)

    def _take_over(self, old: Path) -> bool:
        """Rename an earlier view (and its journal) to this one if every file of it is there at its
        size, else remove it; ``resumed``: the journaled blocks this fill's domain verified itself."""
        done = read_journal(journal_path(old)) & self._places.keys()
        usable = bool(done) and old.is_dir() and not old.is_symlink()
        for f in self.manifest.files if usable else ():
            kept = old / f.path
            if f.blocks and (kept.is_symlink() or not kept.is_file() or kept.stat().st_size != f.size):
                usable = False
        if not usable:
            remove_views(old.parent, old.name.rsplit(".", 1)[0], keep=self.directory)
            return False
        os.rename(old, self.directory)
        os.rename(journal_path(old), journal_path(self.directory))
        self.resumed = frozenset(sha for sha in done if self.vouched(sha))
        for sha in self.resumed:
            for file, _ in self._places[sha]:
                self._how[file].add("resumed")
        return True

    def has(self, sha: str) -> bool:
        """Whether the view holds the block already (kept from a resumed view): no fetch needed."""
        return sha in self.resumed

    def write(self, sha: str, data: bytes) -> None:
        """In a fetch thread, `data` verified as block `sha`: written into every place that uses it."""
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
                    self._how[path].add("write")

    def place(self, shas: Iterable[str]) -> None:
        """Put these blocks (fetched and verified, or held) in every place the revision uses them,
        make them durable, journal them; then list them in the record."""
        with self._lock:
            touched: set[str] = set()
            listed: list[str] = []
            for sha in dict.fromkeys(shas):
                for path, index in self._places.get(sha, ()):
                    if index not in self._present[path]:
                        self._put(sha, path, index)
                        self._present[path].add(index)
                        touched.add(path)
                        listed.append(sha)
            for path in touched & self._fds.keys():
                # Flushed here, in the commit thread beside the fetches, not all at the end.
                os.fdatasync(self._fds[path])
            if self._journal is not None:
                self._journal.append(dict.fromkeys(listed))  # only after the bytes are on disk
            if touched:
                self._write(STATE_FILLING)

    def _put(self, sha: str, path: str, index: int) -> None:
        with self._written_lock:
            if (path, index) in self._written:
                return  # its fetch thread wrote it, or the resumed view held it
        held = self.store.locate(sha)
        if held is None:
            raise RuntimeError(f"{self.directory}: block {sha} of {path} was neither fetched nor held")
        offset = index * self.manifest.block_size
        length = min(self.manifest.block_size, self._sizes[path] - offset)
        src_fd = os.open(held.path, os.O_RDONLY)
        try:
            fd = self._fds[path]
            if self._clones and clone_range(src_fd, fd, length, offset, held.offset):
                self._how[path].add("reflink")
            else:
                copy_range(src_fd, fd, length, offset, held.offset)
                self._how[path].add("copy")
        finally:
            os.close(src_fd)

    @property
    def methods(self) -> tuple[str, ...]:
        """How each file was made, in manifest order ("write", "copy", "reflink", "resumed", joined
        by "+" when several; "empty")."""
        return tuple("+".join(sorted(self._how[f.path])) or "empty" for f in self.manifest.files)

    def finish(self) -> tuple[str, ...]:
        """Every block placed: fsync and seal the files (read-only); how each was made, in manifest order."""
        # A block another revision's fill published after ``create`` looked, which this fill then
        # skipped as held: copied from there now.
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
                fd = os.open(dest, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.chmod(dest, 0o444)
            for directory in {(self.directory / f.path).parent for f in self.manifest.files}:
                fsync_dir(directory)
            return self.methods

    def published(self, final: Path) -> None:
        """After the rename: the fixed link names the published revision, the journal (beside the
        view, in staging) goes, and the record says so.  The link first: until it is re-pointed it
        names the view's old path, which the rename emptied, and a worker reading a file through it
        (not through the view's directory) would find nothing there."""
        if self.link is not None:
            point_link(self.link, final)
        with contextlib.suppress(FileNotFoundError):
            journal_path(self.directory).unlink()
        if self.link is None:
            return
        with self._lock:
            self.record = progress_path(final)  # renamed with its view
            self._write(STATE_PUBLISHED)

    def close(self) -> None:
        """The files' descriptors and the journal closed (``finish`` does it; a failed fill calls it itself)."""
        with self._lock:
            fds, self._fds = self._fds, {}
            journal, self._journal = self._journal, None
        for fd in fds.values():
            os.close(fd)
        if journal is not None:
            journal.close()

    def failed(self, error: BaseException) -> None:
        """Before the view is removed or left to resume from: a waiting reader learns why, and the
        link goes -- unless it names another view by now (a holder that took the lease over re-points it)."""
        self.close()
        if self.link is None:
            return
        with contextlib.suppress(OSError):
            if os.readlink(self.link) == os.path.relpath(self.directory, self.link.parent):
                self.link.unlink()
        with self._lock, contextlib.suppress(OSError):
            self._write(STATE_FAILED, f"{type(error).__name__}: {error}")

    def discard(self) -> None:
        """A failed fill's view and journal go (the revision was wrong: nothing to resume) -- but for
        its record, which stays saying why (a worker's pod mounts the view itself: the record must
        outlive the files for it to read) until the next fill of the revision or eviction removes
        the directory (``remove_views``)."""
        with contextlib.suppress(FileNotFoundError):
            journal_path(self.directory).unlink()
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


def resumable_view(staging: Path, digest_hex: str) -> Path | None:
    """The newest earlier view of this revision with a journal (a fill that died or failed midway), if any."""
    views: list[tuple[int, Path]] = []
    for path in staging.glob(f"{digest_hex}.*"):
        version = path.name.removeprefix(f"{digest_hex}.")
        if version.isascii() and version.isdigit() and path.is_dir() and not path.is_symlink() \
                and journal_path(path).is_file():
            views.append((int(version), path))
    return max(views)[1] if views else None


def remove_views(staging: Path, digest_hex: str, keep: Path | None = None) -> None:
    """Every earlier fill's view of this revision but `keep`, its record inside (a reader finds the
    record gone, and stops), its journal, and what older versions staged beside it."""
    for old in sorted(staging.glob(f"{digest_hex}.*")):
        if keep is not None and old in (keep, journal_path(keep)):
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
