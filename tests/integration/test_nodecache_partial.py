"""A real worker process started on a partial node cache: a hot-first fill (partial view) from a real
loopback HTTP source, held back after the blocks the first layer needs, so the worker loads that layer
on a partial revision for certain; then released (the worker faults in the rest and answers the same
greedy text as on the complete model) or failed at the source (the waiting worker exits with an error
naming the file and the layer, never reading a hole)."""

from __future__ import annotations

import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from warmpool_nodecache import agent
from warmpool_nodecache.fill import FillOptions, FillResult, fill_revision
from warmpool_nodecache.journal import journal_path
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import Manifest, build_manifest, write_manifest
from warmpool_nodecache.source import HttpSource, HttpSourceConfig

from tests.support.partial_worker import (
    Worker,
    greedy,
    headers_of,
    ready,
    run_worker,
    start_order_through_layer0,
    until,
)
from tests.support.range_server import RangeServer, serve_directory
from warmpool.fill_progress import STATE_FAILED, STATE_PUBLISHED, progress_path, read_progress

pytestmark = pytest.mark.integration

BLOCK = 64 * 1024


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from warmpool_dev.testing_models import make_tiny_llama

    # ~1.3 MB: 20 blocks of 64 KiB, each decoder layer over several of them.
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "m", layers=4, hidden=128, intermediate=256,
                           vocab_size=512, seed=3)


def _reference(model: Path, tmp_path: Path) -> str:
    with run_worker(model, tmp_path / "reference.log") as worker:
        until("ready", lambda: ready(worker), worker)
        return greedy(worker)


def _publish(model: Path, dest: Path) -> Manifest:
    shutil.copytree(model, dest)
    manifest = build_manifest(dest, BLOCK)
    write_manifest(dest, manifest)
    return manifest


def _fill_in_thread(layout: CacheLayout, server: RangeServer, manifest: Manifest, src: Path
                    ) -> tuple[threading.Thread, dict[str, object]]:
    order = agent.start_order(manifest, headers_of(src, BLOCK), None)
    source = HttpSource(HttpSourceConfig(server.url, timeout_s=30, attempts=2, backoff_s=0.05))
    # One block in flight and small commit batches: the view advances block by block.
    options = FillOptions(partial_view=True, fetch_workers=1, sync_batch_blocks=2, wait_timeout_s=120)
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            result: FillResult = fill_revision(layout, source, order=order, options=options)
            outcome["result"], outcome["published_at"] = result, time.time()
        except Exception as error:  # the test reads it: a failed fill is one of the cases
            outcome["error"] = error

    thread = threading.Thread(target=run, name="partial-fill", daemon=True)
    thread.start()
    return thread, outcome


