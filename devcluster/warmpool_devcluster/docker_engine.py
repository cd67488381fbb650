"""A Docker engine of the dev tools' own, for building the project's images on this machine.

Debian's ``docker.io`` dockerd, started on demand with its data, state and socket under the
machine-wide cache (so built images and their layer cache survive between runs, and a Docker
engine the developer runs elsewhere is never touched), and stopped again by whoever started it.
Builds need no container network (``--network host`` reaches the loopback wheelhouse), so it runs
with no bridge and no iptables rules of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from warmpool_dev.paths import cache_root

from warmpool_devcluster import processes

DOCKERD = Path("/usr/sbin/dockerd")
#: Debian's client, of the daemon's own version (another docker client on PATH may be newer).
DOCKER_CLIENT = Path("/usr/bin/docker")
START_TIMEOUT_S = 60.0


class DockerError(RuntimeError):
    """The image builder could not run; the message says what to do."""


def engine_dir() -> Path:
    return cache_root() / "docker"


def socket_path() -> Path:
    return engine_dir() / "run" / "docker.sock"


@dataclass
class DockerEngine:
    """A running dockerd and how to reach it."""

    socket: Path
    pid: int | None  # ours to stop, or None when it was already running

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "0"}

    def argv(self, *args: str) -> list[str]:
        client = DOCKER_CLIENT if DOCKER_CLIENT.exists() else Path(shutil.which("docker") or "docker")
        return [str(client), *args]

    def run(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout)

    def has_image(self, reference: str) -> bool:
        return self.run("image", "inspect", "--format", "{{.Id}}", reference).returncode == 0

    def image_id(self, reference: str) -> str:
        proc = self.run("image", "inspect", "--format", "{{.Id}}", reference)
        if proc.returncode != 0:
            raise DockerError(f"image {reference} is not in the build engine: {proc.stderr.strip()}")
        return proc.stdout.strip()


def _answers(socket: Path) -> bool:
    if not socket.exists():
        return False
    probe = DockerEngine(socket, None)
    return probe.run("version", "--format", "{{.Server.Version}}", timeout=15).returncode == 0


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    """One command at a time starts, uses and stops the engine (two `images build` at once would
    otherwise race to start it, and the first to finish would stop it under the other)."""
    path = engine_dir() / "lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def engine() -> Iterator[DockerEngine]:
    """The dev tools' dockerd: the running one, or one started now and stopped on exit."""
    if not DOCKERD.exists():
        raise DockerError(f"{DOCKERD} is missing: install the host packages first (`make host-packages`, "
                          "which installs Debian's docker.io)")
    if os.geteuid() != 0:
        raise DockerError("building images needs root (dockerd runs as root on this machine)")
    with _lock():
        socket = socket_path()
        if _answers(socket):
            yield DockerEngine(socket, None)
            return
        root = engine_dir()
        for sub in ("data", "exec", "run"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        socket.unlink(missing_ok=True)
        log = root / "dockerd.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [str(DOCKERD), "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
                 "--host", f"unix://{socket}", "--pidfile", str(root / "run" / "docker.pid"),
                 "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-masq=false"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _answers(socket):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                    raise DockerError(f"dockerd did not start (log {log}):\n{tail}")
                time.sleep(0.5)
            yield DockerEngine(socket, proc.pid)
        finally:
            processes.stop_pid(proc.pid, grace=30.0)
