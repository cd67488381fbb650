"""What a node agent reads and where its failures go, on the real local control plane: a
WarmModel's manifest is read once in the cluster before any pod needs it (not once per node), an
agent's own failures are Events on its Node, and a cache reached through a link that leads out of
the allowed host paths is refused by the operator from the real path the agent reports."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.testing import ClusterHandle
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import build_manifest, write_manifest

from tests.integration.test_node_agent import http_warmmodel
from tests.support.e2e import Operator, World
from tests.support.node_agent import NODE, OTHER_NODE, Agent, agent_processes, cache_entry
from tests.support.range_server import serve_directory
from warmpool.contract.api import CONDITION_DEGRADED, PLURAL
from warmpool.contract.files import MANIFEST_FILENAME

pytestmark = pytest.mark.integration

BLOCK = 64 * 1024
#: A node no kubelet registered: every label write of its agent fails.
GONE_NODE = "warmpool-node-gone"


@pytest.fixture()
def agents(tmp_path: Path) -> Iterator[list[Agent]]:
    with agent_processes(tmp_path) as started:
        yield started


def _entries(cluster: ClusterHandle, namespace: str) -> dict[str, list[dict[str, Any]]]:
    items = json.loads(cluster.kubectl("-n", namespace, "get", PLURAL, "-o", "json").stdout)["items"]
    return {wm["metadata"]["name"]: list((wm.get("status") or {}).get("cacheNodes") or []) for wm in items}


def test_a_first_manifest_is_read_by_one_agent_not_by_every_node(
    cluster: ClusterHandle, namespace: str, crd: str, agents: list[Agent], tiny_model: Path, tmp_path: Path,
) -> None:
    """No pod needs these WarmModels anywhere (no operator runs): one agent of the two reads each
    manifest, once, for the first digest; the other reads none of them."""
    names = ("m1", "m2", "m3")
    for name in names:
        shutil.copytree(tiny_model, tmp_path / "store" / name)
        write_manifest(tmp_path / "store" / name, build_manifest(tmp_path / "store" / name, block_size=BLOCK))
    with serve_directory(tmp_path / "store") as server:
        agents += [Agent(cluster, namespace, node, tmp_path / f"cache-{i}", tmp_path / f"agent-{i}.log",
                         interval_s=1) for i, node in enumerate((NODE, OTHER_NODE))]
        for name in names:
            body = http_warmmodel(name, f"{server.url}/{name}", NODE)
            cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(body))
        deadline = time.monotonic() + 90
        while True:
            found = _entries(cluster, namespace)
            if len(found) == len(names) and all(
                    len(entries) == 1 and entries[0].get("revision") for entries in found.values()):
                break
            assert time.monotonic() < deadline, f"one first digest for each of {names}: {found}"
            time.sleep(0.5)
        time.sleep(8)  # several passes of both agents, and the read Leases' time to expire
        found = _entries(cluster, namespace)
        reads = {name: server.state.gets[f"{name}/{MANIFEST_FILENAME}"] for name in names}
    assert reads == dict.fromkeys(names, 1), reads
    assert all(len(entries) == 1 for entries in found.values()), found


def test_an_agents_own_failures_are_events_on_its_node(
    cluster: ClusterHandle, namespace: str, crd: str, agents: list[Agent], tmp_path: Path,
) -> None:
    """An agent whose Node is gone cannot label it, and its cache holds a manifest that no longer
    parses: both are Warning Events on the Node, not only lines in its log."""
    layout = CacheLayout(tmp_path / "cache")
    digest = "c" * 64
    layout.revision(digest).mkdir(parents=True)
    layout.manifests.mkdir(parents=True)
    layout.manifest(digest).write_text("{not a manifest")
    selector = f"involvedObject.kind=Node,involvedObject.name={GONE_NODE}"
    cluster.kubectl("-n", "default", "delete", "events", "--field-selector", selector, check=False)
    agents.append(Agent(cluster, namespace, GONE_NODE, layout.root, tmp_path / "agent-0.log", interval_s=1,
                        budget_bytes=10**12))
    try:
        deadline = time.monotonic() + 60
        while True:
            events = json.loads(cluster.kubectl("-n", "default", "get", "events", "--field-selector", selector,
                                                "-o", "json").stdout)["items"]
            reasons = {e["reason"]: e for e in events if e.get("type") == "Warning"}
            if {"NodeAgentPassFailed", "NodeCacheManifestUnreadable"} <= reasons.keys():
                break
            assert time.monotonic() < deadline, f"the agent's Events on its Node: {sorted(reasons)}"
            time.sleep(0.5)
        assert "labelling the node failed" in reasons["NodeAgentPassFailed"]["message"]
        assert digest in reasons["NodeCacheManifestUnreadable"]["message"]
        # Said once, not once a pass: the same failure does not flood the API server.
        assert sum(1 for e in events if e["reason"] == "NodeAgentPassFailed") == 1
        assert layout.revision(digest).is_dir()  # eviction ran (with room to spare) and spared it
    finally:
        cluster.kubectl("-n", "default", "delete", "events", "--field-selector", selector, check=False)


def test_a_cache_linked_out_of_the_allowed_paths_is_refused_from_the_real_path(
    cluster: ClusterHandle, namespace: str, crd: str, agents: list[Agent], tiny_model: Path, tmp_path: Path,
) -> None:
    """The cache root lies under the allowed host path by name, but is a link to a directory
    outside it: the agent reports the real path, and the operator refuses the WarmModel
    (HostPathNotAllowed) before any pod mounts it."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    # Outside every directory a test operator may mount (the temp dir among them).
    outside = Path(tempfile.mkdtemp(prefix="warmpool-linked-", dir="/var/tmp")) / "cache"
    outside.mkdir()
    os.symlink(outside, allowed / "cache")
    root = tmp_path / "store" / "m"
    shutil.copytree(tiny_model, root)
    write_manifest(root, build_manifest(root, block_size=BLOCK))
    operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False,
                        extra_args=(f"--allowed-host-path={allowed}", f"--block-cache-root={allowed / 'cache'}"))
    operator.start()
    world = World(cluster, namespace, operator, diagnose_timeouts=True)
    try:
        with serve_directory(root) as server:
            agents.append(Agent(cluster, namespace, NODE, allowed / "cache", tmp_path / "agent-0.log", interval_s=1))
            world.apply(http_warmmodel("linked", server.url, NODE))
            entry = world.wait(lambda: (e := cache_entry(world, "linked", NODE)) and e.get("path") and e, 60,
                               "the agent's report with a real path")
            assert entry["path"].startswith(str(outside.resolve()) + "/"), entry
            degraded = world.wait(lambda: (c := world.condition("linked", CONDITION_DEGRADED))
                                  and c.get("status") == "True" and c, 60, "the WarmModel refused")
        assert degraded["reason"] == "HostPathNotAllowed" and f"the real path on node {NODE}" in degraded["message"]
        assert world.children("linked")["deployments"] == []
        assert world.pods("linked") == []
    finally:
        cluster.kubectl("-n", namespace, "delete", PLURAL, "--all", "--timeout=60s", check=False)
        operator.stop()
        world.close()
        shutil.rmtree(outside.parent, ignore_errors=True)
