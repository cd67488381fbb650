"""The node agent on the real local control plane: WarmModels with an http source go warm from the
node cache that `warmpool node-agent` processes fill from a loopback Range server.

The pods run on the local cluster's real node, so a pod's hostPath is a directory of this machine:
the operator is told the test's cache root (--block-cache-root) and each pod is pinned to the node
(nodeSelector) whose agent the test runs.  Agents are real processes; the server counts every byte
range it answers, which is what "one download" means here.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import config as k8s_config
from warmpool_devcluster.testing import ClusterHandle
from warmpool_nodecache.agent_kube import (
    FILL_LEASE_PREFIX,
    NODE_AGENT_FIELD_MANAGER,
    AgentKube,
    agent_lease,
    lease_name,
)
from warmpool_nodecache.blocks import BlockStore
from warmpool_nodecache.fill import FillOptions, fill_revision
from warmpool_nodecache.journal import journaled
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import Manifest, build_manifest, write_manifest
from warmpool_nodecache.source import HttpSource, HttpSourceConfig

from tests.support.e2e import World
from tests.support.node_agent import (
    NODE,
    OTHER_NODE,
    Agent,
    agent_processes,
    assert_files_identical,
    cache_entry,
    cache_world,
)
from tests.support.range_server import RangeServer, serve_directory
from warmpool import cachekeys
from warmpool.contract.api import API_GROUP_VERSION, KIND, PLURAL
from warmpool.contract.http import PATH_READYZ
from warmpool.contract.nodecache import CACHE_WAIT_CONTAINER
from warmpool.lease import Lease, LeaseLostError, Observed

pytestmark = pytest.mark.integration

BLOCK = 64 * 1024  # the tiny checkpoint then spans several blocks


@pytest.fixture()
def served(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[RangeServer, Manifest]]:
    root = tmp_path / "store" / "tiny"
    shutil.copytree(tiny_model, root)
    manifest = build_manifest(root, block_size=BLOCK)
    write_manifest(root, manifest)
    with serve_directory(root) as server:
        yield server, manifest


@pytest.fixture()
def world(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[World]:
    with cache_world(cluster, namespace, tmp_path) as w:
        yield w


@pytest.fixture()
def agents(tmp_path: Path) -> Iterator[list[Agent]]:
    with agent_processes(tmp_path) as started:
        yield started


def http_warmmodel(name: str, url: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": API_GROUP_VERSION, "kind": KIND,
        "metadata": {"name": name},
        "spec": {
            "model": {"http": {"url": url}, "revision": "r1"},
            "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": 2},
            "warmup": {"buckets": [8], "prompts": ["hello there"], "timeoutSeconds": 120},
            "pod": {"workerArgs": ["--device=cpu", "--prompts-per-bucket=1", "--decode-tokens=2"],
                    "nodeSelector": {"kubernetes.io/hostname": node}},
        },
    }


def test_http_source_goes_warm_from_the_cache_two_agents_one_download(
    world: World, agents: list[Agent], served: tuple[RangeServer, Manifest], tmp_path: Path,
) -> None:
    server, manifest = served
    cache = tmp_path / "cache"
    # An older revision no pod needs is already cached: with a budget of 0 the agents evict it,
    # never the revision the pod on their node needs (before or after the worker maps it).
    from warmpool_dev.testing_models import make_tiny_llama

    old_dir = make_tiny_llama(tmp_path / "store" / "old", layers=2, seed=7)
    write_manifest(old_dir, old := build_manifest(old_dir, block_size=BLOCK))
    with serve_directory(old_dir) as old_server:
        fill_revision(CacheLayout(cache), HttpSource(HttpSourceConfig(old_server.url, timeout_s=10)))
    assert CacheLayout(cache).revision(old.digest_hex).is_dir()
    # Two agents for one node and one cache race on the revision: one Lease holder downloads.
    agents += [Agent(world.cluster, world.ns, NODE, cache, tmp_path / f"agent-{i}.log", budget_bytes=0)
               for i in range(2)]
    world.apply(http_warmmodel("cached", server.url, NODE))
    world.wait_ready("cached", warm=1, timeout=240)
    world.wait(lambda: not CacheLayout(cache).revision(old.digest_hex).exists(), 60, "the old revision evicted")

    # Every block came over the wire exactly once, whoever of the two fetched it.
    blocks = {(r.path, r.offset) for r in manifest.block_refs()}
    ranges = dict(server.state.ranges)
    assert set(ranges) == blocks, (sorted(ranges), sorted(blocks))
    assert all(count == 1 for count in ranges.values()), ranges

    # The worker served the cache's published revision, complete.
    revision = cache / "revisions" / manifest.digest_hex
    assert_files_identical(revision, server.state.directory)
    assert not list((cache / "staging").glob(f"{manifest.digest_hex}.*"))

    # status.cacheNodes: this node's entry, written by the agent as its own field manager.
    entry = world.wait(lambda: (e := cache_entry(world, "cached", NODE)) and e.get("published") and e, 30, "entry")
    assert entry["revision"] == manifest.digest
    assert entry["bytesCached"] == entry["bytesTotal"] > 0
    fields = json.loads(world.kubectl("get", PLURAL, "cached", "-o", "json", "--show-managed-fields"))
    managers = {m["manager"]: m for m in fields["metadata"]["managedFields"]}
    agent_managers = [m for name, m in managers.items() if name.startswith(NODE_AGENT_FIELD_MANAGER + ".")]
    assert len(agent_managers) == 1 and agent_managers[0]["subresource"] == "status", managers

    # The node says it holds the revision; the Deployment prefers such nodes.
    label = cachekeys.cache_node_label(manifest.digest)
    world.wait(lambda: (world.cluster.kubectl("get", "node", NODE, "-o", "json").stdout.find(label) >= 0), 30,
               "the node label")
    template = world.get("deployment", "cached")["spec"]["template"]["spec"]
    term = template["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["preference"]["matchExpressions"] == [{"key": label, "operator": "Exists"}]
    assert template["initContainers"][0]["name"] == CACHE_WAIT_CONTAINER

    # One fill Lease for the (node, revision), released after the publish.  (The losing agent may
    # still take a released Lease before it sees the revision published: it then downloads nothing.)
    leases = world.get("leases")["items"]
    fills = [item for item in leases if item["metadata"]["name"].startswith(FILL_LEASE_PREFIX)]
    assert len(fills) == 1 and fills[0]["spec"].get("acquireTime"), fills
    world.wait(lambda: not world.get("lease", fills[0]["metadata"]["name"])["spec"].get("holderIdentity"), 30,
               "the fill Lease released")


def test_agent_killed_mid_fill_resumes_and_the_pod_waits_for_the_publish(
    world: World, agents: list[Agent], served: tuple[RangeServer, Manifest], tmp_path: Path,
) -> None:
    server, manifest = served
    cache = tmp_path / "cache"
    server.state.range_delay_s = 0.4  # slow enough to kill the agent between blocks
    agents.append(Agent(world.cluster, world.ns, NODE, cache, tmp_path / "agent-0.log"))
    world.apply(http_warmmodel("resumed", server.url, NODE))
    world.wait(lambda: server.state.block_requests() >= 2, 120, "the fill under way")
    agents[0].kill()
    fetched_before = server.state.block_requests()
    ranges_before = dict(server.state.ranges)
    # What the killed agent made durable: the header block files it fetched first, and the blocks
    # its fill's journal lists in the view it left (the next holder takes that view over).
    layout = CacheLayout(cache)
    kept = (BlockStore(layout).all_blocks() | journaled(layout, manifest.digest_hex)) & manifest.unique_blocks()
    assert not (cache / "revisions" / manifest.digest_hex).exists()
    # The pod exists and waits in its init container: the worker has not started on a partial revision.
    pods = world.wait(lambda: world.pods("resumed"), 60, "the worker pod")
    statuses = pods[0]["status"].get("containerStatuses") or []
    assert not any((s.get("state") or {}).get("running") for s in statuses), statuses

    agents.append(Agent(world.cluster, world.ns, NODE, cache, tmp_path / "agent-1.log"))
    world.wait_ready("resumed", warm=1, timeout=240)
    # The new agent fetched none of what the killed one had stored, and the rest once: the fill keeps
    # several blocks in flight, and the killed agent's requests may still be counted after its death.
    missing = len(manifest.unique_blocks() - kept)
    ranges = dict(server.state.ranges)
    assert [r for r in manifest.block_refs() if r.sha256 in kept
            and ranges.get((r.path, r.offset), 0) != ranges_before.get((r.path, r.offset), 0)] == [], ranges
    after = server.state.block_requests() - fetched_before
    assert missing <= after <= missing + FillOptions().fetch_workers, ranges
    # The kill left blocks to fetch.  (Not that some were never asked for: six fetch workers keep up
    # to twelve blocks in flight, all of this model's ten, so every request may be out when it comes.)
    assert missing > 0
    assert_files_identical(cache / "revisions" / manifest.digest_hex, server.state.directory)
    lease = next(item for item in world.get("leases")["items"]
                 if item["metadata"]["name"].startswith(FILL_LEASE_PREFIX))
    assert lease["spec"]["leaseTransitions"] == 1  # taken over from the killed holder: version 2


def test_a_holder_whose_fill_lease_was_taken_over_cannot_publish(
    cluster: ClusterHandle, namespace: str, served: tuple[RangeServer, Manifest], tmp_path: Path,
) -> None:
    """Two agents' Leases on the real API server: once B takes the expired Lease over (version 2),
    A's fence refuses A's publish, and B's fill publishes."""
    server, manifest = served
    layout = CacheLayout(tmp_path / "cache")

    async def scenario() -> None:
        api = await k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))
        kube = AgentKube(api, NODE)
        try:
            name = lease_name(NODE, manifest.digest)
            a = agent_lease(kube, namespace, name, duration_s=1, observed=Observed())
            b = agent_lease(kube, namespace, name, duration_s=30, observed=Observed())
            assert await a.try_acquire() and a.version == 1
            assert not await b.try_acquire()  # live: B is refused
            for _ in range(100):  # A stops renewing; B takes over once the Lease expired (bounded)
                if await b.try_acquire():
                    break
                await asyncio.sleep(0.1)
            assert b.version == 2
            loop = asyncio.get_running_loop()

            def fence_of(lease: Lease) -> Callable[[], None]:
                return lambda: asyncio.run_coroutine_threadsafe(lease.renew(), loop).result(10)

            source = HttpSource(HttpSourceConfig(server.url, timeout_s=10, attempts=2, backoff_s=0.05))
            with pytest.raises(LeaseLostError):
                await asyncio.to_thread(fill_revision, layout, source, options=FillOptions(
                    lease_ttl_s=5, fence=fence_of(a)))
            assert not layout.revision(manifest.digest_hex).exists()
            result = await asyncio.to_thread(fill_revision, layout, source, options=FillOptions(
                lease_ttl_s=5, fence=fence_of(b)))
            assert result.filled_here and layout.revision(manifest.digest_hex).is_dir()
            await b.release()
            lease = await kube.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{b.name}")
            assert lease["spec"]["leaseTransitions"] == 1 and not lease["spec"].get("holderIdentity")
        finally:
            await kube.close()

    asyncio.run(scenario())
    assert_files_identical(layout.revision(manifest.digest_hex), server.state.directory)


