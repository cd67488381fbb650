"""The fill's pipeline for real (a tiny safetensors checkpoint over loopback HTTP with Range): several
blocks in flight but never more than asked, blocks committed (durable, journaled) in the fill's
hot-first order, and a source failing mid-fill cancelling the rest and leaving a view a later fill
resumes from."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path

import pytest
from warmpool_nodecache.blocks import BlockStore
from warmpool_nodecache.fill import FillOptions, fill_revision
from warmpool_nodecache.journal import journaled
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import Manifest, build_manifest, write_manifest
from warmpool_nodecache.order import files_first
from warmpool_nodecache.source import HttpSource, HttpSourceConfig, SourceError

from tests.support.range_server import serve_directory

pytestmark = pytest.mark.integration

BLOCK = 16 * 1024  # the tiny checkpoint's ~437 kB spans ~28 blocks
BOUND_S = 30.0  # how long a fetch waits for the others before the test fails (never reached when it passes)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from warmpool_dev.testing_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "m", layers=2, seed=3)


def _publish(model: Path, dest: Path) -> Manifest:
    shutil.copytree(model, dest)
    manifest = build_manifest(dest, block_size=BLOCK)
    write_manifest(dest, manifest)
    return manifest


class WatchedSource:
    """The real HttpSource, watched: how many fetches run at once, and what the fill had committed as each starts."""

    def __init__(self, inner: HttpSource, layout: CacheLayout, digest_hex: str, order: list[str],
                 together: int) -> None:
        self.inner, self.layout, self.digest_hex, self.order = inner, layout, digest_hex, order
        self.lock = threading.Lock()
        self.running = self.most_running = self.calls = 0
        self.barrier = threading.Barrier(together)  # the first `together` fetches pass only if they run at once
        self.together = together
        self.snapshots: list[list[bool]] = []
        self.before_fetch: dict[tuple[str, int], threading.Event] = {}

    def describe(self) -> str:
        return self.inner.describe()

    def fetch_manifest(self) -> bytes:
        return self.inner.fetch_manifest()

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def _held(self) -> list[bool]:
        done = journaled(self.layout, self.digest_hex)  # appended in commit order; a torn line is not listed
        return [sha in done for sha in self.order]

    def fetch_range(self, path: str, offset: int, length: int) -> bytes:
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.calls += 1
            first = self.calls <= self.together
        try:
            self.snapshots.append(self._held())
            if first:
                self.barrier.wait(BOUND_S)
            return self.inner.fetch_range(path, offset, length)
        finally:
            with self.lock:
                self.running -= 1


def _order_shas(manifest: Manifest, names: list[str]) -> list[str]:
    shas: list[str] = []
    for ref in files_first(names)(manifest):
        if ref.sha256 not in shas:
            shas.append(ref.sha256)
    return shas


def _source(url: str) -> HttpSource:
    return HttpSource(HttpSourceConfig(url, timeout_s=10, attempts=2, backoff_s=0.05))


def test_blocks_enter_the_store_in_hot_first_order_with_at_most_fetch_workers_in_flight(
    model: Path, tmp_path: Path
) -> None:
    manifest = _publish(model, tmp_path / "src")
    layout = CacheLayout(tmp_path / "cache")
    hot = ["model.safetensors"]
    order = _order_shas(manifest, hot)
    workers = 3
    with serve_directory(tmp_path / "src") as server:
        source = WatchedSource(_source(server.url), layout, manifest.digest_hex, order, together=workers)
        result = fill_revision(layout, source, order=files_first(hot),
                               options=FillOptions(fetch_workers=workers, sync_batch_blocks=1))
    assert result.blocks_fetched == len(order) == source.calls
    assert source.most_running == workers  # overlapped (the barrier), and never more
    for held in source.snapshots:  # at every fetch, the store held a prefix of the hot-first order
        k = held.count(True)
        assert held == [True] * k + [False] * (len(order) - k)
    assert any(0 < s.count(True) < len(order) for s in source.snapshots)  # blocks entered while others flew
    for path in model.rglob("*"):
        if path.is_file():
            assert (result.path / path.relative_to(model)).read_bytes() == path.read_bytes()


class TruncatingSource(WatchedSource):
    """Cuts the real file at the source short when block `cut` is first asked for: the server then
    answers that range (and every later one) short, and the HttpSource raises SourceError."""

    def __init__(self, inner: HttpSource, layout: CacheLayout, digest_hex: str, order: list[str], file: Path,
                 cut: int) -> None:
        super().__init__(inner, layout, digest_hex, order, together=1)
        self.file, self.cut = file, cut

    def fetch_range(self, path: str, offset: int, length: int) -> bytes:
        if path == self.file.name and offset == self.cut * BLOCK:
            os.truncate(self.file, offset)
        return super().fetch_range(path, offset, length)


def test_a_source_failing_mid_fill_cancels_the_rest_and_leaves_a_cache_to_resume_from(
    model: Path, tmp_path: Path
) -> None:
    manifest = _publish(model, tmp_path / "src")
    layout = CacheLayout(tmp_path / "cache")
    hot = ["model.safetensors"]
    order = _order_shas(manifest, hot)
    workers, cut = 2, 6
    weights = tmp_path / "src" / "model.safetensors"
    with serve_directory(tmp_path / "src") as server:
        source = TruncatingSource(_source(server.url), layout, manifest.digest_hex, order, weights, cut)
        with pytest.raises(SourceError, match="came back"):
            fill_revision(layout, source, order=files_first(hot), options=FillOptions(fetch_workers=workers))
        asked = server.state.block_requests()
        assert asked < len(order)  # the blocks after the window were never fetched
        assert not any(t.name.startswith(("fill-fetch", "fill-commit")) for t in threading.enumerate())
        assert not layout.revision(manifest.digest_hex).exists()
        view = layout.staging / f"{manifest.digest_hex}.1"  # left to resume from, with its journal
        assert sorted(p.name for p in layout.staging.iterdir()) == [view.name, f"{view.name}.done"]
        kept = journaled(layout, manifest.digest_hex)
        assert BlockStore(layout).all_blocks() == set()  # the view holds the only copy
        for ref in manifest.block_refs():  # what the journal lists is whole and verified in the view...
            if ref.sha256 in kept:
                with (view / ref.path).open("rb") as fh:
                    fh.seek(ref.offset)
                    assert hashlib.sha256(fh.read(ref.length)).hexdigest() == ref.sha256
        assert kept == set(order[:len(kept)])  # ...a prefix of the order...
        assert 0 < len(kept) <= cut  # ...the blocks verified before the failure, none after it

        shutil.copy2(model / "model.safetensors", weights)  # the source is whole again
        result = fill_revision(layout, _source(server.url), order=files_first(hot))
        assert result.filled_here and result.blocks_fetched == len(order) - len(kept)
        assert server.state.block_requests() - asked == len(order) - len(kept)
    for path in model.rglob("*"):
        if path.is_file():
            assert (result.path / path.relative_to(model)).read_bytes() == path.read_bytes()
