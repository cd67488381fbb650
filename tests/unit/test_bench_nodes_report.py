"""`bench nodes`' report: each scene's figures beside its target, met or missed as the figures say."""

from __future__ import annotations

from typing import Any

import pytest
from warmpool_bench.nodes_report import render_nodes

pytestmark = pytest.mark.unit


def _cache(placed: list[bool]) -> dict[str, Any]:
    entry = {"published": True, "bytesCached": 10, "bytesTotal": 10}
    return {"first_pod": {"node": "warmpool-node-0", "seconds": 9.0},
            "cached": [{"node": "warmpool-node-0" if p else "warmpool-node-1", "seconds": 4.0} for p in placed],
            "other_node": {"node": "warmpool-node-1", "seconds": 8.0}, "placed_on_cached_node": placed,
            "cached_over_uncached": 0.5,
            "cache_nodes": [{"node": "warmpool-node-0", **entry}, {"node": "warmpool-node-1", **entry}],
            "own_copies": {"warmpool-node-0": {"path": "/var/lib/warmpool/x"},
                           "warmpool-node-1": {"path": "/clusters/c/node-1/var-lib-warmpool/x"}}}


def _result(**scenes: Any) -> dict[str, Any]:
    return {"settings": {"model": "tiny", "min_warm": 2}, **scenes}


def test_the_cache_scene_reports_the_ratio_and_each_nodes_own_copy() -> None:
    text = render_nodes(_result(cache=_cache([True, True])))
    assert "Cached start ÷ uncached start on the other node: 0.50" in text
    assert "cached node every time: **met** (2 of 2)" in text
    assert "`/clusters/c/node-1/var-lib-warmpool/x`" in text and "`/var/lib/warmpool/x`" in text


def test_a_pod_placed_away_from_the_cache_is_a_miss() -> None:
    assert "cached node every time: **missed** (1 of 2)" in render_nodes(_result(cache=_cache([True, False])))


def test_drain_and_death_verdicts_follow_the_figures() -> None:
    drain = {"completed": True, "seconds": 29.0, "fewest_serving": 2, "min_warm": 2, "requests": 50, "failed": 0,
             "failed_statuses": []}
    death = {"placement": "spread", "killed": ["kubelet"], "death_to_warm_s": 18.8,
             "first_replacement_created_after_s": 13.5, "replacement_cold_start_s": 5.0, "over_cold_start_s": 13.8}
    text = render_nodes(_result(drain=drain, node_death=death))
    assert "no request failed: **met**" in text
    assert "over the cold start <= 5 s: **missed**" in text
    failed = render_nodes(_result(drain=drain | {"failed": 1, "failed_statuses": [0]}))
    assert "no request failed: **missed**" in failed


def test_the_partition_reports_both_waits_and_the_pods_kept() -> None:
    cut = {"cut_to_warm_s": 5.5, "healed_to_min_warm_s": 12.25, "pods_before": {"a": "n0", "b": "n1"},
           "pods_after": {"a": "n0", "c": "n0"}}
    text = render_nodes(_result(partition=cut))
    assert "| 5.5 | 12.2 | a (n0), c (n0) |" in text
