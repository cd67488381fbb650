"""The partial view's progress record (warmpool.fill_progress) and the view itself on real files:
which byte ranges are in place, the record replaced whole, blocks written in as they are committed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from warmpool_nodecache.blocks import BlockStore
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import build_manifest
from warmpool_nodecache.partial import PartialView

from warmpool.contract.nodecache import FILL_PROGRESS_NAME
from warmpool.fill_progress import (
    STATE_FAILED,
    STATE_PUBLISHED,
    FileProgress,
    FillProgress,
    FillProgressError,
    merge_intervals,
    parse_progress,
    progress_path,
    read_progress,
    write_progress,
)

pytestmark = pytest.mark.unit

BS = 4096


def _progress(present: tuple[tuple[int, int], ...], size: int = 5 * BS + 100) -> FillProgress:
    return FillProgress("sha256:" + "0" * 64, BS, {"model.safetensors": FileProgress(size, present)})


def test_merge_joins_touching_and_overlapping_intervals() -> None:
    assert merge_intervals([(5, 6), (0, 1), (1, 3), (2, 4), (7, 7)]) == ((0, 4), (5, 6))


def test_a_range_is_covered_only_when_every_block_it_touches_is_present() -> None:
    progress = _progress(((0, 2), (4, 6)))  # blocks 0, 1, 4, 5 (the last one short)
    assert progress.covers("model.safetensors", 0, 2 * BS)
    assert progress.missing("model.safetensors", 2 * BS - 1, 2 * BS + 1) == [2]  # one byte into block 2
    assert progress.missing("model.safetensors", BS, 5 * BS) == [2, 3]
    assert progress.covers("model.safetensors", 4 * BS, 5 * BS + 100)  # the short last block
    assert progress.covers("model.safetensors", 3 * BS, 3 * BS)  # empty: nothing to wait for
    assert not progress.complete and _progress(((0, 6),)).complete
    with pytest.raises(FillProgressError, match="no file 'other'"):
        progress.missing("other", 0, 1)
    with pytest.raises(FillProgressError, match="outside its"):
        progress.missing("model.safetensors", 0, 6 * BS)


def test_the_record_round_trips_and_bad_records_are_refused(tmp_path: Path) -> None:
    view = tmp_path / "abc.3"
    view.mkdir()
    path = progress_path(view)
    # Inside the view: a worker's pod mounts the view alone, and must see its record.
    assert path.parent == view and path.name == FILL_PROGRESS_NAME and read_progress(path) is None
    record = FillProgress("sha256:" + "1" * 64, BS, {"a": FileProgress(10, ((0, 1),)), "b": FileProgress(0)},
                          STATE_FAILED, "SourceError: gone", 12.5)
    write_progress(path, record)
    assert read_progress(path) == record and [p.name for p in view.iterdir()] == [path.name]
    text = record.to_text()
    for bad, why in [
        (text.replace('"failed"', '"done"'), "state"),
        (text.replace("[[0,1]]", "[[0,2]]"), "past its 1 blocks"),
        (text.replace("[[0,1]]", "[[1,1]]"), "empty"),
        (text.replace('"size":10', '"size":-1'), "size"),
        ("[]", "not a warmpool.fill-progress/v1"),
        ("{", "not JSON"),
    ]:
        with pytest.raises(FillProgressError, match=why):
            parse_progress(bad, "rec")


def test_the_view_lays_out_files_writes_committed_blocks_and_lists_them(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    weights = b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(3 * BS // 32)) + b"tail"  # 4 blocks
    (src / "model.safetensors").write_bytes(weights)
    (src / "config.json").write_bytes(b'{"x": 1}')  # one block
    (src / "empty.txt").write_bytes(b"")
    manifest = build_manifest(src, BS)
    layout = CacheLayout(tmp_path / "cache")
    store = BlockStore(layout)
    layout.staging.mkdir(parents=True)
    blocks = {ref.sha256: weights[ref.offset:ref.offset + ref.length] if ref.path == "model.safetensors"
              else b'{"x": 1}' for ref in manifest.block_refs()}
    first = next(r for r in manifest.block_refs() if r.path == "model.safetensors" and r.index == 2)
    store.put(first.sha256, blocks[first.sha256])  # held before the fill: placed at creation
    view_dir = layout.staging / f"{manifest.digest_hex}.1"
    view = PartialView(store, manifest, view_dir, layout.partial_link(manifest.digest_hex))
    view.create()
    assert layout.partial_link(manifest.digest_hex).resolve() == view_dir.resolve()
    record = read_progress(progress_path(view_dir))
    assert record is not None and record.files["model.safetensors"].present == ((2, 3),)
    assert (view_dir / "model.safetensors").stat().st_size == len(weights)  # pre-sized
    assert (view_dir / "config.json").stat().st_size == 8  # laid out too, listed only once its block is in
    with open(view_dir / "model.safetensors", "rb") as fh:
        fh.seek(2 * BS)
        assert fh.read(BS) == weights[2 * BS:3 * BS]
    for sha, data in blocks.items():
        store.put(sha, data)
    view.place(blocks)
    record = read_progress(progress_path(view_dir))
    assert record is not None and record.complete
    methods = view.finish()
    assert dict(zip((f.path for f in manifest.files), methods, strict=True))["config.json"] in ("copy", "reflink")
    for f in manifest.files:
        data = (view_dir / f.path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == hashlib.sha256((src / f.path).read_bytes()).hexdigest()
        assert (view_dir / f.path).stat().st_mode & 0o222 == 0  # sealed read-only
    final = layout.revision(manifest.digest_hex)
    final.parent.mkdir(parents=True)
    view_dir.rename(final)
    view.published(final)
    record = read_progress(progress_path(final))  # renamed with its view
    assert record is not None and record.state == STATE_PUBLISHED
    assert layout.partial_link(manifest.digest_hex).resolve() == final.resolve()


def test_a_failed_view_drops_the_link_only_while_it_names_that_view(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_bytes(b"{}")
    manifest = build_manifest(src, BS)
    layout = CacheLayout(tmp_path / "cache")
    layout.staging.mkdir(parents=True)
    link = layout.partial_link(manifest.digest_hex)
    old = PartialView(BlockStore(layout), manifest, layout.staging / f"{manifest.digest_hex}.1", link)
    old.create()
    newer = PartialView(BlockStore(layout), manifest, layout.staging / f"{manifest.digest_hex}.2", link)
    newer.create()  # a holder that took the lease over: the link names its view now
    old.failed(RuntimeError("lease lost"))
    assert link.resolve() == newer.directory.resolve()
    record = read_progress(old.record)
    assert record is not None and record.state == STATE_FAILED and record.error == "RuntimeError: lease lost"
    newer.failed(RuntimeError("source gone"))
    assert not link.is_symlink()
