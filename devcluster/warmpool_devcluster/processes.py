"""Processes the dev cluster starts and stops: liveness, loopback ports, stopping a process group,
and the record a long-lived server (Prometheus, Jaeger) leaves so a later command finds it.

One module for what cluster.py, prometheus.py and jaeger.py each need, so a pid is always
judged alive, stopped and trusted the same way.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"


def alive(pid: int | None) -> bool:
    """The process runs (a zombie does not count)."""
    if pid is None or pid <= 0:  # never kill(0)/kill(-1): those address whole process groups
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); look at its state.
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return status != "Z"


def free_port(address: str = LOOPBACK) -> int:
    """A port on ``address`` (127.0.0.1 unless told) that nothing holds right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        port: int = sock.getsockname()[1]
        return port


def stop_pid(pid: int, grace: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after the grace period."""
    if pid <= 0:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not alive(pid):
                return
            time.sleep(0.1)


def _record_path(workdir: Path, program: str) -> Path:
    return workdir / f"{program}.json"


def _runs_program(pid: int, program: str) -> bool:
    """``pid`` is alive and is ``program`` (its argv[0]'s file name): a stale record must never
    make us trust, or stop, whatever reused the pid."""
    if not alive(pid):
        return False
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return Path(argv0.decode(errors="replace")).name == program


def record(workdir: Path, program: str, pid: int, urls: dict[str, str]) -> None:
    """Leave a record of a server left running after the command that started it."""
    workdir.mkdir(parents=True, exist_ok=True)
    _record_path(workdir, program).write_text(json.dumps({"pid": pid, "urls": urls}))


def recorded_urls(workdir: Path, program: str) -> dict[str, str] | None:
    """The URLs of the ``program`` recorded in ``workdir``, if that very process still runs."""
    try:
        data = json.loads(_record_path(workdir, program).read_text())
        pid, urls = int(data["pid"]), {str(k): str(v) for k, v in data["urls"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return urls if _runs_program(pid, program) else None


def forget(workdir: Path, program: str) -> None:
    """Drop the record (its process was stopped by whoever held it)."""
    _record_path(workdir, program).unlink(missing_ok=True)


def stop_recorded(workdir: Path, program: str) -> bool:
    """Stop the ``program`` recorded in ``workdir`` and drop the record; True if one ran."""
    path = _record_path(workdir, program)
    try:
        pid = int(json.loads(path.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        path.unlink(missing_ok=True)
        return False
    was_ours = _runs_program(pid, program)
    if was_ours:
        stop_pid(pid)
    forget(workdir, program)
    return was_ours


class CommandFailed(RuntimeError):
    """A long command run by :func:`run_logged` failed; the message has its log's tail."""


def run_logged(argv: list[str], log_path: Path, what: str, *, cwd: Path | None = None,
               env: dict[str, str] | None = None, prefix: str = "warmpool", beat_s: float = 30.0) -> None:
    """Run a long command with its output appended to ``log_path``, printing a heartbeat line to
    stderr every ``beat_s`` so a person sees the long step is alive; CommandFailed with the log's
    tail when it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log_path.open("ab") as log:
        log.write(f"$ {' '.join(argv)}  (in {cwd or Path.cwd()})\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env)
        last_beat = started
        while proc.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            if now - last_beat >= beat_s:
                print(f"[{prefix}]   still {what}: {now - started:.0f}s elapsed (log: {log_path})",
                      file=sys.stderr, flush=True)
                last_beat = now
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise CommandFailed(f"{what} failed (exit {proc.returncode}); log: {log_path}\n" + "\n".join(tail))
