"""Pure pieces of the benchmarks: medians, percentiles, ratios, growth, histogram quantiles, tables."""

from __future__ import annotations

import math
from typing import Any

import pytest
from warmpool_bench.coldstart import parse_load_seconds, ratios
from warmpool_bench.report import render_coldstart, render_scale
from warmpool_bench.scale import histogram_quantile, targets
from warmpool_bench.stats import growth, median, percentile, ratio, summarise

pytestmark = pytest.mark.unit


def test_median_odd_even_and_missing() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median([None, 5.0, float("nan")]) == 5.0  # missing and NaN are left out, not zero
    assert median([]) is None and median([None]) is None


def test_percentile_interpolates_like_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 95) == pytest.approx(4.8)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile([7.0], 95) == 7.0 and percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_ratio_refuses_missing_or_non_positive_denominators() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None
    assert ratio(1.0, 0.0) is None and ratio(1.0, -1.0) is None


def test_summarise_takes_medians_of_numeric_fields_only() -> None:
    runs: list[dict[str, Any]] = [
        {"ready_s": 1.0, "tier": "full", "ok": True, "rss": 10},
        {"ready_s": 3.0, "tier": "full", "ok": True, "rss": None},
        {"ready_s": 2.0, "tier": "full", "ok": True},
    ]
    assert summarise(runs) == {"ready_s": 2.0, "rss": 10.0}


def test_growth_only_over_doublings() -> None:
    assert growth({50: 1.0, 100: 2.5, 200: 5.0}) == {"50->100": 2.5, "100->200": 2.0}
    assert growth({50: 1.0, 150: 2.0}) == {}
    assert growth({50: None, 100: 1.0}) == {"50->100": None}


