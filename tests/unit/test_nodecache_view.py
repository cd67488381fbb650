"""A fill's view without a partial start (every fill lays its revision out this way now): the fetch
threads write the verified bytes straight into the revision's files, the commit only lists them, a
block another fill stored meanwhile is copied at the end, and there is no progress record or link."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from warmpool_nodecache.blocks import BlockStore
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import Manifest, build_manifest
from warmpool_nodecache.partial import PartialView, clones_here

from warmpool.fill_progress import progress_path

pytestmark = pytest.mark.unit

BS = 4096


def _revision(tmp_path: Path) -> tuple[Manifest, dict[str, bytes], bytes]:
    src = tmp_path / "src"
    src.mkdir()
    weights = b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(3 * BS // 32)) + b"tail"  # 4 blocks
    (src / "model.safetensors").write_bytes(weights)
    (src / "config.json").write_bytes(b'{"x": 1}')
    manifest = build_manifest(src, BS)
    blocks = {ref.sha256: weights[ref.offset:ref.offset + ref.length] if ref.path == "model.safetensors"
              else b'{"x": 1}' for ref in manifest.block_refs()}
    return manifest, blocks, weights


def test_blocks_written_by_the_fetch_threads_are_only_listed_at_commit(tmp_path: Path) -> None:
    manifest, blocks, weights = _revision(tmp_path)
    layout = CacheLayout(tmp_path / "cache")
    layout.staging.mkdir(parents=True)
    store = BlockStore(layout)
    view_dir = layout.staging / f"{manifest.digest_hex}.1"
    view = PartialView(store, manifest, view_dir, None)
    view.create()
    if clones_here(view_dir):
        pytest.skip("this filesystem clones: blocks are cloned from the store at commit, not written")
    weight_shas = [r.sha256 for r in manifest.block_refs() if r.path == "model.safetensors"]
    for sha in weight_shas:
        view.write(sha, blocks[sha])
    assert (view_dir / "model.safetensors").read_bytes() == weights  # in place before any commit
    # Listed without a read of the store: none of these blocks is in it (a copy would fail).
    view.place(weight_shas)
    config = next(r.sha256 for r in manifest.block_refs() if r.path == "config.json")
    store.put(config, blocks[config])
    view.place([config])  # a file of one block: a hard link to the committed block
    methods = dict(zip((f.path for f in manifest.files), view.finish(), strict=True))
    assert methods == {"model.safetensors": "write", "config.json": "hardlink"}
    assert (view_dir / "config.json").read_bytes() == b'{"x": 1}'
    assert (view_dir / "model.safetensors").stat().st_mode & 0o222 == 0  # sealed read-only
    assert not progress_path(view_dir).exists() and not layout.partial_link(manifest.digest_hex).exists()


def test_a_block_stored_by_another_fill_after_the_view_was_made_is_copied_in_at_the_end(tmp_path: Path) -> None:
    manifest, blocks, weights = _revision(tmp_path)
    layout = CacheLayout(tmp_path / "cache")
    layout.staging.mkdir(parents=True)
    store = BlockStore(layout)
    view_dir = layout.staging / f"{manifest.digest_hex}.1"
    view = PartialView(store, manifest, view_dir, None)
    view.create()
    for sha, data in blocks.items():
        store.put(sha, data)  # another revision's fill stored them: this fill skips them as held
    view.finish()
    assert (view_dir / "model.safetensors").read_bytes() == weights
    assert (view_dir / "config.json").read_bytes() == b'{"x": 1}'
