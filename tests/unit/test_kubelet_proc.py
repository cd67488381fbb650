"""Container processes: own process group, pid files, graceful stop, and cleanup after a crash."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warmpool_devcluster.kubelet_proc import ContainerProcess, container_log_path, kill_leftovers, resolve_command

pytestmark = pytest.mark.unit


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"


def test_resolve_command_uses_path() -> None:
    assert resolve_command("sh", os.environ.get("PATH")) is not None
    assert resolve_command("warmpool-surely-not-a-command", os.environ.get("PATH")) is None
    assert resolve_command(sys.executable, None) == sys.executable
    assert resolve_command("/nonexistent/bin/x", None) is None


async def test_stop_escalates_to_sigkill_and_takes_the_group(tmp_path: Path) -> None:
    log = container_log_path(tmp_path, "ns", "pod", "c")
    # The shell ignores SIGTERM and leaves a child in its group: both must go.
    script = "trap '' TERM; sleep 300 & echo CHILDPID=$!; wait"
    proc = await ContainerProcess.start(["sh", "-c", script], dict(os.environ), str(tmp_path), log, tmp_path, "t")
    assert proc.pid_file.is_file() and json.loads(proc.pid_file.read_text())["pid"] == proc.pid
    assert os.getpgid(proc.pid) == proc.pid  # its own session and group
    found = None
    for _ in range(100):
        found = re.search(r"CHILDPID=(\d+)", log.read_text())
        if found:
            break
        await asyncio.sleep(0.05)
    assert found, log.read_text()
    child = int(found.group(1))
    started = time.monotonic()
    code = await proc.stop(grace=0.5)
    assert time.monotonic() - started < 3
    assert code == -signal.SIGKILL
    assert not proc.pid_file.exists()
    await asyncio.sleep(0.1)
    assert not _alive(child)


def test_kill_leftovers_after_a_crashed_kubelet(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    orphan = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        stat = Path(f"/proc/{orphan.pid}/stat").read_text().rsplit(")", 1)[-1].split()
        (pids / "ns.pod.c.1.json").write_text(json.dumps({"pid": orphan.pid, "start_time": stat[19]}))
        # A recycled pid (same number, other start time) must be left alone.
        (pids / "ns.pod.c.2.json").write_text(json.dumps({"pid": os.getpid(), "start_time": "1"}))
        assert kill_leftovers(tmp_path) == 1
        assert orphan.wait(timeout=5) == -signal.SIGKILL
        assert list(pids.iterdir()) == []
        assert kill_leftovers(tmp_path / "absent") == 0
    finally:
        if orphan.poll() is None:
            orphan.kill()