def test_histogram_quantile_matches_prometheus() -> None:
    inf = float("inf")
    buckets = [(0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (inf, 100.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.1)
    assert histogram_quantile(buckets, 0.95) == pytest.approx(0.75)
    assert histogram_quantile([(0.1, 0.0), (inf, 0.0)], 0.5) is None
    assert histogram_quantile([(0.1, 1.0), (inf, 10.0)], 0.95) == 0.1  # beyond the last bound
    assert histogram_quantile([], 0.5) is None


def test_parse_load_seconds_from_the_worker_log() -> None:
    log = ("2026-01-01 00:00:00,000 INFO warmpool.worker: layer 0 loaded (1/30 resident)\n"
           "2026-01-01 00:00:01,000 INFO warmpool_worker.warmup: warm-up (full): 30 layer(s) resident of 30 in 4.02s\n")
    assert parse_load_seconds(log) == (4.02, 30)
    assert parse_load_seconds("nothing here") == (None, None)


def _variants() -> dict[str, Any]:
    def cell(**median: float) -> dict[str, Any]:
        return {"median": median, "runs": [{**median}]}

    def both(**median: float) -> dict[str, Any]:
        return {"warm": cell(**median), "cold": cell(**median)}

    return {
        "transformers": both(usable_s=12.0, ready_s=12.0, first_token_s=13.0, first_ttft_s=0.6, steady_ttft_s=0.2,
                             load_s=5.0),
        "warmpool_full": both(usable_s=4.0, ready_s=6.0, first_token_s=6.2, first_ttft_s=0.21, steady_ttft_s=0.2,
                              load_s=1.25, peak_rss_bytes=2**30),
        "floor": both(floor_s=5.0, read_s=1.0, read_gbps=1.0, first_ttft_s=0.2, steady_ttft_s=0.2),
    }


def test_ratios_are_computed_from_medians() -> None:
    out = ratios(_variants(), ("warm", "cold"))
    warm = out["warm"]
    assert warm["usable_speedup_vs_transformers"] == pytest.approx(3.0)
    assert warm["ready_over_floor"] == pytest.approx(1.2)
    assert warm["load_bandwidth_fraction"] == pytest.approx(0.8)
    assert warm["load_over_read_floor"] == pytest.approx(1.25)
    assert warm["first_over_steady.transformers"] == pytest.approx(3.0)
    assert warm["first_over_steady.warmpool_full"] == pytest.approx(1.05)
    assert warm["first_over_steady.torch_load"] is None  # variant not run: None, not 0
    assert math.isclose(out["cold"]["ready_over_floor"] or 0, 1.2)


def test_render_coldstart_table_has_every_variant_and_the_targets() -> None:
    variants = _variants()
    result = {
        "started_at": "2026-01-01T00:00:00Z",
        "machine": {"cpus": 2, "cpu": "test", "loadavg": [3.0, 2.0, 1.0], "loadavg_end": [4.0, 2.0, 1.0]},
        "settings": {"device": "cpu", "dtype": "bfloat16", "runs": 1, "buckets": [32], "prompts_per_bucket": 1,
                     "decode_tokens": 4, "request_tokens": 32, "steady_requests": 3, "torch_threads": 1,
                     "cache_states": ["warm", "cold"]},
        "models": {"small": {"model_dir": "/x/smollm2", "weight_bytes": 269_000_000, "variants": variants,
                             "ratios": ratios(variants, ("warm", "cold"))}},
    }
    text = render_coldstart(result)
    assert "## small: smollm2 (0.27 GB of weights)" in text
    row = "| 4. warmpool worker, full warm-up | warm | 6.00 | 6.20 | 4.00 | 1.25 | 1.05 | 200 | 1024 | - | 1/1 |"
    assert row in text
    assert "| weights usable: transformers ÷ warmpool | ≥ 3x small, ≥ 5x 1-2 GB | 3.00 | 3.00 |" in text
    assert "load average at start 3.00 / end 4.00" in text
    assert "warm: 1.00 GB/s" in text


def test_render_scale_table_and_missing_note() -> None:
    result = {
        "started_at": "2026-01-01T00:00:00Z", "machine": {"cpus": 2, "loadavg": [1.0, 1.0, 1.0]},
        "points": [{"count": 50, "all_ready_s": 10.0, "ready_count": 50, "reconcile_p50_s": 0.05,
                    "reconcile_p95_s": 0.4, "operator_rss_peak_bytes": 100 * 2**20}],
        "growth": {"all_ready_s": {"50->100": 2.0}},
        "missing": "the operator is not installed",
    }
    text = render_scale(result)
    assert "| 50 | - | 10.00 | - | 50/50 | 0.050 | 0.400 | - | - / - | - | - | - | 100 | - |" in text
    assert "**Not measured:** the operator is not installed" in text
    assert "| all_ready_s | 2.00 |" in text


def test_scale_targets_judge_the_largest_n_against_the_issue() -> None:
    point = {"count": 1000, "ratio_to_floor": 1.2, "reconcile_p95_s": 1.6, "reconcile_handler_p95_s": None,
             "status_lag_p95_s": 0.4, "operator_rss_peak_bytes": 190e6, "idle_cpu_percent": 12.0,
             "all_deleted_s": 30.0, "restart": {"late_p95_s": 2.5}, "rss_per_warmmodel_bytes": 9 * 1024}
    got = targets(point, {"all_ready_s": {"250->500": 1.9, "500->1000": 2.4}, "operator_cpu_s": {"250->500": 1.5}})
    verdicts = {name: t["met"] for name, t in got.items()}
    assert verdicts == {
        "all reconciled vs floor (N=1000)": True,
        "reconcile p95 (all passes)": False,
        "reconcile p95 (first pass of each object)": None,  # not measured is never "met"
        "status lag after a pod Ready event, p95": True,
        "operator RSS, peak": True,
        "operator idle CPU (% of one core)": False,
        "delete all 1000": True,
        "growth per doubling of N (worst of time, CPU, RSS, delete)": False,  # 2.4 > linear
        "first pass of a WarmModel created during a restart's backlog, p95": False,  # 2.5 s > 2 s
        "operator RSS above its empty start, per WarmModel": True,  # 9 KiB <= 10 KiB
        "growth of all reconciled, 1000 -> 2000": None,  # 2,000 not measured
    }
    assert got["operator RSS, peak"]["value"] == 190.0
    text = render_scale({"started_at": "x", "machine": {"cpus": 2, "loadavg": [1.0]}, "points": [point],
                         "targets": got})
    assert "| status lag after a pod Ready event, p95 | 0.400 | <= 1 s | met |" in text
    assert "| reconcile p95 (first pass of each object) | - | <= 1 s | not measured |" in text
