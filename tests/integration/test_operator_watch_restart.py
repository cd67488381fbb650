"""The operator's watches survive an API server restart (issue #14), on the real local control plane.

The session's own kube-apiserver is stopped and started again (same port, same store): every
watch and connection ends.  With a ten-minute scrape interval, only a re-established watch can
make the operator notice a child deleted afterwards.  Every wait is bounded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from warmpool_devcluster import cluster as devcluster
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import Operator, World, delete_warmmodels, warmmodel

pytestmark = pytest.mark.integration

STEADY_MEMORY = [f"--memory-capacity-bytes={64 * 1024**3}"]


@pytest.fixture()
def world(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[World]:
    if cluster.name is None:
        pytest.skip("restarts the API server: only on the session's own local cluster")
    operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False,
                        extra_args=("--scrape-interval", "600"))
    operator.start()
    made = World(cluster, namespace, operator, diagnose_timeouts=True)
    try:
        yield made
    finally:
        delete_warmmodels(cluster, namespace)
        operator.stop()
        made.close()


def test_watches_are_restarted_after_the_api_server_restarts(world: World, cluster: ClusterHandle,
                                                             tiny_model: Path) -> None:
    world.apply(warmmodel("rewatch", tiny_model, worker_args=STEADY_MEMORY))
    world.wait_ready("rewatch", warm=1, timeout=150)
    assert cluster.name is not None
    devcluster.restart_apiserver(cluster.name)
    assert world.operator.running(), "the operator exited when the API server went away"

    # Only a watch re-established after the restart can tell the operator about this deletion.
    old_uid = world.get("service", "rewatch")["metadata"]["uid"]
    world.kubectl("delete", "service", "rewatch", "--wait=true")
    world.wait(lambda: (world.maybe("service", "rewatch") or {}).get("metadata", {}).get("uid") not in (None, old_uid),
               90, "the Service deleted after the API server restart made again")
    # And pods: a worker pod deleted is replaced, and the new one warms and shows in status.
    (pod,) = world.pods("rewatch")
    world.kubectl("delete", "pod", pod["metadata"]["name"], "--wait=true")
    world.wait(lambda: [p for p in world.pods("rewatch") if p["metadata"]["uid"] != pod["metadata"]["uid"]], 60,
               "a new worker pod")
    world.wait_ready("rewatch", warm=1, timeout=150)
    assert world.operator.running()
