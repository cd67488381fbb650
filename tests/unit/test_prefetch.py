"""Page-cache prefetch: the weight map, plans by tier, the run, and residency measured with mincore."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from warmpool_worker.prefetch import (
    CORE,
    PAGE,
    Prefetcher,
    PrefetchStopped,
    evict,
    layer_of,
    map_weights,
    page_residency,
    plan_prefetch,
    resident_bytes,
)

from tests.support.prefetch_ranges import file_ranges
from warmpool.contract.api import Tier

pytestmark = pytest.mark.unit

LAYERS = 6
#: 64 KiB per tensor: several pages each, so residency is measured, not rounded away
ROWS = 128


def _tensor(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((ROWS, ROWS), dtype=np.float32)


def make_checkpoint(dest: Path, shards: int = 2, layers: int = LAYERS) -> Path:
    """A Llama-named safetensors checkpoint written by the real library (no torch: unit-fast)."""
    dest.mkdir(parents=True, exist_ok=True)
    tensors = {"model.embed_tokens.weight": _tensor(0), "model.norm.weight": _tensor(1)[0]}
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = _tensor(10 + i)
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = _tensor(100 + i)
    tensors["lm_head.weight"] = _tensor(2)
    (dest / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers}))
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(dest / "model.safetensors"))
        return dest
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per : (s + 1) * per]}
        save_file(part, str(dest / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dest


def _eviction_works(paths: list[Path]) -> bool:
    for path in paths:
        with path.open("rb") as handle:
            os.fsync(handle.fileno())  # dirty pages cannot be dropped: write them back first
    evict(paths)
    measured = resident_bytes(file_ranges(paths))
    return measured is not None and measured[0] == 0


def test_layer_of_common_families() -> None:
    assert layer_of("model.layers.12.mlp.up_proj.weight") == 12
    assert layer_of("transformer.h.3.attn.c_attn.weight") == 3
    assert layer_of("blocks.0.norm.weight") == 0
    assert layer_of("model.embed_tokens.weight") is None
    assert layer_of("lm_head.weight") is None


@pytest.mark.parametrize("name", ["model.layers.\u0663.mlp.weight", "model.layers.\uff13.mlp.weight",
                                  "model.layers.123456.mlp.weight", "model.layers." + "9" * 5000 + ".mlp.weight"])
def test_a_layer_index_is_at_most_five_ascii_digits(name: str) -> None:
    """Tensor names come from a tenant's checkpoint: other scripts' digits are not an index, and a
    huge one is not a layer (int() raised past 4,300 digits; smaller ones sized the layer order)."""
    assert layer_of(name) is None
    assert layer_of("model.layers.99999.mlp.weight") == 99999


def test_map_covers_every_byte_by_layer(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "m", shards=2)
    weights = map_weights(model)
    assert weights.errors == []
    assert weights.num_layers == LAYERS
    assert sorted(weights.layers) == list(range(LAYERS))
    files = sorted(model.glob("*.safetensors"))
    # headers + tensors tile each file: the map accounts for every byte exactly once
    assert weights.total_bytes == sum(p.stat().st_size for p in files)
    assert weights.core.name == CORE and weights.core.nbytes > 2 * ROWS * ROWS * 4
    assert all(g.nbytes == 2 * ROWS * ROWS * 4 for g in weights.layers.values())


def test_plan_by_tier_and_heat_order(tmp_path: Path) -> None:
    weights = map_weights(make_checkpoint(tmp_path / "m"))
    order = [4, 1, 5, 0, 2, 3]
    assert plan_prefetch(weights, Tier.PAUSED, order) == []
    truncated = plan_prefetch(weights, Tier.TRUNCATED, order, hot_layer_percent=30)
    assert [g.name for g in truncated] == [CORE, "layer 4", "layer 1"]  # ceil(6 * 30 %) = 2 hottest
    full = plan_prefetch(weights, Tier.FULL, order)
    assert [g.layer for g in full] == [None, *order]
    assert [g.layer for g in plan_prefetch(weights, Tier.UNKNOWN, order)] == [None, *order]


def test_prefetch_lands_in_page_cache(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "m", shards=2)
    files = sorted(model.glob("*.safetensors"))
    weights = map_weights(model)  # reads the headers: evict after, so "before" starts from nothing
    if not _eviction_works(files):
        pytest.skip("this filesystem keeps pages resident after POSIX_FADV_DONTNEED (tmpfs?)")
    groups = plan_prefetch(weights, Tier.FULL, list(range(LAYERS)))
    seen: list[int] = []
    report = Prefetcher(weights, chunk_bytes=64 * 1024).run(
        groups, Tier.FULL, on_progress=lambda r: seen.append(r.read_bytes)
    )
    assert report.state == "done"
    assert report.resident_before == 0
    assert report.read_bytes == weights.total_bytes
    resident = resident_bytes(file_ranges(files))
    assert resident is not None
    assert report.resident_after == resident[0] == resident[1]  # every page of both files resident
    assert seen and seen == sorted(seen) and seen[-1] == weights.total_bytes  # progress only grows


def test_truncated_prefetch_reads_only_the_hot_share(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "m", shards=1)
    files = [model / "model.safetensors"]
    weights = map_weights(model)
    if not _eviction_works(files):
        pytest.skip("this filesystem keeps pages resident after POSIX_FADV_DONTNEED (tmpfs?)")
    order = [5, 4, 3, 2, 1, 0]
    groups = plan_prefetch(weights, Tier.TRUNCATED, order, hot_layer_percent=30)
    report = Prefetcher(weights).run(groups, Tier.TRUNCATED)
    assert report.read_bytes == weights.core.nbytes + weights.layers[5].nbytes + weights.layers[4].nbytes
    hot = resident_bytes(weights.layers[5].ranges + weights.layers[4].ranges)
    cold = resident_bytes(weights.layers[0].ranges)
    assert hot is not None and hot[0] == hot[1]
    # no readahead past the hot ranges: a cold layer keeps at most the pages it shares with a
    # hot neighbour at its range boundaries (tensors are not page-aligned)
    assert cold is not None and cold[0] <= 4 * PAGE < cold[1]
    everything = resident_bytes(file_ranges(files))
    assert everything is not None and everything[0] < everything[1] // 2


def test_stricter_tier_stops_and_a_deeper_one_tops_up(tmp_path: Path) -> None:
    weights = map_weights(make_checkpoint(tmp_path / "m"))
    order = list(range(LAYERS))
    prefetcher = Prefetcher(weights, chunk_bytes=16 * 1024)
    calls = [0]

    def stop_after_a_while() -> bool:
        calls[0] += 1
        return calls[0] > 12

    with pytest.raises(PrefetchStopped):
        prefetcher.run(plan_prefetch(weights, Tier.FULL, order), Tier.FULL, should_stop=stop_after_a_while)
    assert prefetcher.report.state == "stopped"
    partial = prefetcher.report.read_bytes
    assert 0 < partial < weights.total_bytes
    done_before = set(prefetcher.done)
    report = prefetcher.run(plan_prefetch(weights, Tier.FULL, order), Tier.FULL)
    assert report.state == "done"
    assert prefetcher.done >= done_before
    # groups finished before the stop are not read again: at most the interrupted one is re-read
    assert report.read_bytes < partial + weights.total_bytes


def test_missing_shard_is_reported_and_the_rest_prefetched(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "m", shards=2)
    (model / "model-00002-of-00002.safetensors").unlink()
    weights = map_weights(model)
    assert len(weights.errors) == 1 and "missing" in weights.errors[0]
    assert "model-00002-of-00002.safetensors" in weights.errors[0]
    report = Prefetcher(weights).run(plan_prefetch(weights, Tier.FULL, list(range(LAYERS))), Tier.FULL)
    assert report.state == "done" and report.read_bytes > 0
    assert report.errors == weights.errors


def test_truncated_shard_is_reported_and_skipped(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "m", shards=2)
    shard = model / "model-00001-of-00002.safetensors"
    with shard.open("r+b") as handle:
        handle.truncate(shard.stat().st_size - 1000)
    weights = map_weights(model)
    assert len(weights.errors) == 1 and "truncated" in weights.errors[0]
    assert all(r.path != shard for g in weights.layers.values() for r in g.ranges)
    assert all(r.path != shard for r in weights.core.ranges)


def test_file_shrinking_during_prefetch_is_an_error_not_a_crash(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "m", shards=1)
    weights = map_weights(model)
    with (model / "model.safetensors").open("r+b") as handle:
        handle.truncate(1024)  # after the header was validated: the engine would hit this too
    report = Prefetcher(weights).run(plan_prefetch(weights, Tier.FULL, list(range(LAYERS))), Tier.FULL)
    assert report.state == "done"
    assert report.errors and "short read" in report.errors[0]


def test_no_directory_and_no_weights(tmp_path: Path) -> None:
    assert "does not exist" in map_weights(tmp_path / "nope").errors[0]
    (tmp_path / "empty").mkdir()
    assert "no weight files" in map_weights(tmp_path / "empty").errors[0]


def test_gguf_is_prefetched_whole_only_at_full(tmp_path: Path) -> None:
    (tmp_path / "g").mkdir()
    gguf = tmp_path / "g" / "model.Q4.gguf"
    gguf.write_bytes(os.urandom(300_000))
    weights = map_weights(tmp_path / "g")
    assert weights.errors == [] and len(weights.whole_files) == 1
    assert plan_prefetch(weights, Tier.TRUNCATED, []) == []
    report = Prefetcher(weights).run(plan_prefetch(weights, Tier.FULL, []), Tier.FULL)
    assert report.read_bytes == 300_000


def test_advise_mode_lands_all_of_a_large_range(tmp_path: Path) -> None:
    """One WILLNEED is capped by the kernel (a few MB); the prefetch steps below the cap."""
    (tmp_path / "g").mkdir()
    big = tmp_path / "g" / "model.gguf"
    big.write_bytes(os.urandom(24 * 1024 * 1024))
    if not _eviction_works([big]):
        pytest.skip("this filesystem keeps pages resident after POSIX_FADV_DONTNEED (tmpfs?)")
    weights = map_weights(tmp_path / "g")
    report = Prefetcher(weights, mode="advise").run(plan_prefetch(weights, Tier.FULL, []), Tier.FULL)
    assert report.state == "done"

    def all_resident() -> bool:
        measured = resident_bytes(file_ranges([big]))
        return measured is not None and measured[0] == measured[1]

    deadline = time.monotonic() + 10  # WILLNEED reads asynchronously: give the disk a moment
    while not all_resident() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all_resident()
    with pytest.raises(ValueError):
        Prefetcher(weights, mode="mmap")


def test_page_residency_of_a_missing_file_is_unknown(tmp_path: Path) -> None:
    assert page_residency(tmp_path / "nope") is None
    (tmp_path / "empty").write_bytes(b"")
    assert page_residency(tmp_path / "empty") == bytearray()
