"""Readers' side of the cache: recording a revision's uses (for LRU-K) and pinning it while in use.

A reader opens a published revision through ``pinned``: a pin file ``pins/<digest>/<pid>.<n>``
exists while the context is open, and a pin whose process is gone counts for nothing.  A
process that maps a revision's files without a pin (an engine started by hand) is found by
``mapped_revisions``, which scans ``/proc/*/maps`` (by path, and by device and inode for a
worker that maps the revision through a container's mount of the cache); processes of other
users are readable there only to root (the node agent runs as root), so a non-root evictor
relies on pins.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

from warmpool_nodecache.eviction_lock import gc_lock
from warmpool_nodecache.layout import CacheLayout

_pin_counter = itertools.count()


class RevisionNotCachedError(LookupError):
    """The revision is not published in this cache."""


def record_use(layout: CacheLayout, digest_hex: str, when: float | None = None) -> None:
    layout.uses.mkdir(parents=True, exist_ok=True)
    fd = os.open(layout.uses / digest_hex, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{time.time() if when is None else when:.6f}\n".encode())
    finally:
        os.close(fd)


def use_times(layout: CacheLayout, digest_hex: str) -> list[float]:
    """Every recorded use, oldest first (an unreadable line is skipped: the history is advisory)."""
    try:
        lines = (layout.uses / digest_hex).read_text().split()
    except FileNotFoundError:
        return []
    times: list[float] = []
    for line in lines:
        with contextlib.suppress(ValueError):
            times.append(float(line))
    return sorted(times)


@contextlib.contextmanager
def pinned(layout: CacheLayout, digest_hex: str) -> Iterator[Path]:
    """The published revision's directory, pinned against eviction while the context is open."""
    pin_dir = layout.pins / digest_hex
    pin = pin_dir / f"{os.getpid()}.{next(_pin_counter)}"
    with gc_lock(layout, exclusive=False):
        revision = layout.revision(digest_hex)
        if not revision.is_dir():
            raise RevisionNotCachedError(f"revision sha256:{digest_hex} is not published under {layout.root}")
        pin_dir.mkdir(parents=True, exist_ok=True)
        pin.touch()
    record_use(layout, digest_hex)
    try:
        yield revision
    finally:
        with contextlib.suppress(FileNotFoundError):
            pin.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_pins(layout: CacheLayout, digest_hex: str) -> list[Path]:
    pin_dir = layout.pins / digest_hex
    if not pin_dir.is_dir():
        return []
    live: list[Path] = []
    for pin in pin_dir.iterdir():
        pid = pin.name.split(".")[0]
        if pid.isdigit() and _pid_alive(int(pid)):
            live.append(pin)
    return live


def _revision_files(layout: CacheLayout) -> tuple[str, dict[tuple[int, int, int], set[str]]]:
    """The revisions' prefix on this machine, and every revision file by (device major, minor, inode)."""
    revisions = layout.revisions.resolve()
    by_inode: dict[tuple[int, int, int], set[str]] = {}
    if revisions.is_dir():
        for revision in revisions.iterdir():
            for folder, _, files in os.walk(revision):
                for name in files:
                    with contextlib.suppress(OSError):  # evicted meanwhile
                        st = os.stat(os.path.join(folder, name))
                        by_inode.setdefault((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino), set()).add(
                            revision.name)
    return str(revisions) + "/", by_inode


def mapped_revisions(layout: CacheLayout, proc: Path = Path("/proc")) -> set[str]:
    """Digests (hex) of revisions some process has a file of mapped, from /proc/<pid>/maps.

    A worker in a container maps the revision through its own mount of the cache, so the path in
    its maps is the container's (``/var/lib/warmpool/blocks/...``, or anything its pod chose) and
    says nothing here.  Each maps line also names the file's device and inode, which a bind mount
    keeps: a mapping counts when its path lies under the revisions here or its (device, inode) is
    one of a revision's files.
    """
    prefix, by_inode = _revision_files(layout)
    found: set[str] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "maps").read_text()
        except OSError:  # gone meanwhile, or another user's process
            continue
        for line in text.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) != 6:
                continue  # an anonymous mapping
            device, inode, path = parts[3], parts[4], parts[5].strip()
            if path.startswith(prefix):
                found.add(path[len(prefix):].split("/")[0])
                continue
            major, _, minor = device.partition(":")
            with contextlib.suppress(ValueError):
                found |= by_inode.get((int(major, 16), int(minor, 16), int(inode)), set())
    return found
