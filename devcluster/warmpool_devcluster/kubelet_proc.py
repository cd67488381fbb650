"""Local processes for containers: where their logs go, starting, stopping, and cleaning up.

Every container process runs in its own session (so its whole process group can be
signalled), dies with the kubelet (PR_SET_PDEATHSIG), and has a pid file under
``<work-dir>/pids/`` that records its start time, so ``kill_leftovers`` can clean up after
a crashed kubelet without ever hitting a recycled pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import time
from collections.abc import Mapping
from pathlib import Path

_PR_SET_PDEATHSIG = 1
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not Linux
    _LIBC = None


def pod_dir(work_dir: Path, namespace: str, pod: str) -> Path:
    return work_dir / "pods" / namespace / pod


def container_log_path(work_dir: Path, namespace: str, pod: str, container: str) -> Path:
    """Where a container's stdout and stderr go (appended across restarts, with a marker line)."""
    return pod_dir(work_dir, namespace, pod) / f"{container}.log"


def pids_dir(work_dir: Path) -> Path:
    return work_dir / "pids"


def resolve_command(argv0: str, path_env: str | None) -> str | None:
    """argv[0] resolved on the kubelet's PATH (or as a path); None when it cannot run here."""
    if "/" in argv0:
        return argv0 if os.path.isfile(argv0) and os.access(argv0, os.X_OK) else None
    return shutil.which(argv0, path=path_env)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel to SIGKILL it if we die.
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class ContainerProcess:
    """One running container process and its pid file."""

    def __init__(self, proc: asyncio.subprocess.Process, pid_file: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.pid_file = pid_file
        self.started_at = time.time()

    @classmethod
    async def start(
        cls,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str,
        log_path: Path,
        work_dir: Path,
        tag: str,
    ) -> ContainerProcess:
        """Start argv in its own session with output appended to log_path. Raises OSError."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            log.write(f"--- warmpool kubelet: starting {argv!r} at {stamp}\n".encode())
            log.flush()
            proc = await asyncio.create_subprocess_exec(
                *argv, env=dict(env), cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
                stdout=log, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        pid_file = pids_dir(work_dir) / f"{tag}.{proc.pid}.json"
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(json.dumps({"pid": proc.pid, "start_time": _start_time(proc.pid), "tag": tag}))
        return cls(proc, pid_file)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        code = await self.proc.wait()
        self._reap_group()
        return code

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def _reap_group(self) -> None:
        # The leader is gone; kill what it left in its group, then forget the pid file.
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            self.pid_file.unlink()

    async def stop(self, grace: float) -> int:
        """SIGTERM the process group, wait up to ``grace`` seconds, then SIGKILL. Returns the exit code."""
        if self.proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                async with asyncio.timeout(max(0.0, grace)):
                    await self.proc.wait()
            except TimeoutError:
                self._signal_group(signal.SIGKILL)
                await self.proc.wait()
        self._reap_group()
        return self.proc.returncode if self.proc.returncode is not None else -1


def kill_leftovers(work_dir: Path) -> int:
    """SIGKILL the process groups of container processes a dead kubelet left behind.

    A live pid is only killed when its start time matches its pid file.  Returns how many
    process groups were signalled; every pid file is removed.
    """
    killed = 0
    directory = pids_dir(work_dir)
    if not directory.is_dir():
        return 0
    for pid_file in sorted(directory.glob("*.json")):
        try:
            record = json.loads(pid_file.read_text())
            pid = int(record["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            pid = 0
        # The kernel never hands out a pid still in use as a process group id, so the group
        # is ours if its leader is alive with the recorded start time, or gone entirely (the
        # group may still hold the leader's children).  A live pid with another start time
        # was recycled after our group emptied: leave it alone.
        current = _start_time(pid) if pid > 0 else None
        if pid > 0 and (current is None or current == record.get("start_time")):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
                killed += 1
        with contextlib.suppress(FileNotFoundError):
            pid_file.unlink()
    return killed
