"""The fill lease of one revision: a lock file with a TTL and a version that only grows.

``leases/<digest>.lease`` holds ``{"version", "holder", "expires_at"}``; every read-modify-write
of it happens under ``flock`` of ``leases/<digest>.lock``, so two processes never both see it
free.  A lease is taken when absent, released or expired, always with ``version`` one above the
last one written (the file outlives releases, so versions never repeat).  Publishing is fenced:
``publish`` re-checks, under the same flock, that the lease file still names this holder's
version and has not expired, and renames the staging directory only then -- a writer that
was slow past its TTL, or taken over by a higher version, gets LeaseLostError and publishes
nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from warmpool.lease import LeaseLostError
from warmpool_nodecache.blocks import fsync_dir


@dataclass(frozen=True)
class FileLeaseState:
    version: int
    holder: str
    expires_at: float

    def live(self, now: float) -> bool:
        return self.expires_at > now


@contextlib.contextmanager
def _mutex(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


class FileLease:
    """One (model, revision) fill lease under `directory` (the cache's leases/)."""

    def __init__(self, directory: Path, name: str, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        self.directory = directory
        self.name = name
        self.ttl_s = ttl_s
        self.clock = clock
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.version: int | None = None  # set while held

    @property
    def _file(self) -> Path:
        return self.directory / f"{self.name}.lease"

    def read(self) -> FileLeaseState | None:
        try:
            body = json.loads(self._file.read_text())
            return FileLeaseState(int(body["version"]), str(body["holder"]), float(body["expires_at"]))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(f"{self._file}: unreadable lease file ({exc}); remove it by hand") from None

    def _write(self, state: FileLeaseState) -> None:
        tmp = self._file.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"version": state.version, "holder": state.holder, "expires_at": state.expires_at}))
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.rename(tmp, self._file)
        fsync_dir(self.directory)

    def try_acquire(self) -> bool:
        """Take the lease if no live holder has it; the new version is above every earlier one."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with _mutex(self.directory / f"{self.name}.lock"):
            now = self.clock()
            current = self.read()
            if current is not None and current.live(now):
                return False
            version = (current.version if current else 0) + 1
            self._write(FileLeaseState(version, self.holder, now + self.ttl_s))
            self.version = version
            return True

    def _check(self, current: FileLeaseState | None, now: float) -> None:
        if self.version is None:
            raise LeaseLostError(f"lease {self.name}: not held")
        if current is None or current.version != self.version or current.holder != self.holder:
            seen = current.version if current else None
            raise LeaseLostError(f"lease {self.name}: taken over (held version {self.version}, the file has {seen})")
        if not current.live(now):
            late = now - current.expires_at
            raise LeaseLostError(f"lease {self.name}: version {self.version} expired {late:.3f}s ago")

    def renew(self) -> None:
        """Extend the TTL; LeaseLostError if the lease was lost meanwhile."""
        with _mutex(self.directory / f"{self.name}.lock"):
            now = self.clock()
            current = self.read()
            self._check(current, now)
            assert current is not None
            self._write(FileLeaseState(current.version, self.holder, now + self.ttl_s))

    def publish(self, staging: Path, final: Path) -> None:
        """Rename `staging` to `final` only while this lease is held and live (the fence)."""
        with _mutex(self.directory / f"{self.name}.lock"):
            self._check(self.read(), self.clock())
            os.rename(staging, final)
            fsync_dir(final.parent)

    def release(self) -> None:
        """Give the lease up (expires now; the version stays recorded). A lost lease is left alone."""
        if self.version is None:
            return
        with _mutex(self.directory / f"{self.name}.lock"):
            current = self.read()
            if current is not None and current.version == self.version and current.holder == self.holder:
                self._write(FileLeaseState(current.version, self.holder, 0.0))
        self.version = None
