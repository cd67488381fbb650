"""Two operator replicas on the real local control plane (issue #14): one acts, the other waits
on the leader Lease and takes over when the first is SIGKILLed.

Both are real `python -m warmpool operator --leader-elect` processes; the workers are real.
Every wait is bounded.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import Operator, World, delete_warmmodels, pod_ready, warmmodel

pytestmark = pytest.mark.integration

LEASE = "warmpool-operator"
STEADY_MEMORY = [f"--memory-capacity-bytes={64 * 1024**3}"]


@pytest.fixture()
def pair(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[tuple[World, Operator]]:
    args = ("--leader-elect", "--leader-election-namespace", namespace, "--leader-election-name", LEASE)
    first = Operator(cluster, namespace, tmp_path / "first.log", installed=False, extra_args=args)
    second = Operator(cluster, namespace, tmp_path / "second.log", installed=False, extra_args=args)
    world = World(cluster, namespace, first, diagnose_timeouts=True)
    first.start()
    world.wait(lambda: "holds the Lease" in first.log(), 60, "the first replica taking the Lease")
    second.start()
    world.wait(lambda: "waiting for the Lease" in second.log(), 60, "the second replica waiting")
    try:
        yield world, second
    finally:
        for operator in (first, second):
            if operator.running():
                world.operator = operator
        delete_warmmodels(cluster, namespace)
        first.stop()
        second.stop()
        world.close()


def test_one_replica_acts_and_the_other_takes_over_when_it_is_killed(
    pair: tuple[World, Operator], tiny_model: Path
) -> None:
    world, second = pair
    first = world.operator
    world.apply(warmmodel("ha", tiny_model, replicas=2, min_warm=2, max_replicas=3, worker_args=STEADY_MEMORY))
    world.wait_ready("ha", warm=2, timeout=180)

    # Only the holder acts: the standby has run no handler and written nothing.
    lease = json.loads(world.kubectl("get", "lease", LEASE, "-o", "json"))
    assert first.proc is not None and f"-{first.proc.pid}" in lease["spec"]["holderIdentity"]
    assert "Handler" not in second.log() and "differs from the spec" not in second.log()

    ready_counts: list[int] = []
    stop = threading.Event()

    def watch_ready() -> None:  # bounded: stops when told, or after 180 s at most
        deadline = time.monotonic() + 180
        while not stop.is_set() and time.monotonic() < deadline:
            pods = world.pods("ha")
            ready_counts.append(sum(pod_ready(p) for p in pods))
            time.sleep(0.3)

    watcher = threading.Thread(target=watch_ready, daemon=True)
    watcher.start()
    try:
        first.kill()
        world.operator = second
        world.wait(lambda: "holds the Lease" in second.log(), 60, "the standby taking the Lease over")
        world.wait(lambda: "Handler 'reconcile' succeeded" in second.log(), 60, "the new leader resuming the pool")
        time.sleep(5)  # passes of the new leader, watched for flapping
    finally:
        stop.set()
        watcher.join(timeout=10)

    lease = json.loads(world.kubectl("get", "lease", LEASE, "-o", "json"))
    assert second.proc is not None and f"-{second.proc.pid}" in lease["spec"]["holderIdentity"]
    assert int(lease["spec"]["leaseTransitions"]) >= 1
    # No duplicate child, and the pool never below minWarm Ready pods across the take-over.
    kids = world.children("ha")
    assert kids["deployments"] == ["ha"] and kids["services"] == ["ha"] and kids["poddisruptionbudgets"] == ["ha"]
    assert kids["configmaps"] == ["ha-warmup"] and kids["secrets"] == ["ha-control"]
    assert ready_counts and min(ready_counts) >= 2, ready_counts
    assert json.loads(world.kubectl("get", "deployment", "ha", "-o", "json"))["spec"]["replicas"] == 2
    world.wait_ready("ha", warm=2, timeout=30)
