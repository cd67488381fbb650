"""Readers' side of the cache: recording a revision's uses (for LRU-K) and pinning it while in use.

A reader opens a published revision through ``pinned``: a pin file ``pins/<digest>/<pid>.<n>``
exists while the context is open, and a pin whose process is gone counts for nothing.  A
process that maps a revision's files without a pin (an engine started by hand) is found by
``mapped_revisions``, which scans ``/proc/*/maps``; processes of other users are readable
there only to root (the node agent runs as root), so a non-root evictor relies on pins.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

from warmpool_nodecache.gclock import gc_lock
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


def mapped_revisions(layout: CacheLayout, proc: Path = Path("/proc")) -> set[str]:
    """Digests (hex) of revisions some process has a file of mapped, from /proc/<pid>/maps."""
    prefix = str(layout.revisions.resolve()) + "/"
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
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.startswith(prefix):
                found.add(path[len(prefix):].split("/")[0])
    return found
