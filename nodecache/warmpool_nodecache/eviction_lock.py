"""The cache-wide lock between fills and eviction.

A fill holds ``gc.lock`` shared from the moment it owns its lease until it publishes, and a
reader holds it shared while it pins a revision; eviction holds it exclusive.  So eviction
never sees a half-written fill (every unpublished manifest it finds is abandoned) and never
removes a revision between a reader's check and its pin.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

from warmpool_nodecache.layout import CacheLayout


class CacheBusyError(RuntimeError):
    """The cache-wide lock could not be taken in time (a fill in progress)."""


@contextlib.contextmanager
def gc_lock(layout: CacheLayout, *, exclusive: bool, timeout_s: float = 30.0) -> Iterator[None]:
    layout.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(layout.gc_lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    kind = "exclusive" if exclusive else "shared"
                    raise CacheBusyError(f"{layout.gc_lock}: no {kind} lock within {timeout_s}s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)
