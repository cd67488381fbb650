"""Smoke test of the local cluster: kwok nodes + our local kubelet against the real API server.

Pods here run ``python3`` HTTP servers as local processes on their loopback pod IPs; the
assertions are about what a kubelet must get right: Ready only after the readiness probe
passes, unready while it fails, restarts on liveness failure, a clear Waiting reason for
a command that cannot run, and no process left once the Deployment is deleted.
"""

from __future__ import annotations

import calendar
import json
import random
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import yaml
from warmpool_devcluster.testing import ClusterHandle

pytestmark = pytest.mark.integration

T = TypeVar("T")

#: The pods' port. Each pod has its own IP, but another local cluster on this machine (a
#: developer's, a parallel CI job) may hand out the same loopback IPs: a port of our own
#: keeps the two from answering each other's probes.
PORT = random.randint(20000, 60000)

#: Seconds the slow server answers /ready with 503 before it turns 200.
READY_AFTER = 6

#: A server on the pod IP (downward API) that turns ready READY_AFTER seconds after start;
#: the delay comes from a configMap volume file, so the mount-path rewrite is exercised too.
SLOW_SERVER = textwrap.dedent(
    """
    import http.server, os, time
    started = time.time()
    delay = float(open("/etc/slow/ready-after").read())
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path != "/ready" or time.time() - started >= delay
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"warming")
    print("serving on", os.environ["POD_IP"], "ready after", delay, flush=True)
    http.server.ThreadingHTTPServer((os.environ["POD_IP"], int(os.environ["PORT"])), Handler).serve_forever()
    """
)


def _needs_local_kubelet(cluster: ClusterHandle) -> None:
    if cluster.work_dir is None:
        pytest.skip("runs pods as local processes: needs our own cluster, not WARMPOOL_KUBECONFIG")


def _apply(cluster: ClusterHandle, namespace: str, *objects: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objects))


def _pods(cluster: ClusterHandle, namespace: str, selector: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def _condition(pod: dict[str, Any], kind: str) -> str | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition["type"] == kind:
            return str(condition["status"])
    return None


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    status: dict[str, Any] = statuses[0]
    return status


def _logs(cluster: ClusterHandle, namespace: str) -> str:
    """Every container log of the namespace, tails only, for failure messages."""
    if cluster.work_dir is None:
        return ""
    parts = []
    for path in sorted((cluster.work_dir / "pods" / namespace).glob("*/*.log")):
        tail = "\n".join(path.read_text(errors="replace").splitlines()[-30:])
        parts.append(f"--- {path}\n{tail}")
    return "\n".join(parts) or "(no container logs)"


def _wait(
    cluster: ClusterHandle, namespace: str, what: str, probe: Callable[[], T | None], timeout: float = 60.0
) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value is not None and value is not False:
            return value
        time.sleep(0.5)
    pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "yaml", check=False).stdout
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{pods}\n{_logs(cluster, namespace)}")


