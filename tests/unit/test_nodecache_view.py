"""A fill's view without a partial start (every fill lays its revision out this way now): the fetch
threads write the verified bytes straight into the revision's files -- their only copy: no block
file beside them --, the commit syncs and journals them, a block the store holds (a block file, or
a published revision's file) is copied in, a killed fill's view is taken over from its journal,
and there is no progress record or link."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from warmpool_nodecache.blocks import BlockStore
from warmpool_nodecache.journal import journal_path, read_journal
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import Manifest, build_manifest
from warmpool_nodecache.partial import PartialView, clones_here, resumable_view

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


def test_blocks_written_by_the_fetch_threads_are_their_only_copy_and_journaled_at_commit(tmp_path: Path) -> None:
    manifest, blocks, weights = _revision(tmp_path)
    layout = CacheLayout(tmp_path / "cache")
    layout.staging.mkdir(parents=True)
    store = BlockStore(layout)
    view_dir = layout.staging / f"{manifest.digest_hex}.1"
    view = PartialView(store, manifest, view_dir, None)
    view.create()
    weight_shas = [r.sha256 for r in manifest.block_refs() if r.path == "model.safetensors"]
    for sha in weight_shas:
        view.write(sha, blocks[sha])
    assert (view_dir / "model.safetensors").read_bytes() == weights  # in place before any commit
    assert read_journal(journal_path(view_dir)) == set()  # ...but journaled only once committed
    # Committed without a read of the store: none of these blocks is in it (a copy would fail).
    view.place(weight_shas)
    assert read_journal(journal_path(view_dir)) == set(weight_shas)
    assert store.all_blocks() == set()  # the bytes went to disk once: no block file beside them
    config = next(r.sha256 for r in manifest.block_refs() if r.path == "config.json")
    store.put(config, blocks[config])
    view.place([config])  # a block the store holds: copied (cloned where the filesystem can), never linked
    methods = dict(zip((f.path for f in manifest.files), view.finish(), strict=True))
    held = "reflink" if clones_here(view_dir) else "copy"
    assert methods == {"model.safetensors": "write", "config.json": held}
    assert (view_dir / "config.json").read_bytes() == b'{"x": 1}'
    # Its own inode: nothing written through the block's path can reach the revision's file.
    assert (view_dir / "config.json").stat().st_nlink == 1 and layout.block(config).stat().st_nlink == 1
    assert (view_dir / "model.safetensors").stat().st_mode & 0o222 == 0  # sealed read-only
    assert not progress_path(view_dir).exists() and not layout.partial_link(manifest.digest_hex).exists()


def _publish(layout: CacheLayout, manifest: Manifest, src: Path) -> Path:
    final = layout.revision(manifest.digest_hex)
    final.parent.mkdir(parents=True, exist_ok=True)
    layout.manifests.mkdir(parents=True, exist_ok=True)
    layout.manifest(manifest.digest_hex).write_text(manifest.to_text())
    final.mkdir()
    for f in manifest.files:
        (final / f.path).write_bytes((src / f.path).read_bytes())
    return final


def test_the_store_finds_a_block_inside_a_published_revision_and_a_view_copies_it_from_there(tmp_path: Path) -> None:
    manifest, blocks, weights = _revision(tmp_path)
    layout = CacheLayout(tmp_path / "cache")
    store = BlockStore(layout)
    assert not any(store.has(sha) for sha in blocks)
    _publish(layout, manifest, tmp_path / "src")
    for ref in manifest.block_refs():
        assert store.read(ref.sha256) == blocks[ref.sha256]
    # Another revision sharing two of its blocks: placed from the published files at creation.
    other = tmp_path / "other"
    other.mkdir()
    changed = weights[:2 * BS] + b"\1" * (len(weights) - 2 * BS)
    (other / "model.safetensors").write_bytes(changed)
    second = build_manifest(other, BS)
    layout.staging.mkdir(parents=True)
    view_dir = layout.staging / f"{second.digest_hex}.1"
    view = PartialView(store, second, view_dir, None)
    view.create()
    shared = [r for r in second.block_refs() if r.index < 2]
    for ref in second.block_refs():
        if ref.index >= 2:
            view.write(ref.sha256, changed[ref.offset:ref.offset + ref.length])
    view.place([r.sha256 for r in second.block_refs()])
    assert view.finish() == ("copy+write",) or clones_here(view_dir)
    assert (view_dir / "model.safetensors").read_bytes() == changed
    assert read_journal(journal_path(view_dir)) >= {r.sha256 for r in shared}
    assert store.all_blocks() == set()


def test_a_killed_fills_view_is_taken_over_with_only_the_journaled_blocks_its_domain_verified(tmp_path: Path) -> None:
    manifest, blocks, weights = _revision(tmp_path)
    layout = CacheLayout(tmp_path / "cache")
    layout.staging.mkdir(parents=True)
    store = BlockStore(layout)
    refs = [r for r in manifest.block_refs() if r.path == "model.safetensors"]
    first = PartialView(store, manifest, layout.staging / f"{manifest.digest_hex}.1", None)
    first.create()
    for ref in refs[:3]:
        first.write(ref.sha256, blocks[ref.sha256])
    first.place([r.sha256 for r in refs[:2]])  # committed: durable and journaled
    first.write(refs[3].sha256, b"\0" * refs[3].length)  # torn, never committed (a crash mid-write)
    # The process dies here: no finish, no publish; its view and journal stay in staging.
    old = resumable_view(layout.staging, manifest.digest_hex)
    assert old == layout.staging / f"{manifest.digest_hex}.1"
    vouched = {refs[0].sha256}  # this domain verified block 0 itself; block 1 came from another's source
    second_dir = layout.staging / f"{manifest.digest_hex}.2"
    second = PartialView(store, manifest, second_dir, None, vouched=vouched.__contains__)
    second.create(resume_from=old)
    assert not old.exists() and not journal_path(old).exists() and second_dir.is_dir()
    assert second.resumed == vouched
    assert second.has(refs[0].sha256) and not any(second.has(r.sha256) for r in refs[1:])
    for ref in refs[1:]:  # what the fill then fetches: every block but the one kept
        second.write(ref.sha256, blocks[ref.sha256])
    config = next(r.sha256 for r in manifest.block_refs() if r.path == "config.json")
    second.write(config, blocks[config])
    second.place(blocks)
    second.finish()
    assert (second_dir / "model.safetensors").read_bytes() == weights
    assert (second_dir / "config.json").read_bytes() == b'{"x": 1}'


def test_a_view_whose_files_are_not_all_there_is_not_taken_over(tmp_path: Path) -> None:
    manifest, blocks, _ = _revision(tmp_path)
    layout = CacheLayout(tmp_path / "cache")
    layout.staging.mkdir(parents=True)
    store = BlockStore(layout)
    ref = next(r for r in manifest.block_refs() if r.path == "model.safetensors")
    first = PartialView(store, manifest, layout.staging / f"{manifest.digest_hex}.1", None)
    first.create()
    first.write(ref.sha256, blocks[ref.sha256])
    first.place([ref.sha256])
    first.close()
    (layout.staging / f"{manifest.digest_hex}.1" / "model.safetensors").unlink()
    second = PartialView(store, manifest, layout.staging / f"{manifest.digest_hex}.2", None)
    second.create(resume_from=layout.staging / f"{manifest.digest_hex}.1")
    assert second.resumed == frozenset() and not second.has(ref.sha256)
    # The earlier view and its journal are gone: only the new view is left in staging.
    assert sorted(p.name for p in layout.staging.iterdir()) == [f"{manifest.digest_hex}.2",
                                                                f"{manifest.digest_hex}.2.done"]


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
