"""Two operator replicas as the chart runs them: two pods of the operator image on the real node,
one holding the leader Lease and acting, the other waiting.  The leader's pod is deleted, then the
next leader's process is SIGKILLed in its container: each time the other replica takes over, no
child is made twice, and the pool never drops below minWarm Ready pods.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_devcluster import build
from warmpool_devcluster.chart_values import local_values
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import Operator, World, delete_warmmodels, model_root, pod_ready, warmmodel

pytestmark = pytest.mark.integration

CHART = Path(__file__).resolve().parents[2] / "helm" / "warmpool"
STEADY_MEMORY = [f"--memory-capacity-bytes={64 * 1024**3}"]


class InstalledOperator:
    """The chart's operator pods in the test's namespace, and their leader Lease."""

    def __init__(self, cluster: ClusterHandle, namespace: str, release: str) -> None:
        self.cluster, self.namespace, self.release = cluster, namespace, release
        self.selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator"

    def pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = json.loads(self.cluster.kubectl(
            "get", "pods", "-n", self.namespace, "-l", self.selector, "-o", "json").stdout)["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def holder(self) -> str:
        lease = json.loads(self.cluster.kubectl("get", "lease", f"{self.release}-warmpool", "-n", self.namespace,
                                                "-o", "json").stdout)
        return str(lease["spec"].get("holderIdentity") or "")

    def transitions(self) -> int:
        lease = json.loads(self.cluster.kubectl("get", "lease", f"{self.release}-warmpool", "-n", self.namespace,
                                                "-o", "json").stdout)
        return int(lease["spec"].get("leaseTransitions") or 0)

    def leader_pod(self) -> dict[str, Any]:
        holder = self.holder()
        (pod,) = [p for p in self.pods() if holder.startswith(p["metadata"]["name"] + "-")]
        return pod


def _helm(cluster: ClusterHandle, *args: str) -> None:
    helm = str(build.ensure_binaries(["helm"])["helm"])
    proc = subprocess.run([helm, "--kubeconfig", str(cluster.kubeconfig), *args], capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, f"helm {' '.join(args[:2])}:\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture()
def installed(cluster: ClusterHandle, namespace: str, crd: str) -> Iterator[tuple[World, InstalledOperator]]:
    if cluster.node is None:
        pytest.skip("installs the checkout's images: needs the local cluster's real node")
    release = f"ha{uuid.uuid4().hex[:6]}"
    values = local_values(cluster.images, cluster.node.pod_cidr)
    values |= {"crds": {"install": False}, "watch": {"namespaces": [namespace]},
               "operator": {**values["operator"], "replicas": 2, "scrapeInterval": 2,
                            "allowedHostPaths": [str(model_root())]},
               "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
               "probes": {"readiness": {"initialDelaySeconds": 1, "periodSeconds": 2, "timeoutSeconds": 5,
                                        "failureThreshold": 3}}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as handle:
        yaml.safe_dump(values, handle)
        handle.flush()
        _helm(cluster, "install", release, str(CHART), "-n", namespace, "-f", handle.name, "--wait", "--timeout",
              "300s")
    operator = InstalledOperator(cluster, namespace, release)
    logs = Operator(cluster, namespace, Path(os.devnull), installed=True)  # World's diagnostics read its pods' logs
    logs.installed_namespace = namespace
    world = World(cluster, namespace, logs, diagnose_timeouts=True)
    try:
        world.wait(lambda: operator.holder(), 90, "one operator pod to hold the leader Lease")
        yield world, operator
    finally:
        delete_warmmodels(cluster, namespace)
        _helm(cluster, "uninstall", release, "-n", namespace, "--wait", "--timeout", "120s")
        world.close()


def _watch_ready(world: World, name: str, stop: threading.Event, counts: list[int]) -> None:
    deadline = time.monotonic() + 300  # bounded: stops when told, or after 300 s at most
    while not stop.is_set() and time.monotonic() < deadline:
        counts.append(sum(pod_ready(p) for p in world.pods(name)))
        time.sleep(0.3)


def _children_once(world: World, name: str) -> None:
    kids = world.children(name)
    assert kids["deployments"] == [name] and kids["services"] == [name] and kids["poddisruptionbudgets"] == [name]
    assert kids["configmaps"] == [f"{name}-warmup"] and kids["secrets"] == [f"{name}-control"]


def test_the_standby_pod_takes_over_when_the_leader_pod_is_deleted_or_killed(
    installed: tuple[World, InstalledOperator], tiny_model: Path
) -> None:
    world, operator = installed
    world.apply(warmmodel("ha", tiny_model, replicas=2, min_warm=2, max_replicas=3, worker_args=STEADY_MEMORY))
    world.wait_ready("ha", warm=2, timeout=240)
    first = operator.leader_pod()
    (standby,) = [p for p in operator.pods() if p["metadata"]["name"] != first["metadata"]["name"]]
    standby_log = world.cluster.kubectl("logs", "-n", world.ns, standby["metadata"]["name"]).stdout
    assert "Handler" not in standby_log, "the standby acted"  # only the holder runs handlers

    counts: list[int] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_ready, args=(world, "ha", stop, counts), daemon=True)
    watcher.start()
    try:
        # 1. The leader's pod deleted (a drain, a rollout): another replica takes the Lease.
        before = operator.transitions()
        world.kubectl("delete", "pod", first["metadata"]["name"], "--wait=false")
        # The standby, or the pod the Deployment starts in the deleted one's place: whichever reads
        # the expired Lease first (both poll it every retry period).
        gone = first["metadata"]["name"] + "-"
        world.wait(lambda: (holder := operator.holder()) != "" and not holder.startswith(gone), 90,
                   "another operator pod taking the Lease after the leader pod's deletion")
        assert operator.transitions() > before
        second = operator.leader_pod()

        # 2. The new leader's process SIGKILLed in its container (a crash, an OOM kill): the
        # other pod, by now a standby, takes over once the Lease expires.
        world.wait(lambda: len([p for p in operator.pods() if pod_ready(p)]) == 2, 120,
                   "a second operator pod Ready again (the Deployment replaced the deleted one)")
        # Read again now that it is Ready: the leader may be the replacement pod, whose container had
        # no ID yet when the Lease changed hands.
        second = json.loads(world.kubectl("get", "pod", second["metadata"]["name"], "-o", "json"))
        (container,) = second["status"]["containerStatuses"]
        assert world.cluster.node is not None
        killed_holder, before = operator.holder(), operator.transitions()
        os.kill(world.cluster.node.container_pid(container["containerID"]), signal.SIGKILL)
        # The holder identity is "<pod>-<pid>": a restarted process in the same pod is another holder too.
        world.wait(lambda: operator.holder() not in ("", killed_holder) and operator.transitions() > before, 120,
                   "another replica taking the Lease after the SIGKILL")
        world.wait(lambda: "Handler 'reconcile' succeeded" in world.cluster.kubectl(
            "logs", "-n", world.ns, operator.leader_pod()["metadata"]["name"]).stdout, 90,
            "the new leader resuming the pool")
        time.sleep(5)  # passes of the new leader, watched for flapping
    finally:
        stop.set()
        watcher.join(timeout=10)

    _children_once(world, "ha")
    assert counts and min(counts) >= 2, counts
    assert json.loads(world.kubectl("get", "deployment", "ha", "-o", "json"))["spec"]["replicas"] == 2
    world.wait_ready("ha", warm=2, timeout=60)
