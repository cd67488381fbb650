"""The operator stops on SIGTERM as it runs in its container: PID 1 of a PID namespace of its own.

The kernel drops a signal PID 1 has no handler for.  A standby waiting for the leader Lease had
none (kopf installs its own only once it runs), so a standby pod deleted in a rollout ignored the
kubelet's SIGTERM, went on, took the Lease and acted for the rest of its 30 s grace period, and
was SIGKILLed holding it: the next replica then waited out the Lease, and what the killed one had
measured (a served burst's demand and capacity) was lost.  Here the operator runs under
``unshare --pid --fork`` (PID 1 of a new PID namespace), against the real API server: told to stop
as a standby it exits and leaves the Lease alone; told to stop as the holder it hands the Lease on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.testing import ClusterHandle

pytestmark = pytest.mark.integration

LEASE = "warmpool-operator"
OTHER = "another-replica-1-abcdef"
#: Bound of every wait here: far longer than the stop needs, far shorter than "never".
WAIT_S = 30.0


class PidOne:
    """`warmpool operator` as PID 1 of a PID namespace of its own; its output in ``log``."""

    def __init__(self, cluster: ClusterHandle, namespace: str, log: Path) -> None:
        self.log = log
        unshare = shutil.which("unshare")
        assert unshare is not None, "util-linux's unshare runs the operator as PID 1"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [unshare, "--pid", "--fork", "--kill-child", sys.executable, "-m", "warmpool", "operator",
                 "--namespace", namespace, "--leader-elect", "--leader-election-namespace", namespace,
                 "--leader-election-name", LEASE, "--metrics-port", "0", "--health-port", "0"],
                env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONUNBUFFERED": "1"},
                stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, what: str, check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not check():
            exited = self.proc.poll()
            assert exited is None, f"the operator exited ({exited}) before {what}:\n{self.text()}"
            assert time.monotonic() < deadline, f"timed out after {WAIT_S:g}s waiting for {what}:\n{self.text()}"
            time.sleep(0.2)

    def pid_one(self) -> int:
        """The operator's host PID: unshare's one child (PID 1 inside its namespace)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        assert len(children) == 1, f"unshare should have one child, has {children}"
        status = Path(f"/proc/{children[0]}/status").read_text().splitlines()
        (nspid,) = [line.split()[1:] for line in status if line.startswith("NSpid:")]
        assert nspid[-1] == "1", f"the operator is not PID 1 of its namespace: NSpid {nspid}"
        return int(children[0])

    def terminate(self) -> int:
        """SIGTERM to the operator itself, as the kubelet sends it; its exit status."""
        os.kill(self.pid_one(), signal.SIGTERM)
        try:
            return self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # --kill-child: the operator goes with it
            self.proc.wait(timeout=10)
            raise AssertionError(f"the operator ignored SIGTERM for {WAIT_S:g}s:\n{self.text()}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture()
def pid_one(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[Callable[[], PidOne]]:
    if os.geteuid() != 0:
        pytest.skip("a new PID namespace needs root (CI runs as root)")
    started: list[PidOne] = []

    def start() -> PidOne:
        started.append(PidOne(cluster, namespace, tmp_path / f"operator-{len(started)}.log"))
        return started[-1]

    try:
        yield start
    finally:
        for proc in started:
            proc.close()


def _lease(cluster: ClusterHandle, namespace: str) -> dict[str, Any]:
    lease = json.loads(cluster.kubectl("get", "lease", LEASE, "-n", namespace, "-o", "json").stdout)
    spec: dict[str, Any] = lease["spec"]
    return spec


def test_a_standby_and_a_holder_stop_on_sigterm_as_pid_one(
        cluster: ClusterHandle, namespace: str, pid_one: Callable[[], PidOne]) -> None:
    # Another replica holds the Lease, for an hour: this one can only wait.
    held = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": LEASE},
            "spec": {"holderIdentity": OTHER, "leaseDurationSeconds": 3600, "leaseTransitions": 0}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(held))
    standby = pid_one()
    standby.wait_for("the standby to wait for the Lease", lambda: "waiting for the Lease" in standby.text())
    assert standby.terminate() == 0, standby.text()
    assert "SIGTERM: stopped" in standby.text()
    assert "holds the Lease" not in standby.text(), "the standby took the Lease after SIGTERM"
    assert _lease(cluster, namespace)["holderIdentity"] == OTHER, "a stopped standby left the Lease alone"

    # The other replica is gone (its Lease released): this one takes it, acts, and hands it on when told to stop.
    cluster.kubectl("patch", "lease", LEASE, "-n", namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"holderIdentity": "", "leaseDurationSeconds": 1}}))
    holder = pid_one()
    holder.wait_for("the replica to hold the Lease and kopf to run (its start-up handlers done)",
                    lambda: "holds the Lease" in holder.text() and "Activity 'connect' succeeded" in holder.text())
    identity = _lease(cluster, namespace)["holderIdentity"]
    assert identity and identity != OTHER
    assert holder.terminate() == 0, holder.text()
    assert "released the Lease" in holder.text(), holder.text()
    assert _lease(cluster, namespace)["holderIdentity"] == "", "the holder handed the Lease on"
