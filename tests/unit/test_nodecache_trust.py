"""Trust domains of the node cache (warmpool_nodecache.trust): a block digest is not a capability.

One namespace fills a real tiny checkpoint; another names the same block hashes from a source
that answers HEAD with the right sizes and never sends one of those bytes.  It gets no revision
of the first one's bytes -- neither under a manifest of its own nor under the very same manifest
-- while a namespace whose source does send the bytes gets the revision, the store keeping one
copy (disk dedup across namespaces; downloads saved only inside one)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from warmpool_nodecache.blocks import BlockCorruptError, BlockStore
from warmpool_nodecache.fill import FillOptions, fill_revision
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import Manifest, build_manifest, write_manifest
from warmpool_nodecache.source import HttpSource, HttpSourceConfig
from warmpool_nodecache.trust import granted

from tests.support.hostile_server import HostileServer, fixed, hostile_server
from tests.support.range_server import RangeServer, serve_directory
from warmpool.contract.files import MANIFEST_FILENAME

pytestmark = pytest.mark.unit

BLOCK = 16 * 1024


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    from warmpool_dev.testing_models import make_tiny_llama

    root = make_tiny_llama(tmp_path_factory.mktemp("m") / "tiny", layers=2, seed=5)
    manifest = build_manifest(root, block_size=BLOCK)
    write_manifest(root, manifest)
    return root, manifest


@pytest.fixture()
def honest(model: tuple[Path, Manifest]) -> Iterator[RangeServer]:
    with serve_directory(model[0]) as server:
        yield server


def _source(url: str) -> HttpSource:
    return HttpSource(HttpSourceConfig(url, timeout_s=5, attempts=2, backoff_s=0.01))


def _head_only(server: HostileServer, manifest: Manifest) -> None:
    """The manifest, and for every file it names the right size on HEAD and zeros on GET: the
    source knows the hashes, never the bytes."""
    server.state.routes["/" + MANIFEST_FILENAME] = fixed(manifest.to_text().encode())
    for f in manifest.files:
        server.state.routes["/" + f.path] = fixed(b"\0" * f.size)


def _filled_by_team_a(layout: CacheLayout, honest: RangeServer) -> None:
    result = fill_revision(layout, _source(honest.url), options=FillOptions(domain="team-a"))
    assert result.filled_here and granted(layout, result.path.name, "team-a")


def test_a_head_only_source_naming_anothers_blocks_gets_no_revision_of_them(
    model: tuple[Path, Manifest], honest: RangeServer, tmp_path: Path,
) -> None:
    _, manifest = model
    layout = CacheLayout(tmp_path / "cache")
    _filled_by_team_a(layout, honest)
    # Team b's own manifest (one more file of its own, so another digest) lists team a's blocks.
    extra = dataclasses.replace(manifest.files[0], path="extra.json")
    theirs = dataclasses.replace(manifest, files=(*manifest.files, extra))
    assert theirs.digest != manifest.digest
    with hostile_server() as server:
        _head_only(server, theirs)
        with pytest.raises(BlockCorruptError, match="never matched"):
            fill_revision(layout, _source(server.url), options=FillOptions(domain="team-b", block_attempts=1))
        assert server.state.count("/") > 0
    assert not layout.revision(theirs.digest_hex).exists()
    assert not granted(layout, theirs.digest_hex, "team-b")
    assert not list(layout.staging.glob(f"{theirs.digest_hex}*"))  # no view of team a's bytes left either
    assert granted(layout, manifest.digest_hex, "team-a")  # team a's revision untouched


def test_the_same_manifest_from_a_head_only_source_is_not_linked_for_another_namespace(
    model: tuple[Path, Manifest], honest: RangeServer, tmp_path: Path,
) -> None:
    """The very manifest (the same digest, so the revision is published already): the namespace
    gets its link -- the only path its pods mount -- only once its own source sent every byte."""
    _, manifest = model
    layout = CacheLayout(tmp_path / "cache")
    _filled_by_team_a(layout, honest)
    with hostile_server() as server:
        _head_only(server, manifest)
        for partial in (False, True):
            with pytest.raises(BlockCorruptError, match="never matched"):
                fill_revision(layout, _source(server.url),
                              options=FillOptions(domain="team-b", block_attempts=1, partial_view=partial))
    assert not granted(layout, manifest.digest_hex, "team-b")
    assert not layout.partial_link(manifest.digest_hex, "team-b").exists()


def test_a_namespace_whose_source_sends_the_bytes_shares_the_stored_copy(
    model: tuple[Path, Manifest], honest: RangeServer, tmp_path: Path,
) -> None:
    _, manifest = model
    layout = CacheLayout(tmp_path / "cache")
    _filled_by_team_a(layout, honest)
    blocks_before = BlockStore(layout).all_blocks()
    unique = sum(length for length in {r.sha256: r.length for r in manifest.block_refs()}.values())
    first = fill_revision(layout, _source(honest.url), options=FillOptions(domain="team-b", partial_view=True))
    # Fetched and verified by team b itself (download dedup only inside a namespace) ...
    assert (first.blocks_fetched, first.bytes_fetched) == (len(manifest.unique_blocks()), unique)
    assert granted(layout, manifest.digest_hex, "team-b")
    revision = layout.revision(manifest.digest_hex).resolve()
    assert layout.partial_link(manifest.digest_hex, "team-b").resolve() == revision
    # ... kept once on disk (disk dedup across namespaces): the same revision, the same blocks.
    assert BlockStore(layout).all_blocks() == blocks_before
    assert first.path == layout.revision(manifest.digest_hex)
    again = fill_revision(layout, _source(honest.url), options=FillOptions(domain="team-b"))
    assert again.bytes_fetched == 0  # verified once, inside the namespace


def test_inside_one_namespace_a_block_already_verified_is_not_fetched_again(
    model: tuple[Path, Manifest], honest: RangeServer, tmp_path: Path,
) -> None:
    root, manifest = model
    layout = CacheLayout(tmp_path / "cache")
    _filled_by_team_a(layout, honest)
    # A second revision of team a: the same files plus one small new one.
    other = tmp_path / "other"
    other.mkdir()
    for f in manifest.files:
        (other / f.path).write_bytes((root / f.path).read_bytes())
    (other / "notes.json").write_text(json.dumps({"revision": 2}))
    write_manifest(other, second := build_manifest(other, block_size=BLOCK))
    with serve_directory(other) as server:
        result = fill_revision(layout, _source(server.url), options=FillOptions(domain="team-a"))
    assert result.filled_here and result.blocks_fetched == 1  # only the new file's block
    assert granted(layout, second.digest_hex, "team-a")


def test_a_trust_domain_must_be_a_namespace_name() -> None:
    with pytest.raises(ValueError, match="not a namespace name"):
        FillOptions(domain="../x").check()
    with pytest.raises(ValueError, match="not a namespace name"):
        CacheLayout(Path("/c")).granted_link("ab" * 32, "Team_A")
