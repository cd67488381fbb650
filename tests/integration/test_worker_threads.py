"""A real worker process sizes torch's intra-op threads from --threads or the cgroup's cpu.max.

The worker logs torch's own reading back (`torch.get_num_threads()` after setting it), so
the line shows what torch will use.  Only 127.0.0.1 is addressed; every wait is bounded.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.procs import HOST, REPO, free_port, stop, subprocess_env

pytestmark = pytest.mark.integration

THREADS_LINE = re.compile(r"torch intra-op threads: (\d+) \(from (.*)\)")


def _threads_logged(model: Path, log_path: Path, *extra: str, timeout: float = 90.0,
                    until: str | None = None) -> tuple[int, str]:
    """Start `warmpool worker serve`, wait (bounded) for its threads line (and `until`, when given), stop it."""
    command = [sys.executable, "-m", "warmpool", "worker", "serve", "--model", str(model), "--host", HOST,
               "--port", str(free_port()), "--device", "cpu", "--buckets", "16", "--prompts-per-bucket", "1",
               *extra]
    env = subprocess_env()
    env.pop("OMP_NUM_THREADS", None)  # an explicit one would win over the cgroup (tested in unit)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                text = log_path.read_text(errors="replace")
                match = THREADS_LINE.search(text)
                if match and (until is None or until in text):
                    return int(match.group(1)), match.group(2)
                if proc.poll() is not None:
                    break
                time.sleep(0.2)
            raise AssertionError(f"no threads line (exit {proc.poll()}):\n{log_path.read_text(errors='replace')}")
        finally:
            stop(proc)


def test_threads_flag_sets_torchs_thread_count(tiny_model: Path, tmp_path: Path) -> None:
    threads, source = _threads_logged(tiny_model, tmp_path / "worker.log", "--threads", "1")
    assert (threads, source) == (1, "--threads")


def test_cgroup_cpu_quota_sets_torchs_thread_count(tiny_model: Path, tmp_path: Path) -> None:
    # A cgroup v2 tree of our own: one CPU of quota at its root.  Whatever this process's
    # cgroup path is, the walk up ends at the root, so its cpu.max applies.
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cpu.max").write_text("100000 100000\n")
    threads, source = _threads_logged(tiny_model, tmp_path / "worker.log", "--cgroup-root", str(root))
    assert threads == 1
    assert str(root / "cpu.max") in source and "'100000 100000'" in source


def test_no_quota_uses_the_cpus_the_process_may_run_on(tiny_model: Path, tmp_path: Path) -> None:
    import os

    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cpu.max").write_text("max 100000\n")
    threads, _ = _threads_logged(tiny_model, tmp_path / "worker.log", "--cgroup-root", str(root))
    assert threads == len(os.sched_getaffinity(0))


def test_torch_is_imported_and_sized_before_the_server_binds(tiny_model: Path, tmp_path: Path) -> None:
    # As --device auto always did (it needs torch to resolve the device): a request served while
    # torch imports would take the GIL from the import (builtin.torch_start).
    log_path = tmp_path / "worker.log"
    _threads_logged(tiny_model, log_path, "--threads", "1", until="listening on ")
    text = log_path.read_text(errors="replace")
    assert 0 <= text.index("torch intra-op threads: 1") < text.index("listening on "), text
