"""The node agent's decisions on real files: which WarmModels it serves, the fill order from real
safetensors headers and a heat map, bytes cached, and the node labels it sets and drops."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from warmpool_nodecache import agent
from warmpool_nodecache.agent_kube import FILL_LEASE_PREFIX, field_manager, lease_name
from warmpool_nodecache.blocks import BlockStore
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import build_manifest
from warmpool_nodecache.s3 import S3Source
from warmpool_nodecache.source import HttpSource, SourceError

from warmpool import cachekeys
from warmpool.contract.nodecache import CACHE_NODE_LABEL_VALUE
from warmpool.contract.pods import ANNOTATION_CACHE_REVISION
from warmpool.heatmap import HeatMap

pytestmark = pytest.mark.unit

BLOCK = 16 * 1024


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from warmpool_dev.testing_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("m") / "tiny", layers=4, seed=1)


def _headers(model: Path) -> dict[str, dict[str, object]]:
    headers = {}
    for f in sorted(model.glob("*.safetensors")):
        header = agent.safetensors_header(f.read_bytes()[:BLOCK], f.name)
        assert header is not None
        headers[f.name] = header
    return headers


def test_only_object_store_sources_are_served() -> None:
    http = {"metadata": {"namespace": "ns", "name": "m", "uid": "u"},
            "spec": {"model": {"http": {"url": "http://127.0.0.1:1/m"}}}}
    ref = agent.model_ref(http)
    assert ref is not None and ref.key == "ns/m" and ref.secret_name is None
    assert ref.fingerprint == cachekeys.source_fingerprint({"http": {"url": "http://127.0.0.1:1/m"}})
    assert isinstance(agent.open_source(ref.source, None), HttpSource)
    s3 = {"metadata": {"namespace": "ns", "name": "m"}, "spec": {"model": {"s3": {
        "endpoint": "http://127.0.0.1:2", "bucket": "b", "secretRef": {"name": "keys"}}}}}
    s3_ref = agent.model_ref(s3)
    assert s3_ref is not None and s3_ref.secret_name == "keys"
    # An s3 source becomes the real S3 source; a Secret without the keys is refused naming them.
    with pytest.raises(SourceError, match=r"Secret ns/keys has no 'AWS_ACCESS_KEY_ID' key"):
        agent.open_source(s3_ref.source, {}, "Secret ns/keys")
    keys = {"AWS_ACCESS_KEY_ID": base64.b64encode(b"AKID").decode(),
            "AWS_SECRET_ACCESS_KEY": base64.b64encode(b"secret").decode()}
    assert isinstance(agent.open_source(s3_ref.source, keys), S3Source)
    assert agent.model_ref({"metadata": {}, "spec": {"model": {"hostPath": {"path": "/models/m"}}}}) is None


def test_heat_order_fetches_headers_then_the_hottest_layer(model: Path) -> None:
    manifest = build_manifest(model, block_size=BLOCK)
    headers = _headers(model)
    num_layers, ranges = agent.layer_ranges(headers)
    assert num_layers == 4 and set(ranges) == {0, 1, 2, 3}
    heat = HeatMap("sha256:x", 4, {3: 10.0, 1: 5.0}).to_text()
    refs = agent.heat_order(manifest, headers, heat)(manifest)
    heads = agent.header_blocks(manifest)
    assert refs[: len(heads)] == heads
    hottest = refs[len(heads)]
    path, start, end = ranges[3][0]
    assert hottest.path == path and hottest.offset < end and start < hottest.offset + hottest.length
    # A map for another layer count is ignored: layer 0 comes first.
    wrong = HeatMap("sha256:x", 7, {6: 1.0}).to_text()
    first = agent.heat_order(manifest, headers, wrong)(manifest)[len(heads)]
    path0, start0, end0 = ranges[0][0]
    assert first.path == path0 and first.offset < end0 and start0 < first.offset + first.length
    assert agent.heat_order(manifest, headers, "not json")(manifest)[len(heads)] == first


def test_a_header_running_past_the_first_block_is_reported_as_such(model: Path) -> None:
    data = next(model.glob("*.safetensors")).read_bytes()
    assert agent.safetensors_header(data[:20], "x") is None
    with pytest.raises(ValueError, match="implausible"):
        agent.safetensors_header((2**40).to_bytes(8, "little") + b"{}", "x")


def test_a_tensor_name_cannot_size_the_layer_order() -> None:
    """A tenant's checkpoint names its tensors: "layers.99999999999." made the layer order (a list
    of every index) a hundred billion long, past 4,300 digits int() raised, and other scripts'
    digits were read as indices.  Such tensors are no layer's (they are fetched as core bytes)."""
    span = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    header = {"__data_start__": 8, "model.layers.1.w": span, "model.layers.99999999999.w": span,
              "model.layers." + "9" * 5000 + ".w": span, "model.layers.\u0663.w": span}
    num_layers, ranges = agent.layer_ranges({"m.safetensors": header})
    assert (num_layers, sorted(ranges)) == (2, [1])
    assert len(agent.core_spans({"m.safetensors": header})) == 3