def _answers(ip: str, path: str = "/") -> int | None:
    """HTTP status from the pod's server (loopback only), or None when nothing listens."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{PORT}{path}", timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _server_container(name: str, command: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "image": "python:3.11-slim",  # never pulled: the local kubelet runs the command itself
        "command": command,
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "PORT", "value": str(PORT)}],
        "ports": [{"name": "http", "containerPort": PORT}],
        **extra,
    }


def test_deployment_becomes_ready_only_after_its_readiness_probe(cluster: ClusterHandle, namespace: str) -> None:
    _needs_local_kubelet(cluster)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "slow"},
                  "data": {"ready-after": str(READY_AFTER)}}
    container = _server_container(
        "web", ["python3", "-c", SLOW_SERVER],
        volumeMounts=[{"name": "slow", "mountPath": "/etc/slow"}],
        readinessProbe={"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
    )
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "slow"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "slow"}},
            "template": {
                "metadata": {"labels": {"app": "slow"}},
                "spec": {"terminationGracePeriodSeconds": 5, "containers": [container],
                         "volumes": [{"name": "slow", "configMap": {"name": "slow"}}]},
            },
        },
    }
    _apply(cluster, namespace, config_map, deployment)

    def running() -> dict[str, Any] | None:
        pods = _pods(cluster, namespace, "app=slow")
        return pods[0] if pods and "running" in (_container(pods[0]).get("state") or {}) else None

    pod = _wait(cluster, namespace, "the slow server to run", running)
    ip = pod["status"]["podIP"]
    assert ip.startswith("127."), f"pod IPs must be loopback, got {ip}"
    # The process is up but still warming: the pod must not be Ready yet.
    assert _condition(pod, "Ready") == "False", pod["status"]
    assert _answers(ip, "/ready") in (None, 503)

    def ready() -> dict[str, Any] | None:
        pods = _pods(cluster, namespace, "app=slow")
        return pods[0] if pods and _condition(pods[0], "Ready") == "True" else None

    pod = _wait(cluster, namespace, "the Deployment's pod to become Ready", ready)
    assert _answers(ip, "/ready") == 200
    status = _container(pod)
    assert status["ready"] is True and status["started"] is True and status["restartCount"] == 0
    became_ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")["lastTransitionTime"]
    started = status["state"]["running"]["startedAt"]
    waited = calendar.timegm(time.strptime(became_ready, "%Y-%m-%dT%H:%M:%SZ")) - calendar.timegm(
        time.strptime(started, "%Y-%m-%dT%H:%M:%SZ"))
    assert waited >= READY_AFTER - 1, f"Ready {waited:.0f}s after start; the probe passes after {READY_AFTER}s"
    _wait(cluster, namespace, "the Deployment to count the replica available", lambda: cluster.kubectl(
        "get", "deployment", "slow", "-n", namespace, "-o", "jsonpath={.status.availableReplicas}",
    ).stdout.strip() == "1")

    cluster.kubectl("delete", "deployment", "slow", "-n", namespace, "--wait=false")
    _wait(cluster, namespace, "the deleted Deployment's server to stop answering", lambda: _answers(ip) is None)
    _wait(cluster, namespace, "the deleted Deployment's pod to go away",
          lambda: not _pods(cluster, namespace, "app=slow"), timeout=60)


def test_failing_probes_keep_a_pod_unready_and_liveness_restarts_it(
    cluster: ClusterHandle, namespace: str
) -> None:
    _needs_local_kubelet(cluster)
    server = ["python3", "-m", "http.server", "--bind", "$(POD_IP)", "$(PORT)"]
    never_ready = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "never-ready", "labels": {"case": "unready"}},
        "spec": {"terminationGracePeriodSeconds": 2, "containers": [_server_container(
            "web", server, readinessProbe={"httpGet": {"path": "/missing", "port": "http"}, "periodSeconds": 1},
        )]},
    }
    not_alive = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "not-alive", "labels": {"case": "liveness"}},
        "spec": {"terminationGracePeriodSeconds": 2, "containers": [_server_container(
            "web", server,
            readinessProbe={"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
            livenessProbe={"httpGet": {"path": "/missing", "port": "http"}, "periodSeconds": 1,
                           "failureThreshold": 2, "initialDelaySeconds": 1},
        )]},
    }
    _apply(cluster, namespace, never_ready, not_alive)

    def restarted() -> dict[str, Any] | None:
        pods = _pods(cluster, namespace, "case=liveness")
        return pods[0] if pods and _container(pods[0]).get("restartCount", 0) > 0 else None

    pod = _wait(cluster, namespace, "the liveness failure to restart the container", restarted)
    last = _container(pod)["lastState"]["terminated"]
    assert last["exitCode"] != 0 and last["reason"] == "Error"

    # Meanwhile the pod whose readiness probe 404s is running but never Ready.
    seen_running = 0
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        pod = _pods(cluster, namespace, "case=unready")[0]
        assert _condition(pod, "Ready") != "True", pod["status"]
        assert _container(pod).get("ready") is not True
        seen_running += "running" in (_container(pod).get("state") or {})
        time.sleep(1)
    assert seen_running, f"the never-ready server never ran\n{_logs(cluster, namespace)}"
    assert pod["status"]["phase"] == "Running"
    assert _answers(pod["status"]["podIP"], "/missing") == 404


def test_a_command_that_cannot_run_here_stays_waiting(cluster: ClusterHandle, namespace: str) -> None:
    _needs_local_kubelet(cluster)
    manifest: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "no-such-command", "labels": {"case": "waiting"}},
        "spec": {"containers": [{"name": "engine", "image": "vllm/vllm-openai",
                                 "command": ["warmpool-no-such-binary", "serve"]}]},
    }
    _apply(cluster, namespace, manifest)

    def waiting() -> dict[str, Any] | None:
        pods = _pods(cluster, namespace, "case=waiting")
        if not pods:
            return None
        state: dict[str, Any] = (_container(pods[0]).get("state") or {}).get("waiting") or {}
        return state if state.get("reason") == "CommandNotRunnable" else None

    reason = _wait(cluster, namespace, "a CommandNotRunnable Waiting state", waiting)
    assert "warmpool-no-such-binary" in reason["message"]
    pod = _pods(cluster, namespace, "case=waiting")[0]
    assert pod["status"]["phase"] == "Pending" and _condition(pod, "Ready") == "False"
