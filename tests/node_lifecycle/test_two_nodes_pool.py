"""A pool on two real nodes (`cluster up --nodes 2`), through a drain of the node that holds its warm
pods and then that node's death: the scenes `bench nodes` measures (bench/warmpool_bench/nodes.py),
run here on a tiny model and asserted.

- The drain: `kubectl drain` completes, the Service never has fewer than minWarm Ready pods behind
  it, and no request sent through its ClusterIP meanwhile fails (each worker container sleeps
  before its SIGTERM while every kube-proxy drops it).
- The death: node 1's kubelet, containerd, kube-proxy, enforcer, shims and pod processes SIGKILLed,
  its link down.  The operator notices from its scrapes that no pod there answers while node 0's
  do, and minWarm pods are Ready on node 0 well before Kubernetes would even mark the node.
- `cluster down` afterwards leaves nothing, the dead node's namespaces and cgroups included.

A real-node cluster of its own, so it runs with the node-lifecycle tests, after the main session.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from warmpool_bench.bench_cluster import BenchCluster
from warmpool_bench.nodes import MIN_WARM, NodesSettings, run_scenes
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_devcluster import cluster

pytestmark = pytest.mark.node_lifecycle

#: The operator's scrape interval here (the bench runs the default 10 s).
SCRAPE_INTERVAL_S = 2
#: Kubernetes' own first move on a dead node here: the node lifecycle controller's grace (cluster.py).
CONTROLLER_GRACE_S = 300


def test_a_drain_and_a_node_death_keep_the_pool_warm_on_the_other_node(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    name = f"lifecycle-pool-{os.getpid()}"
    # BenchCluster attaches to the cluster it is named and leaves it up: this test takes it down.
    monkeypatch.setenv("WARMPOOL_TEST_CLUSTER", name)
    monkeypatch.setenv("WARMPOOL_KEEP_CLUSTER", "1")
    settings = NodesSettings(up_rounds=0, model="tiny", cluster=name, work_dir=tmp_path, timeout_s=300)
    bench = BenchCluster(name, tmp_path, "lifecycle-pool", nodes=2,
                         operator_args=("--scrape-interval", str(SCRAPE_INTERVAL_S)))
    try:
        figures = run_scenes(bench, settings, make_tiny_llama(tmp_path / "tiny-llama", layers=4))
        operator_log = (tmp_path / "operator.log").read_text(errors="replace")
    finally:
        bench.stop()
        problems = cluster.down(name, purge=True)
    assert problems == [], problems
    drain, death = figures["drain"], figures["node_death"]
    assert drain["completed"], drain["drain_output"]
    assert drain["fewest_serving"] >= MIN_WARM, drain
    assert drain["requests"] > 0 and drain["failed"] == 0, drain
    assert "node warmpool-node-1: no worker pod there answers its scrapes" in operator_log
    assert death["death_to_warm_s"] < CONTROLLER_GRACE_S, death
    assert not cluster.state_dir(name).exists()
