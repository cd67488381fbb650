"""The node agent as users run it: the chart's DaemonSet on the real node, from the operator's
image, filling the node's hostPath cache from SeaweedFS; a worker container maps the published
revision (seen from the host's side, by inode), and its pod names the revision in the annotation
the agent's eviction spares (the chart's agent has no view of other containers' processes).

SeaweedFS listens on this machine's address on the node's bridge only (pods reach the host
there, and nothing else leaves the bridge).  The agent refuses the pod and Service ranges as
model sources, and is told to allow that one address: the chart's clusterNetworks and
sourceAllowNetworks values.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_devcluster.chart_values import local_values
from warmpool_devcluster.node_network import SERVICE_CIDR
from warmpool_devcluster.seaweedfs import SeaweedHandle, start_seaweedfs
from warmpool_devcluster.testing import ClusterHandle
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.use import mapped_revisions

from tests.integration.test_helm_install import CHART, adopt_existing_crd, helm
from tests.integration.test_node_agent_s3 import apply_secret, push, s3_warmmodel
from tests.support.e2e import Operator, World
from tests.support.node_agent import NODE, assert_files_identical, cache_entry, drop_cache_labels
from warmpool.contract.api import PLURAL
from warmpool.contract.files import MODEL_MOUNT_PATH
from warmpool.contract.nodecache import CACHE_REVISIONS_DIR
from warmpool.contract.pods import ANNOTATION_CACHE_REVISION

pytestmark = pytest.mark.integration


@pytest.fixture()
def store(cluster: ClusterHandle, tmp_path: Path) -> Iterator[SeaweedHandle]:
    if cluster.node is None:
        pytest.skip("the chart's DaemonSet on the local cluster's real node")
    handle = start_seaweedfs(tmp_path / "seaweedfs", address=cluster.node.gateway)
    try:
        yield handle
    finally:
        handle.stop()


def test_the_charts_node_agent_fills_the_nodes_cache_from_s3_and_sees_the_worker_map_it(
    cluster: ClusterHandle, namespace: str, store: SeaweedHandle, tiny_model: Path, tmp_path: Path,
) -> None:
    assert cluster.node is not None
    release = f"wp{uuid.uuid4().hex[:6]}"
    cache = tmp_path / "cache"  # created by the kubelet (hostPath DirectoryOrCreate)
    digest = push(store, tiny_model, "models/tiny")
    adopt_existing_crd(cluster, release, namespace)
    values = local_values(cluster.images, cluster.node.pod_cidr)
    values |= {
        "watch": {"namespaces": [namespace]},
        "operator": {**values["operator"], "replicas": 1, "scrapeInterval": 2, "allowedHostPaths": [str(tmp_path)]},
        "nodeAgent": {"enabled": True, "cacheRoot": str(cache), "interval": 2, "leaseDuration": 5,
                      "clusterNetworks": [cluster.node.pod_cidr, SERVICE_CIDR],
                      "sourceAllowNetworks": [f"{cluster.node.gateway}/32"]},
    }
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=True)
    operator.installed_namespace = namespace
    world = World(cluster, namespace, operator, diagnose_timeouts=True)
    try:
        helm(cluster, "install", release, str(CHART), "-n", namespace, "-f", str(values_file),
             "--wait", "--timeout", "180s")

        def agents_ready() -> list[dict[str, Any]] | None:
            pods = world.get("pods", "-l", "app.kubernetes.io/component=node-agent")["items"]
            statuses = [s for p in pods for s in (p["status"].get("containerStatuses") or [])]
            return pods if statuses and all(s["ready"] for s in statuses) else None

        # (helm's --wait does not wait for a DaemonSet's pods to be Ready)
        agents = world.wait(agents_ready, 120, "the node agent's pod Ready")
        assert [p["spec"]["nodeName"] for p in agents] == [NODE], agents
        (agent_status,) = agents[0]["status"]["containerStatuses"]
        assert agent_status["image"] == cluster.images["operator"], agent_status

        apply_secret(world, store.access_key_id, store.secret_access_key)
        world.apply(s3_warmmodel("from-s3", store, "models/tiny", NODE))
        world.wait_ready("from-s3", warm=1, timeout=300)

        # The agent's container filled the node's directory: the pushed model, byte for byte.
        hex_digest = digest.removeprefix("sha256:")
        assert_files_identical(cache / CACHE_REVISIONS_DIR / hex_digest, tiny_model)
        entry = world.wait(lambda: (e := cache_entry(world, "from-s3", NODE)) and e.get("published") and e, 30,
                           "the agent's published entry")
        assert entry["revision"] == digest and entry["bytesCached"] == entry["bytesTotal"] > 0, entry

        # The worker container maps the revision by its own mount's path; the host sees it by inode.
        (pod,) = world.pods("from-s3")
        assert world.complete(pod, "from-s3", max_tokens=2)
        maps = Path(f"/proc/{world.worker_pid(pod)}/maps").read_text()
        assert f"{MODEL_MOUNT_PATH}/model.safetensors" in maps
        assert str(cache) not in maps
        assert hex_digest in mapped_revisions(CacheLayout(cache))
        assert pod["metadata"]["annotations"][ANNOTATION_CACHE_REVISION] == digest
        assert "hostPID" not in agents[0]["spec"]

        # The agent ran as the chart says, and said nothing of a refused source or a failed pass.
        log = cluster.kubectl("logs", "-n", namespace, agents[0]["metadata"]["name"], check=False).stdout
        assert "Traceback" not in log and "refused" not in log, log[-3000:]
    finally:
        cluster.kubectl("-n", namespace, "delete", PLURAL, "--all", "--timeout=60s", check=False)
        helm(cluster, "uninstall", release, "-n", namespace, "--wait", "--timeout", "120s", check=False)
        world.close()
        drop_cache_labels(cluster, NODE)

