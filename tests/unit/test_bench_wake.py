"""Pure pieces of `warmpool bench wake`: the smaps split, what a model holds beyond its mapping,
the per-variant quantiles, the targets and the tables."""

from __future__ import annotations

from typing import Any

import pytest
from warmpool_bench.wake import round_order
from warmpool_bench.wake_figures import (
    MemoryBreakdown,
    beyond_mapping_bytes,
    memory_figures,
    parse_smaps,
    side_figures,
    summarise_runs,
    targets,
)
from warmpool_bench.wake_report import render_wake
from warmpool_bench.wake_settings import VARIANTS

pytestmark = pytest.mark.unit

WEIGHTS = "/models/smol/model.safetensors"
SMAPS = f"""\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
Rss:                 100 kB
Anonymous:           100 kB
7f0000000000-7f0010000000 r--p 00000000 08:01 1234                       {WEIGHTS}
Size:             262144 kB
Rss:               8000 kB
Anonymous:           16 kB
7f0020000000-7f0020100000 r-xp 00000000 08:01 99                         /usr/lib/libtorch_cpu.so
Size:               1024 kB
Rss:                 600 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me
7f0030000000-7f0030200000 rw-p 00000000 00:00 0
Size:               2048 kB
Rss:                2048 kB
Anonymous:          2048 kB
"""


def test_parse_smaps_splits_anon_weight_file_and_other_pages() -> None:
    got = parse_smaps(SMAPS, [WEIGHTS])
    # anonymous: heap + the unnamed mapping + the weight mapping's private (written) pages
    assert got.anon_bytes == (100 + 2048 + 16) * 1024
    assert got.weights_file_bytes == (8000 - 16) * 1024
    assert got.other_file_bytes == 600 * 1024
    # the same text without the weights named: their pages are "other file"
    assert parse_smaps(SMAPS, []).other_file_bytes == (600 + 8000 - 16) * 1024
    assert parse_smaps("", [WEIGHTS]) == MemoryBreakdown(0, 0, 0)


def test_beyond_mapping_counts_converted_copies_only() -> None:
    tensors = [("BF16", (4, 8)), ("BF16", (8,)), ("F32", (2, 2))]
    # bf16 compute: the bf16 tensors are the mapping (0); the f32 one is converted to 2 bytes/element
    assert beyond_mapping_bytes(tensors, "bfloat16") == 4 * 2
    # float32 compute: every bf16 tensor is a 4-byte copy; the f32 one is zero copy
    assert beyond_mapping_bytes(tensors, "float32") == (32 + 8) * 4
    with pytest.raises(ValueError, match="float8"):
        beyond_mapping_bytes(tensors, "float8")


def test_memory_figures_share_is_none_when_nothing_is_held_beyond_the_mapping() -> None:
    awake, asleep = MemoryBreakdown(1000, 500, 10), MemoryBreakdown(100, 0, 10)
    got = memory_figures(awake, asleep, beyond_mapping=1000)
    assert got["anon_released_bytes"] == 900 and got["weights_file_released_bytes"] == 500
    assert got["anon_released_share"] == pytest.approx(0.9)
    assert got["anon_awake_bytes"] == 1000 and got["weights_file_asleep_bytes"] == 0
    assert memory_figures(awake, asleep, beyond_mapping=0)["anon_released_share"] is None


def test_summarise_runs_quantiles_over_the_runs_that_worked() -> None:
    runs: list[dict[str, Any]] = [{"decision_to_first_token_s": float(i), "steady_ttft_s": 0.1, "round": i}
                                  for i in range(1, 6)]
    runs.append({"error": "boom", "round": 6})
    got = summarise_runs(runs)
    assert got["runs_ok"] == 5 and got["runs"] == 6
    assert got["p50_s"] == 3.0 and got["p95_s"] == pytest.approx(4.8) and got["max_s"] == 5.0
    assert got["steady_ttft_s"] == pytest.approx(0.1)
    assert summarise_runs([{"error": "x"}])["p50_s"] is None


