"""The node agent's own endpoints (nodecache/warmpool_nodecache/agent_http.py), as `warmpool node-agent`
runs them, on a real API server (the api_server fixture: no node, no controllers).

A WarmModel whose source the agent may not read (loopback, refused by its address policy before any
packet leaves) is a failed fill at the manifest stage: counted on the agent's metrics port, labelled
with the WarmModel, which the chart's alert on failed fills reads.  /healthz answers at once, /readyz
once a pass finished."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from warmpool_devcluster.testing import ClusterHandle

from tests.integration.test_node_agent import http_warmmodel
from warmpool.contract.metrics import METRIC_NODE_AGENT_FILL_FAILURES, NODE_AGENT_STAGE_MANIFEST

pytestmark = pytest.mark.integration

#: Bound of every wait: a pass runs every second here.
WAIT_S = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()
    except (urllib.error.URLError, OSError) as error:
        return 0, str(error)


def _fill_failures(text: str, namespace: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == METRIC_NODE_AGENT_FILL_FAILURES
               and sample.labels == {"namespace": namespace, "warmmodel": "unreadable",
                                     "stage": NODE_AGENT_STAGE_MANIFEST})


def test_the_agent_serves_probes_and_counts_a_failed_fill(api_server: ClusterHandle, tmp_path: Path) -> None:
    namespace = f"agent-endpoints-{uuid.uuid4().hex[:6]}"
    api_server.kubectl("create", "namespace", namespace)
    body = http_warmmodel("unreadable", "http://127.0.0.1:9/model", "agent-endpoints-node")
    api_server.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    health, metrics = _free_port(), _free_port()
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmpool", "node-agent", "--node-name", "agent-endpoints-node",
             "--cache-root", str(tmp_path / "cache"), "--namespace", namespace, "--lease-namespace", namespace,
             "--interval", "1", "--bind", "127.0.0.1", "--health-port", str(health), "--metrics-port", str(metrics)],
            env={**os.environ, "KUBECONFIG": str(api_server.kubeconfig), "PYTHONUNBUFFERED": "1"},
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT_S
        seen: dict[str, object] = {}
        while not (seen.get("ready") == 200 and float(str(seen.get("failures", 0))) >= 1):
            assert proc.poll() is None, f"the agent exited:\n{log.read_text(errors='replace')}"
            assert time.monotonic() < deadline, f"after {WAIT_S:g}s: {seen}\n{log.read_text(errors='replace')}"
            time.sleep(0.3)
            seen["live"], _ = _get(health, "/healthz")
            seen["ready"], _ = _get(health, "/readyz")
            code, text = _get(metrics, "/metrics")
            seen["failures"] = _fill_failures(text, namespace) if code == 200 else 0
        assert seen["live"] == 200, seen
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        api_server.kubectl("delete", "namespace", namespace, "--wait=false")
