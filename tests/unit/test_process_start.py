"""The worker's process start (the cold start's first instant): from the kernel, to the hundredth
of a second, for the process itself and for a fake /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warmpool_worker.metrics import process_start_time

pytestmark = pytest.mark.unit

#: How far the start may fall outside [spawned, asked]: rounding plus clock skew, far below a process start.
SLACK_S = 0.25
REPORT = ("import json, time; from warmpool_worker.metrics import process_start_time; "
          "print(json.dumps([process_start_time(), time.time()]))")


def test_a_fresh_process_starts_after_it_was_spawned_and_before_it_asks() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(3):  # a start from whole-second boot time would fall before the spawn most times
        spawned = time.time()
        out = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True, env=env,
                             timeout=60, check=True).stdout
        started, asked = json.loads(out)
        # The kernel counts in clock ticks (10 ms) and /proc/uptime in hundredths: 20 ms of rounding.  The
        # rest of the slack is the wall clock against the boot clock (an NTP slew moves one, not the other):
        # the bound says "this process's own start", not how fast a process starts on a busy machine.
        assert spawned - SLACK_S <= started <= asked + SLACK_S, (spawned, started, asked)


def test_the_start_is_the_ticks_since_boot_before_now(tmp_path: Path) -> None:
    hertz = os.sysconf("SC_CLK_TCK")
    (tmp_path / "self").mkdir()
    # The command name may hold spaces and parentheses; the start (field 22) is 12.5 s after boot.
    rest = ["S"] + ["0"] * 18 + [str(int(12.5 * hertz))] + ["0"] * 30
    (tmp_path / "self" / "stat").write_text("4242 (a (weird) name) " + " ".join(rest) + "\n")
    (tmp_path / "uptime").write_text("100.25 350.00\n")
    before = time.time()
    started = process_start_time(tmp_path)
    assert before - 87.75 - 0.01 <= started <= time.time() - 87.75 + 0.01


def test_without_linux_proc_it_is_now(tmp_path: Path) -> None:
    before = time.time()
    assert before <= process_start_time(tmp_path) <= time.time()
