"""A pool on two real nodes (`cluster up --nodes 2`): placement by the node caches, a drain of the
node that holds its warm pods and then that node's death: the scenes `bench nodes` measures
(bench/warmpool_bench/nodes.py), run here on a tiny model and asserted.

- The caches: the chart's node agent on each node, SeaweedFS on node 0's bridge.  Pods added while
  one node holds the revision all land there; a pod sent to the other node waits for that node's
  agent to fill its own /var/lib/warmpool from S3; both report the revision in status.cacheNodes.
- Tiers and sleep per node (tests/support/node_pressure.py): node 1's pod pressed past the paused
  tier while node 0's stays full; the idle pod on the paused node put to sleep for memory pressure
  while node 0's stays awake and serves.
- Scale to zero across nodes (tests/support/node_activator.py): the activator on node 0 holds a
  request for a pool at zero whose pod runs on node 1, and forwards it there.
- The drain: `kubectl drain` completes, the Service never has fewer than minWarm Ready pods behind
  it, and no request sent through its ClusterIP meanwhile fails (each worker container sleeps
  before its SIGTERM while every kube-proxy drops it).
- A partition: node 1's link down with every process alive, until minWarm pods are Ready on node
  0, then up again: the pool is back at minWarm pods, all Ready, once node 1 answers again.
- The death: node 1's kubelet, containerd, kube-proxy, enforcer, shims and pod processes SIGKILLed,
  its link down.  The operator notices from its scrapes that no pod there answers while node 0's
  do, and minWarm pods are Ready on node 0 well before Kubernetes would even mark the node.
- `cluster down` afterwards leaves nothing, the dead node's namespaces and cgroups included.

A real-node cluster of its own, so it runs with the node-lifecycle tests, after the main session.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from warmpool_bench.bench_cluster import BenchCluster
from warmpool_bench.nodes import MIN_WARM, NodesSettings, run_scenes
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_devcluster import cluster

from tests.support.node_activator import activator_service, held_and_forwarded_across_nodes
from tests.support.node_pressure import tiers_and_sleep_per_node

pytestmark = pytest.mark.node_lifecycle

#: The operator's scrape interval here (the bench runs the default 10 s).
SCRAPE_INTERVAL_S = 2
NAMESPACE = "lifecycle-pool"
#: Kubernetes' own first move on a dead node here: the node lifecycle controller's grace (cluster.py).
CONTROLLER_GRACE_S = 300


def per_node_scenes(bench: BenchCluster, model: Path) -> dict[str, Any]:
    """Run between the cache scene and the pool's: tiers and sleep per node, then scale to zero across nodes."""
    return {"pressure": tiers_and_sleep_per_node(bench, model),
            "activator": held_and_forwarded_across_nodes(bench, model)}


def test_a_drain_and_a_node_death_keep_the_pool_warm_on_the_other_node(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    name = f"lifecycle-pool-{os.getpid()}"
    # BenchCluster attaches to the cluster it is named and leaves it up: this test takes it down.
    monkeypatch.setenv("WARMPOOL_TEST_CLUSTER", name)
    monkeypatch.setenv("WARMPOOL_KEEP_CLUSTER", "1")
    settings = NodesSettings(up_rounds=0, model="tiny", cluster=name, work_dir=tmp_path, timeout_s=300)
    bench = BenchCluster(name, tmp_path, NAMESPACE, nodes=2,
                         operator_args=("--scrape-interval", str(SCRAPE_INTERVAL_S),
                                        "--activator-service", activator_service(NAMESPACE)))
    try:
        figures = run_scenes(bench, settings, make_tiny_llama(tmp_path / "tiny-llama", layers=4),
                             more=per_node_scenes)
        operator_log = (tmp_path / "operator.log").read_text(errors="replace")
    finally:
        bench.stop()
        problems = cluster.down(name, purge=True)
    assert problems == [], problems
    cache, drain, death = figures["cache"], figures["drain"], figures["node_death"]
    pressure, zero = figures["more"]["pressure"], figures["more"]["activator"]
    # Tiers and sleep per node: node 1 under pressure, node 0 not.
    assert pressure["nodes"] == {"pressed-1": "warmpool-node-1", "calm-0": "warmpool-node-0"}, pressure
    assert pressure["tiers"] == {"pressed-1": "paused", "calm-0": "full"}, pressure
    assert pressure["sleep_level"]["pressed-1"] > 0 and pressure["sleep_level"]["calm-0"] == 0, pressure
    asleep = pressure["asleep_events"]
    assert any("pressed-1" in m and "warmpool-node-1" in m and "memory pressure" in m for m in asleep), asleep
    assert not any("calm-0" in m for m in asleep), asleep
    assert pressure["calm_0_answers"] == 200 and pressure["calm_0_still_awake"], pressure
    # The activator on node 0 held the request for the pool at zero and forwarded it to node 1.
    assert zero["status"] == 200 and "choices" in zero["answer"], zero
    assert (zero["activator_node"], zero["pool_pod_node"]) == ("warmpool-node-0", "warmpool-node-1"), zero
    assert zero["forwarded"] >= 1, zero
    # Cache-aware placement: every pod added while one node held the revision went there; the
    # other node's agent filled its own copy from S3 once a pod had to go there.
    assert cache["placed_on_cached_node"] == [True] * len(cache["cached"]), cache
    assert cache["uncached_on_other_node"], cache
    entries = {e["node"]: e for e in cache["cache_nodes"]}
    assert sorted(entries) == ["warmpool-node-0", "warmpool-node-1"], cache
    assert all(e["published"] and e["bytesCached"] == e["bytesTotal"] > 0 for e in entries.values()), entries
    copies = cache["own_copies"]
    assert copies["warmpool-node-0"]["path"] != copies["warmpool-node-1"]["path"], copies
    assert all("model.safetensors" in c["files"] for c in copies.values()), copies
    assert drain["completed"], drain["drain_output"]
    assert drain["fewest_serving"] >= MIN_WARM, drain
    assert drain["requests"] > 0 and drain["failed"] == 0, drain
    # Cut off and back: warm on node 0 meanwhile, then the surplus gone and the pool whole again.
    cut = figures["partition"]
    assert cut["cut_to_warm_s"] < CONTROLLER_GRACE_S and len(cut["pods_after"]) == MIN_WARM, cut
    assert "node warmpool-node-1: a worker pod there answers its scrapes again" in operator_log
    assert "node warmpool-node-1: no worker pod there answers its scrapes" in operator_log
    assert death["death_to_warm_s"] < CONTROLLER_GRACE_S, death
    assert not cluster.state_dir(name).exists()
