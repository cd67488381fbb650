"""Read leases on the mapped weight files: a file changed in place is a clear failure, not SIGBUS.

What happens without them: on CPU a resident weight *is* the file's mapping (zero copy).  A
file truncated in place after its layer faulted in loses those pages from every mapping (the
kernel unmaps them), and the next forward pass that reads one gets SIGBUS: the process dies
mid-request with no word on why.  Checking the file before each step cannot close that window
(the truncation lands in the middle of a step under load).

With a read lease (``fcntl(F_SETLEASE, F_RDLCK)``, Linux) on each weight file, the kernel holds
whoever opens the file for writing or truncates it, and signals us (SIGIO) first.  The worker
then stops using the weights at once: the step under way finishes on pages that are still
there, every request is answered 503 naming the file, /readyz turns 503 and the process exits
non-zero for a restart; only when it has exited (its descriptors closed) does the truncation
go ahead.  The kernel waits at most ``/proc/sys/fs/lease-break-time`` seconds (45 by default)
for that, far more than a step takes.  A file replaced by rename (the supported way) breaks no
lease: the worker keeps serving the file it validated.

A lease needs the file's owner's uid or CAP_LEASE, a local filesystem, and no writer holding
the file open (a node cache's partial view still filling is never leased).  Where it cannot be
taken the worker says so once and serves on with the identity check before each layer load
(`Checkpoint.verify_unchanged`), which covers cold layers only.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path

from warmpool_worker.engine_api import WeightsChangedError

log = logging.getLogger(__name__)


class WeightLeases:
    """The leases held on one checkpoint's files; `lease_broken` is the SIGIO handler's call."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._broken: str | None = None
        self._lock = threading.Lock()

    @property
    def held(self) -> list[Path]:
        return sorted(self._fds)

    def take(self, descriptors: dict[Path, int]) -> list[tuple[Path, str]]:
        """Lease each file (read-only descriptors held since validation); the ones refused, and why.

        The SIGIO handler must be installed before: SIGIO's default action ends the process."""
        refused: list[tuple[Path, str]] = []
        for path, fd in sorted(descriptors.items()):
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            except OSError as error:
                refused.append((path, os.strerror(error.errno or 0)))
                continue
            self._fds[path] = fd
        return refused

    def lease_broken(self) -> str:
        """A lease break arrived: which file is being changed (the one whose lease is breaking,
        F_GETLEASE answering F_UNLCK), remembered for `check`; the reason, for the log."""
        with self._lock:
            if self._broken is None:
                breaking = [path for path, fd in self._fds.items() if _breaking(fd)]
                names = ", ".join(str(p) for p in breaking) or ", ".join(str(p) for p in self._fds)
                self._broken = (f"{names}: weight file opened for writing or truncated in place while the worker "
                                "maps it; the worker stops using its weights and exits for a restart (the change "
                                "waits for the exit): replace weights by rename, never in place")
            return self._broken

    @property
    def broken(self) -> str | None:
        return self._broken

    def check(self) -> None:
        """Raise WeightsChangedError once a lease broke (before every batch step)."""
        if self._broken is not None:
            raise WeightsChangedError(self._broken)


def _breaking(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_UNLCK)
    except OSError:
        return True
