"""A standby operator serves /metrics while it waits for the leader Lease (app/cli.py).

Only the holder used to serve it, so with two replicas one scrape target was down for ever and
kube-prometheus-stack's TargetDown fired.  Here `warmpool operator --leader-elect` runs against the
real API server (the api_server fixture, no node) while another identity holds the Lease for an hour:
it must wait, and answer its metrics port with the process figures meanwhile."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from warmpool_devcluster.testing import ClusterHandle

pytestmark = pytest.mark.integration

LEASE = "warmpool-operator"
#: Bound of the waits: the standby starts in a few seconds.
WAIT_S = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _metrics(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return str(response.read().decode())
    except (urllib.error.URLError, OSError):
        return None


def test_a_standby_waiting_for_the_lease_answers_its_metrics_port(api_server: ClusterHandle, tmp_path: Path) -> None:
    namespace = "standby-metrics"
    api_server.kubectl("create", "namespace", namespace)
    held = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": LEASE},
            "spec": {"holderIdentity": "the-leader-1-abcdef", "leaseDurationSeconds": 3600, "leaseTransitions": 0}}
    api_server.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(held))
    port = _free_port()
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmpool", "operator", "--namespace", namespace, "--leader-elect",
             "--leader-election-namespace", namespace, "--leader-election-name", LEASE, "--bind", "127.0.0.1",
             "--metrics-port", str(port), "--liveness-port", "0"],
            env={**os.environ, "KUBECONFIG": str(api_server.kubeconfig), "PYTHONUNBUFFERED": "1"},
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT_S
        text = None
        while text is None or "waiting for the Lease" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"the operator exited:\n{log.read_text(errors='replace')}"
            assert time.monotonic() < deadline, f"no standby metrics after {WAIT_S:g}s:\n{log.read_text()}"
            time.sleep(0.2)
            text = _metrics(port)
        assert "process_cpu_seconds_total" in text, text[:2000]
        assert "holds the Lease" not in log.read_text(errors="replace"), "the standby took a Lease held for an hour"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
