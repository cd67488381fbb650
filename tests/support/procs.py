"""Helpers of the tests that run the worker or the sidecar as a local subprocess on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port free on ``host`` right now (the subprocess binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def subprocess_env() -> dict[str, str]:
    """This process's environment for a child ``python -m warmpool``: the repo's packages on
    PYTHONPATH, and no POD_IP (a test's process is not a pod)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "worker"), str(REPO / "operator"), str(REPO / "devcluster"), str(REPO / "dev"),
         env.get("PYTHONPATH", "")]
    )
    env.pop("POD_IP", None)
    return env


def stop(proc: subprocess.Popen[Any], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