def test_cached_bytes_counts_the_blocks_present_that_the_namespace_verified(model: Path, tmp_path: Path) -> None:
    from warmpool_nodecache.trust import DomainBlocks

    manifest = build_manifest(model, block_size=BLOCK)
    layout = CacheLayout(tmp_path)
    assert agent.cached_bytes(layout, manifest, "team-a") == 0
    refs = list(manifest.block_refs())
    store = BlockStore(layout)
    for ref in refs[:2]:
        store.put(ref.sha256, (model / ref.path).read_bytes()[ref.offset: ref.offset + ref.length])
        DomainBlocks(store, "team-a").vouch(ref.sha256)
    assert agent.cached_bytes(layout, manifest, "team-a") == sum(r.length for r in refs[:2])
    # Another namespace's status does not learn which of its hashes team-a's blocks match.
    assert agent.cached_bytes(layout, manifest, "team-b") == 0
    assert agent.unique_bytes(manifest) <= manifest.total_bytes


def test_cached_bytes_counts_what_a_fill_under_way_made_durable_in_its_view(model: Path, tmp_path: Path) -> None:
    """A fill writes its blocks into the revision's files only: its progress is what its journal lists."""
    from warmpool_nodecache.partial import PartialView
    from warmpool_nodecache.trust import DomainBlocks

    manifest = build_manifest(model, block_size=BLOCK)
    layout = CacheLayout(tmp_path)
    layout.staging.mkdir(parents=True)
    store = BlockStore(layout)
    blocks = DomainBlocks(store, "team-a")
    view = PartialView(store, manifest, layout.staging / f"{manifest.digest_hex}.1", None,
                       usable=blocks.usable, vouched=blocks.vouched)
    view.create()
    refs = list(manifest.block_refs())[:3]
    for ref in refs:
        blocks.vouch(ref.sha256)
        view.write(ref.sha256, (model / ref.path).read_bytes()[ref.offset: ref.offset + ref.length])
    assert agent.cached_bytes(layout, manifest, "team-a") == 0  # written, not yet durable
    view.place([ref.sha256 for ref in refs])
    assert agent.cached_bytes(layout, manifest, "team-a") == sum(r.length for r in refs)
    assert agent.cached_bytes(layout, manifest, "team-b") == 0
    view.close()


def test_labels_follow_the_published_revisions(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path)
    a, b = "a" * 64, "b" * 64
    (layout.revisions / a).mkdir(parents=True)
    published = agent.published_digests(layout)
    assert published == {f"sha256:{a}"}
    stale = cachekeys.cache_node_label(b)
    patch = agent.label_changes({stale: "published", "kubernetes.io/hostname": "n"}, published)
    assert patch == {stale: None, cachekeys.cache_node_label(a): CACHE_NODE_LABEL_VALUE}
    assert agent.label_changes({cachekeys.cache_node_label(a): "published"}, published) == {}


def test_names_fit_the_api_limits() -> None:
    long_node = "n" * 253
    assert len(field_manager(long_node)) <= 128
    name = lease_name(long_node, "sha256:" + "c" * 64)
    assert len(name) <= 63 and name.startswith(FILL_LEASE_PREFIX)
    assert json.dumps(name).isascii()


def test_a_fence_that_refuses_stops_the_publish(model: Path, tmp_path: Path) -> None:
    """FillOptions.fence (the agent's Lease check) runs before the publish: refused, nothing is published."""
    from warmpool_nodecache.fill import FillOptions, fill_revision
    from warmpool_nodecache.manifest import write_manifest
    from warmpool_nodecache.source import HttpSourceConfig

    from tests.support.range_server import serve_directory
    from warmpool.lease import LeaseLostError

    served = tmp_path / "served"
    shutil.copytree(model, served)
    manifest = build_manifest(served, block_size=BLOCK)
    write_manifest(served, manifest)
    layout = CacheLayout(tmp_path / "cache")
    calls: list[str] = []

    def refuse() -> None:
        calls.append("fence")
        raise LeaseLostError("taken over by version 2")

    with serve_directory(served) as server:
        source = HttpSource(HttpSourceConfig(server.url, timeout_s=10, attempts=2, backoff_s=0.05))
        with pytest.raises(LeaseLostError, match="version 2"):
            fill_revision(layout, source, options=FillOptions(fence=refuse))
        assert calls and not layout.revision(manifest.digest_hex).exists()
        # Its view stays, sealed, with the journal of what is durable in it: the next fill resumes from it.
        assert sorted(p.name for p in layout.staging.glob(f"{manifest.digest_hex}.*")) == [
            f"{manifest.digest_hex}.1", f"{manifest.digest_hex}.1.done"]
        result = fill_revision(layout, source, options=FillOptions(fence=lambda: calls.append("ok")))
    assert result.filled_here and result.blocks_fetched == 0  # every block was kept from the fenced fill
    assert not list(layout.staging.iterdir())
    assert calls[-1] == "ok" and layout.revision(manifest.digest_hex).is_dir()


def test_the_revisions_pods_mount_are_read_from_their_annotation() -> None:
    a, b = "ab" * 32, "cd" * 32

    def pod(value: object, phase: str = "Running") -> dict[str, Any]:
        return {"metadata": {"annotations": {ANNOTATION_CACHE_REVISION: value}}, "status": {"phase": phase}}

    pods = [pod(f"sha256:{a}"), pod(f"sha256:{b}", phase="Pending"), pod(f"sha256:{a}"),
            pod(f"sha256:{'ef' * 32}", phase="Succeeded"), pod(f"sha256:{'12' * 32}", phase="Failed"),
            pod("sha256:../../etc"), pod(a), pod(7), {"metadata": {}}, {"status": {}}]
    assert agent.mounted_revisions(pods) == {a, b}