def _phase(worker: Worker, phase: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(worker.base + "/metrics", timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "warmpool_coldstart_phase_timestamp_seconds" and sample.labels.get("phase") == phase:
                return float(sample.value)
    return None


def test_worker_starts_on_a_partial_cache_and_answers_as_on_the_full_model(model: Path, tmp_path: Path) -> None:
    expected = _reference(model, tmp_path)
    manifest = _publish(model, tmp_path / "src")
    first, rest = start_order_through_layer0(tmp_path / "src", manifest, BLOCK)
    assert rest, "the model must not fit in the blocks before layer 1"
    layout = CacheLayout(tmp_path / "cache")
    link = layout.partial_link(manifest.digest_hex)
    with serve_directory(tmp_path / "src") as server:
        server.state.held = {(r.path, r.offset) for r in rest}
        # Started before the fill: it waits for the view to appear, then for each range it reads.
        with run_worker(link, tmp_path / "partial.log", "--partial-cache", "--partial-cache-timeout", "120") as worker:
            thread, outcome = _fill_in_thread(layout, server, manifest, tmp_path / "src")
            try:
                until("layer 0 on the partial view", lambda: "layer 0 loaded" in worker.text(), worker)
                # Layer 0 came from the view while the rest of the revision was held at the source.
                assert not layout.revision(manifest.digest_hex).exists()
                assert server.state.block_requests() == len(first)
                assert "filling" in worker.text()  # it opened a view that was not complete
            finally:
                server.state.release.set()
            thread.join(timeout=120)
            assert "result" in outcome, outcome
            until("ready", lambda: ready(worker), worker)
            assert greedy(worker) == expected
            first_layer, published_at = _phase(worker, "first_layer_ready"), outcome["published_at"]
            assert isinstance(published_at, float) and first_layer is not None and first_layer < published_at
    record = read_progress(progress_path(layout.revision(manifest.digest_hex)))  # renamed with its view
    assert record is not None and record.state == STATE_PUBLISHED and record.complete
    assert link.resolve() == layout.revision(manifest.digest_hex).resolve()
    for f in manifest.files:  # the published revision is the source's bytes
        assert (layout.revision(manifest.digest_hex) / f.path).read_bytes() == (model / f.path).read_bytes()


def test_a_fill_failing_midway_fails_the_waiting_worker_with_the_file_and_layer(model: Path, tmp_path: Path) -> None:
    manifest = _publish(model, tmp_path / "src")
    _, rest = start_order_through_layer0(tmp_path / "src", manifest, BLOCK)
    layout = CacheLayout(tmp_path / "cache")
    with serve_directory(tmp_path / "src") as server:
        server.state.held = {(r.path, r.offset) for r in rest}
        server.state.held_status = 503  # the source breaks: the held blocks never come
        with run_worker(layout.partial_link(manifest.digest_hex), tmp_path / "partial.log",
                     "--partial-cache", "--partial-cache-timeout", "120") as worker:
            thread, outcome = _fill_in_thread(layout, server, manifest, tmp_path / "src")
            try:
                until("layer 0 on the partial view", lambda: "layer 0 loaded" in worker.text(), worker)
            finally:
                server.state.release.set()
            thread.join(timeout=120)
            assert "error" in outcome and "HTTP 503" in str(outcome["error"]), outcome
            until("exit", lambda: worker.proc.poll() is not None, worker, timeout_s=60)
            assert worker.proc.returncode == 1, worker.text()
    text = worker.text()
    weights = layout.partial_link(manifest.digest_hex) / "model.safetensors"
    assert f"model load failed: {weights}: layer 1: tensor " in text, text[-3000:]
    assert "the node cache's fill of " in text and "failed: SourceError" in text
    assert "ready:" not in text
    view = layout.staging / f"{manifest.digest_hex}.1"
    record = read_progress(progress_path(view))
    assert record is not None and record.state == STATE_FAILED and "HTTP 503" in (record.error or "")
    assert not layout.revision(manifest.digest_hex).exists()
    # Its record says why (the worker's pod mounts the view); its files stay beside the journal of
    # what is durable in them, for the next fill to resume from.
    assert sorted(p.name for p in view.iterdir()) == sorted([progress_path(view).name,
                                                             *(f.path.split("/")[0] for f in manifest.files)])
    assert journal_path(view).is_file()
    assert not layout.partial_link(manifest.digest_hex).is_symlink()


def test_a_published_revision_keeps_its_record_until_evicted_and_the_link_follows(model: Path, tmp_path: Path) -> None:
    from warmpool_nodecache.evict import evict

    manifest = _publish(model, tmp_path / "src")
    layout = CacheLayout(tmp_path / "cache")
    link = layout.partial_link(manifest.digest_hex)
    with serve_directory(tmp_path / "src") as server:
        source = HttpSource(HttpSourceConfig(server.url, timeout_s=30, attempts=2, backoff_s=0.05))
        result = fill_revision(layout, source, options=FillOptions(partial_view=True))
        record = progress_path(result.path)  # inside the revision, renamed with its view
        assert result.filled_here and link.resolve() == result.path.resolve() and record.is_file()
        link.unlink()  # e.g. published by a fill without a view: asking again with one names it
        again = fill_revision(layout, source, options=FillOptions(partial_view=True))
        assert not again.filled_here and link.resolve() == result.path.resolve()
    assert evict(layout, 10 * manifest.total_bytes).evicted == ()  # under budget: kept, record too
    assert record.is_file()
    assert evict(layout, 0).evicted == (manifest.digest_hex,)
    assert not record.exists() and not link.is_symlink() and not result.path.exists()


def test_a_fill_stalled_on_one_block_longer_than_its_lease_ttl_keeps_the_lease(model: Path, tmp_path: Path) -> None:
    """A worker waiting on a partial view may keep a block's source busy for long: the filler,
    alive and waiting, renews its lease meanwhile instead of losing it at the next block."""
    manifest = _publish(model, tmp_path / "src")
    layout = CacheLayout(tmp_path / "cache")
    stalled = next(r for r in manifest.block_refs() if r.path == "model.safetensors" and r.index == 3)
    with serve_directory(tmp_path / "src") as server:
        server.state.held = {(stalled.path, stalled.offset)}
        release = threading.Timer(3.0, server.state.release.set)  # 3 lease TTLs
        release.start()
        try:
            source = HttpSource(HttpSourceConfig(server.url, timeout_s=30, attempts=1))
            result = fill_revision(layout, source, options=FillOptions(lease_ttl_s=1.0, partial_view=True))
        finally:
            release.cancel()
            server.state.release.set()
    assert result.filled_here and layout.revision(manifest.digest_hex).is_dir()
