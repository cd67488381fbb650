"""`warmpool bench cache` end to end on the tiny model with small blocks: a real SeaweedFS, real
fills, a results file that renders; the figures are whatever this run measured (no timing asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest
from warmpool_bench.cache import render_cache, run_cache

pytestmark = pytest.mark.integration


def test_bench_cache_runs_and_counts_bytes(tmp_path: Path) -> None:
    result = run_cache("tiny", rounds=1, work_dir=tmp_path, block_size=16 * 1024, first_layer_rounds=1)
    assert result["fills"][0]["bytes"] == result["total_bytes"]  # a full fill moves every byte once
    assert result["raw"][0]["bytes"] == result["total_bytes"]
    assert 0 < result["delta"]["bytes"] < result["total_bytes"]
    assert result["delta"]["bytes"] == result["delta"]["requests"] * 16 * 1024  # whole changed blocks only
    assert result["held"] == {**result["held"], "bytes": 0, "requests": 0, "filled_here": False}
    assert result["targets"]["held_bytes"]["met"] is True
    assert result["targets"]["fill_vs_download"]["met"] in (True, False)  # judged against download_file
    assert "| fill throughput / boto3 download_file to disk |" in render_cache(result)
    # Time to first layer: one real worker per variant, from the same store; a figure, not asserted.
    first = result["first_layer"]
    assert [len(first["runs"][v]) for v in ("full", "partial")] == [1, 1]
    for run in (*first["runs"]["full"], *first["runs"]["partial"]):
        assert 0 < run["first_layer_s"] <= run["ready_s"] <= run["first_completion_s"]
    assert result["targets"]["first_layer"]["met"] in (True, False)
    assert "| time to first layer, hot-first partial / full fill | " in render_cache(result)
