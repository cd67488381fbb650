"""Eviction with a cached manifest that no longer parses (a damaged disk, a hand edit): it goes on
-- once, it stopped every later eviction for good -- names the manifest, and leaves the damaged
revision's files whole."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from warmpool_nodecache.evict import evict
from warmpool_nodecache.fill import fill_revision
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import Manifest, build_manifest, write_manifest
from warmpool_nodecache.source import HttpSource, HttpSourceConfig
from warmpool_nodecache.use import pinned

from tests.support.range_server import serve_directory

pytestmark = pytest.mark.unit

BLOCK = 8 * 1024


def _source_dir(root: Path, seed: int) -> tuple[Path, Manifest]:
    root.mkdir(parents=True)
    (root / "weights.bin").write_bytes(os.urandom(5 * BLOCK + 17) + bytes([seed]))
    (root / "config.json").write_text(f'{{"seed": {seed}}}')
    manifest = build_manifest(root, block_size=BLOCK)
    write_manifest(root, manifest)
    return root, manifest


def _fill(layout: CacheLayout, root: Path) -> Path:
    with serve_directory(root) as server:
        return fill_revision(layout, HttpSource(HttpSourceConfig(server.url, timeout_s=10, attempts=2))).path


def test_an_unparsable_cached_manifest_does_not_stop_eviction(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path / "cache")
    src_a, a = _source_dir(tmp_path / "a", 1)
    src_b, b = _source_dir(tmp_path / "b", 2)
    revision_a, revision_b = _fill(layout, src_a), _fill(layout, src_b)
    layout.manifest(a.digest_hex).write_text('{"format": "warmpool.manifest/v1", "files": [')  # cut short
    with pinned(layout, a.digest_hex):  # in use: kept, whatever its manifest says
        result = evict(layout, budget_bytes=0)
    assert result.evicted == (b.digest_hex,) and not revision_b.exists()
    assert result.unreadable == (a.digest_hex,)
    for name in ("weights.bin", "config.json"):  # the damaged revision's files do not need the block names
        assert (revision_a / name).read_bytes() == (src_a / name).read_bytes()
    # And the next eviction runs too (it used to fail on every pass from here on).
    again = evict(layout, budget_bytes=0)
    assert again.evicted == (a.digest_hex,) and again.unreadable == ()
    assert not revision_a.exists()
    assert not [p for p in layout.blocks.rglob("*") if p.is_file()]