def test_a_warmmodel_starting_on_the_partial_cache_loads_layers_before_the_publish(
    world: World, agents: list[Agent], tmp_path: Path,
) -> None:
    """``spec.model.startOnPartialCache``: the agent fills a partial view in the order a worker needs
    it (``start_order``), the pod's init container waits only for the view's link, and the pod's
    worker (``--partial-cache``, only the view mounted) loads its first layer while the rest of the
    revision is still held at the source; once released, the revision is published under the same
    inodes and the pool goes warm on it, byte for byte the source's files."""
    from warmpool_dev.testing_models import make_tiny_llama

    from tests.support.e2e import http
    from tests.support.partial_worker import start_order_through_layer0
    from warmpool.fill_progress import STATE_PUBLISHED, progress_path, read_progress

    root = make_tiny_llama(tmp_path / "store" / "m", layers=4, hidden=128, intermediate=256, vocab_size=512,
                           seed=3)
    write_manifest(root, manifest := build_manifest(root, block_size=BLOCK))
    _, rest = start_order_through_layer0(root, manifest, BLOCK)
    cache = CacheLayout(tmp_path / "cache")
    with serve_directory(root) as server:
        server.state.held = {(r.path, r.offset) for r in rest}
        # No --partial-view: the WarmModel asks for it.
        agents.append(Agent(world.cluster, world.ns, NODE, cache.root, tmp_path / "agent-0.log"))
        body = http_warmmodel("partial", server.url, NODE)
        body["spec"]["model"]["startOnPartialCache"] = True
        world.apply(body)

        def loading_on_the_view() -> dict[str, Any] | None:
            for pod in world.pods("partial"):
                if not (pod.get("status") or {}).get("podIP"):
                    continue
                code, text = http(world.base(pod) + PATH_READYZ, timeout=2)
                if code in (200, 503) and text.startswith("{"):
                    state: dict[str, Any] = json.loads(text)
                    if int(state.get("layers_resident") or 0) >= 1:
                        return state
            return None

        try:
            state = world.wait(loading_on_the_view, 240, "the pod's worker loading a layer on the partial view")
            assert not cache.revision(manifest.digest_hex).exists(), "published before the held blocks came"
            assert int(state["layers_resident"]) < 4, state  # the held layers are still at the source
            args = world.get("deployment", "partial")["spec"]["template"]["spec"]["containers"][0]["args"]
            assert "--partial-cache" in args, args
        finally:
            server.state.release.set()
        world.wait_ready("partial", warm=1, timeout=240)
    record = read_progress(progress_path(cache.revision(manifest.digest_hex)))  # renamed with its view
    assert record is not None and record.state == STATE_PUBLISHED and record.complete
    link = cache.partial_link(manifest.digest_hex, world.ns)  # the namespace's own link: what its pods mount
    assert link.resolve() == cache.revision(manifest.digest_hex).resolve()
    assert_files_identical(cache.revision(manifest.digest_hex), root)