def _summaries() -> dict[str, dict[str, Any]]:
    return {
        "wake_l1": {"p50_s": 0.2, "p95_s": 0.4, "first_ttft_after_wake_s": 0.11, "steady_ttft_s": 0.1},
        "wake_l2": {"p50_s": 0.5, "p95_s": 1.5, "first_ttft_after_wake_s": 0.15, "steady_ttft_s": 0.1},
        "copies_wake_l1": {"anon_released_share": 0.95, "released_bytes": 900, "beyond_mapping_bytes": 1000},
        "copies_wake_l2": {"anon_released_share": 0.5},
        "new_pod": {"p50_s": 5.0, "p95_s": 8.0},
        "fresh_process": {"p50_s": 4.0},
    }


def test_targets_judge_each_level() -> None:
    got = targets(_summaries(), judge_wake_p95=True)
    assert got["wake p95, level 1"] == {"value": 0.4, "target": "<= 1 s", "met": True}
    assert got["wake p95, level 2"]["met"] is False
    assert got["new pod ÷ wake, level 1 (p50 ÷ p50)"]["value"] == pytest.approx(25.0)
    assert got["new pod ÷ wake, level 1 (p50 ÷ p50)"]["met"] is True
    assert got["new pod ÷ wake, level 2 (p50 ÷ p50)"]["met"] is False  # 10x
    assert got["first TTFT after wake ÷ steady, level 1"]["met"] is True  # 1.1
    assert got["first TTFT after wake ÷ steady, level 2"]["met"] is False  # 1.5
    assert got["anon released ÷ held beyond the mapping, level 1 (converted copies)"]["met"] is True
    assert got["anon released ÷ held beyond the mapping, level 2 (converted copies)"]["met"] is False
    # another model: the 1 s limit is SmolLM2's, printed but not judged; nothing measured is None
    other = targets(_summaries(), judge_wake_p95=False)
    assert other["wake p95, level 1"]["met"] is None and other["wake p95, level 1"]["value"] == 0.4
    empty = targets({}, judge_wake_p95=True)
    assert all(t["met"] is None and t["value"] is None for t in empty.values())


def test_side_figures() -> None:
    got = side_figures(_summaries())
    assert got["new_pod_over_wake_p95.l1"] == pytest.approx(20.0)
    assert got["fresh_process_over_wake.l2"] == pytest.approx(8.0)
    assert got["metric_released_share.copies_l1"] == pytest.approx(0.9)
    assert got["new_pod_over_fresh_process"] == pytest.approx(1.25)


def test_round_order_rotates_so_every_variant_takes_every_position() -> None:
    variants = ["a", "b", "c"]
    orders = [round_order(variants, i) for i in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert {order[0] for order in orders} == set(variants)
    assert round_order([], 4) == []


def test_render_wake_has_every_table() -> None:
    summaries = _summaries()
    extra: dict[str, Any] = {"runs_ok": 1, "runs": 2, "anon_awake_bytes": 2**30, "anon_asleep_bytes": 2**20}
    runs: dict[str, dict[str, Any]] = {}
    for v in VARIANTS:
        summary: dict[str, Any] = dict(summaries.get(v) or {})
        summary.update(extra)
        runs[v] = {"summary": summary,
                   "runs": [{"round": 0, "loadavg_1m": 2.5}, {"round": 1, "error": "it broke"}]}
    result = {
        "started_at": "2026-12-01T00:00:00Z", "wall_s": 10.0,
        "machine": {"cpus": 2, "cpu": "x", "loadavg": [1.0, 1.0, 1.0], "loadavg_end": [2.0, 2.0, 2.0]},
        "settings": {"device": "cpu", "dtype": "bfloat16", "copies_dtype": "float32", "rounds": 2,
                     "torch_threads": 1, "buckets": [32], "prompts_per_bucket": 1, "request_tokens": 16,
                     "steady_requests": 1},
        "models": {"small": {"label": "small: smol", "weight_bytes": 10**9, "variants": runs,
                             "targets": targets(summaries, judge_wake_p95=True),
                             "side_figures": side_figures(summaries)}},
    }
    text = render_wake(result)
    assert text.startswith("# warmpool bench wake")
    assert "| wake, level 1 (POST /control/wake) | 0.200 | 0.400 |" in text
    assert "| wake p95, level 2 | 1.500 | <= 1 s | **missed** |" in text
    assert "| anon released ÷ held beyond the mapping, level 1 (converted copies) | 95 % | >= 90 % | met |" in text
    assert "1024 / 1" in text  # anon awake / asleep MiB
    assert "new_pod round 2: it broke" in text and "2.50-2.50" in text
