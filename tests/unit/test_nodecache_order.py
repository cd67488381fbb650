"""Fill orders (hottest first) and the LRU-K eviction key: pure functions over real manifests."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from warmpool_nodecache.evict import lru_k_key
from warmpool_nodecache.manifest import Manifest, ManifestError, build_manifest
from warmpool_nodecache.order import files_first, heat_block_order

pytestmark = pytest.mark.unit


def _manifest(tmp_path: Path) -> Manifest:
    (tmp_path / "w.bin").write_bytes(b"x" * 4000 + b"y" * 4000 + b"z" * 2000)  # blocks of 1000: 10
    (tmp_path / "config.json").write_text("{}")
    return build_manifest(tmp_path, block_size=1000)


def test_files_first_puts_the_named_files_blocks_first_and_refuses_unknown_names(tmp_path: Path) -> None:
    manifest = _manifest(tmp_path)
    order = files_first(["w.bin"])(manifest)
    assert [r.path for r in order] == ["w.bin"] * 10 + ["config.json"]
    with pytest.raises(ManifestError, match=r"lacks: \['nope'\]"):
        files_first(["nope"])(manifest)


def test_the_heat_maps_hottest_layer_is_fetched_first(tmp_path: Path) -> None:
    manifest = _manifest(tmp_path)
    # layer 0 lies in bytes 0..3500, layer 1 in 3500..8000 (blocks 3..7), layer 2 in 8000..10000
    ranges = {0: [("w.bin", 0, 3500)], 1: [("w.bin", 3500, 8000)], 2: [("w.bin", 8000, 10000)]}
    order = heat_block_order({1: 9.0, 2: 1.0}, 3, ranges)(manifest)
    assert [r.index for r in order] == [3, 4, 5, 6, 7, 8, 9, 0, 1, 2]  # layer 1, then 2, then 0 (no heat)
    assert [r.index for r in heat_block_order(None, 3, ranges)(manifest)] == list(range(10))
    with pytest.raises(ManifestError, match="which the manifest lacks"):
        heat_block_order(None, 1, {0: [("gone.bin", 0, 1)]})(manifest)


def test_lru_k_evicts_revisions_used_fewer_than_k_times_first_then_by_kth_use() -> None:
    uses = {"once-recent": [100.0], "twice-old": [1.0, 2.0], "twice-new": [50.0, 60.0], "never": []}
    ranked = sorted(uses, key=lambda d: lru_k_key(uses[d]))
    assert ranked == ["never", "once-recent", "twice-old", "twice-new"]
    assert lru_k_key([5.0, 7.0, 9.0]) == (7.0, 9.0) and lru_k_key([]) == (-math.inf, -math.inf)