def test_eviction_spares_a_revision_a_pod_on_the_node_names_and_no_process_maps(
    world: World, agents: list[Agent], tmp_path: Path,
) -> None:
    """The chart's agent sees no other container's process (no hostPID): the pod's
    warmpool.dev/cache-revision annotation is what keeps its revision, here one its WarmModel's
    source no longer names (an older revision's pod during a rollout) and nothing maps.  The pod
    counts because a WarmModel's Deployment owns it (through its ReplicaSet), not for its labels."""
    from warmpool_dev.testing_models import make_tiny_llama

    from tests.support.owned_pods import deployment_body, owner, pod_body, replicaset_body

    cache = CacheLayout(tmp_path / "cache")
    revisions: list[Manifest] = []
    for seed in (11, 12):
        folder = make_tiny_llama(tmp_path / "store" / f"m{seed}", layers=2, seed=seed)
        write_manifest(folder, manifest := build_manifest(folder, block_size=BLOCK))
        with serve_directory(folder) as server:
            fill_revision(cache, HttpSource(HttpSourceConfig(server.url, timeout_s=10)))
        revisions.append(manifest)
    named, unnamed = revisions
    # A WarmModel the operator refuses (its hostPath is not allowed: it makes no child of its own),
    # owning by hand a Deployment, its ReplicaSet and the old revision's pod.
    world.apply({"apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": "gone"},
                 "spec": {"model": {"hostPath": {"path": "/not-an-allowed-host-path/m"}}}})
    world.apply(deployment_body("gone-old", "gone", world.wm("gone")["metadata"]["uid"]))
    deployment_uid = world.get("deployment", "gone-old")["metadata"]["uid"]
    world.apply(replicaset_body("gone-old-1", "gone", "gone-old", deployment_uid))
    rs_uid = world.get("replicaset", "gone-old-1")["metadata"]["uid"]
    world.apply(pod_body("old-revision-pod", "gone", OTHER_NODE, named.digest,
                         [owner("apps/v1", "ReplicaSet", "gone-old-1", rs_uid)]))
    # The second node: its pod's image is served by no registry, so no process maps anything and only
    # the annotation counts.
    agents.append(Agent(world.cluster, world.ns, OTHER_NODE, cache.root, tmp_path / "agent-0.log",
                        budget_bytes=0, interval_s=1))
    world.wait(lambda: not cache.revision(unnamed.digest_hex).exists(), 60, "the unnamed revision evicted")
    assert cache.revision(named.digest_hex).is_dir()
    world.kubectl("delete", "pod", "old-revision-pod", "--grace-period=0", "--force", "--wait=true")
    world.wait(lambda: not cache.revision(named.digest_hex).exists(), 60, "the revision evicted once its pod went")
