"""A worker that cannot start leaves its last error where the kubelet reads it (the container's
termination message), so the WarmModel's conditions can say why (issue 42, item 4).

The worker CLI runs as a subprocess with --termination-message-path pointing at a file the test
made, as the kubelet makes /dev/termination-log for a container.  The model is a real tiny
checkpoint whose model.safetensors the worker may not read: mode 0600 and owned by someone else,
as `save_pretrained` leaves it for a pod that runs as another user.  Run as root (this machine's
tests do), the worker's process drops the capabilities that read past file modes.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
from warmpool_worker.termination import bounded, write_termination_message

from tests.support.procs import HOST, REPO, free_port, subprocess_env
from warmpool.contract.pods import TERMINATION_MESSAGE_MAX_BYTES

pytestmark = pytest.mark.integration

#: prctl(PR_CAPBSET_DROP) and the capabilities that let root read any file (linux/capability.h).
PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE = 1
CAP_DAC_READ_SEARCH = 2
NOBODY = 65534


def _as_a_plain_user() -> None:
    """In the child before exec: root keeps its uid but loses the right to read past file modes."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_worker_that_cannot_read_its_weights_exits_with_a_termination_message_naming_why(tmp_path: Path) -> None:
    from warmpool_dev.testing_models import make_tiny_llama

    model = tmp_path / "model"
    make_tiny_llama(model, layers=2)
    weights = model / "model.safetensors"
    weights.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(weights, NOBODY, NOBODY)  # another user's 0600 file
    termination = tmp_path / "termination-log"
    termination.touch()  # the kubelet makes it; the worker only writes what exists
    command = [sys.executable, "-m", "warmpool", "worker", "serve", "--model", str(model), "--host", HOST,
               "--port", str(free_port()), "--device", "cpu", "--termination-message-path", str(termination)]
    done = subprocess.run(command, env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=120,
                          preexec_fn=_as_a_plain_user)
    assert done.returncode == 1, done.stderr[-3000:]
    message = termination.read_text()
    assert str(weights) in message and "Permission denied" in message, (message, done.stderr[-3000:])
    assert "cannot read" in message and len(message.encode()) <= TERMINATION_MESSAGE_MAX_BYTES
    # The log's last line says only that it stopped: the message is the error, not that.
    assert "worker stopped" in done.stderr.strip().splitlines()[-1]


def test_a_bad_flag_value_is_the_termination_message_too(tmp_path: Path) -> None:
    termination = tmp_path / "termination-log"
    termination.touch()
    model = tmp_path / "model"
    model.mkdir()
    command = [sys.executable, "-m", "warmpool", "worker", "serve", "--model", str(model), "--port", "0",
               "--warmup-timeout", "-1", "--termination-message-path", str(termination)]
    done = subprocess.run(command, env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert termination.read_text().startswith("invalid configuration: ") and "warmup" in termination.read_text()


def test_outside_a_pod_no_termination_file_is_made_and_the_message_is_bounded(tmp_path: Path) -> None:
    missing = tmp_path / "termination-log"
    assert not write_termination_message(missing, "boom") and not missing.exists()
    missing.touch()
    long = "é" * TERMINATION_MESSAGE_MAX_BYTES  # two bytes each
    assert write_termination_message(missing, long)
    written = missing.read_bytes()
    assert written.decode() == "é" * (TERMINATION_MESSAGE_MAX_BYTES // 2)  # cut between characters
    assert bounded("short") == b"short"
