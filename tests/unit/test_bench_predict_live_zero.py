"""`bench predict --live` from zero: the pools it makes, the first request after a lull it measures, and the
issue's targets it judges by (the offline bench's, on the live figures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from warmpool_bench.predict_live import LiveSettings, first_after_lull, targets, warmmodel, zero_after_idle_s
from warmpool_bench.predict_live_load import Outcome
from warmpool_bench.predict_live_report import _target_lines
from warmpool_bench.predict_live_segment import SegmentSpec

pytestmark = pytest.mark.unit

TRACE = Path("/nonexistent/trace.csv")


def test_reactive_and_predictive_run_from_zero_by_default_and_the_fixed_pool_never_does() -> None:
    s = LiveSettings(trace=TRACE)
    assert s.min_warm == 0 and zero_after_idle_s(s) == 10  # a trace minute at 6x
    for policy in ("reactive", "predictive"):
        pool = warmmodel("p", policy, Path("/m"), s)["spec"]["pool"]
        assert pool["scaleToZero"] == {"afterIdleSeconds": 10} and pool["minWarm"] == 0
        assert pool["replicas"] == 1  # primed on one pod, then the operator takes it to zero
    fixed = warmmodel("f", "fixed", Path("/m"), s)["spec"]["pool"]
    assert "scaleToZero" not in fixed and fixed["replicas"] == s.fixed_replicas
    assert zero_after_idle_s(LiveSettings(trace=TRACE, segment=SegmentSpec(compression=4))) == 15
    assert zero_after_idle_s(LiveSettings(trace=TRACE, zero_after_idle_s=3)) == 3
    kept = LiveSettings(trace=TRACE, min_warm=1)
    assert zero_after_idle_s(kept) is None
    assert "scaleToZero" not in warmmodel("r", "reactive", Path("/m"), kept)["spec"]["pool"]


def test_bad_settings_are_refused_naming_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="--zero-after-idle >= 1 second, got 0"):
        LiveSettings(trace=TRACE, zero_after_idle_s=0)
    with pytest.raises(ValueError, match="0 <= minWarm <= maxReplicas"):
        LiveSettings(trace=TRACE, min_warm=-1)


def _outcome(index: int, arrival: float, ttft: float | None, error: str | None = None) -> Outcome:
    out = Outcome(index, arrival, 10, 4, warm_hit=False, error=error)
    out.first_token_at = None if ttft is None else arrival + ttft
    return out


def test_the_first_request_after_a_lull_is_the_first_after_that_long_without_an_arrival() -> None:
    outcomes = [_outcome(1, 12.0, 0.5), _outcome(0, 0.0, 7.0), _outcome(2, 25.0, 6.0), _outcome(3, 26.0, 0.4),
                _outcome(4, 40.0, None, error="timeout")]
    # The first arrival, and 25.0 (13 s after 12.0); 12.0 is 12 s after 0.0 too; the failed one is not served.
    assert first_after_lull(outcomes, 10.0) == [7.0, 0.5, 6.0]
    assert first_after_lull(outcomes, 12.5) == [7.0, 6.0]


def _figures(no_warm: int, hit: float, first: float, pod_seconds: float) -> dict[str, Any]:
    return {"no_warm_capacity": no_warm, "warm_hit_rate": hit, "first_request_p95_s": first,
            "pod_hours": pod_seconds / 3600, "cold_start_median_s": 4.0}


def test_the_live_targets_are_the_offline_ones_against_reactive_from_zero() -> None:
    live = {"fixed": _figures(4, 0.95, 1.0, 360), "reactive": _figures(40, 0.5, 8.0, 100),
            "predictive": _figures(6, 0.9, 2.0, 120)}
    t = targets(live)
    got = {k: v["value"] for k, v in t["figures"].items()}
    assert got["no_warm_capacity_ratio_vs_reactive"] == pytest.approx(0.15)
    assert got["first_request_p95_reduction_vs_reactive"] == pytest.approx(0.75)
    assert got["warm_hit_points_vs_reactive"] == pytest.approx(40)
    assert got["pod_hours_ratio_vs_reactive"] == pytest.approx(1.2)
    assert got["pod_hours_ratio_vs_fixed"] == pytest.approx(1 / 3)
    assert all(v["met"] for k, v in t["figures"].items() if k != "pod_hours_ratio_vs_fixed")
    assert not t["figures"]["pod_hours_ratio_vs_fixed"]["met"]  # 0.9 is below 95 % of the fixed pool's hits
    assert t["first_request_never_empty_reduction"] == pytest.approx(0.875)
    lines = "\n".join(_target_lines(t))
    assert "| requests without warm capacity, predictive ÷ reactive-from-zero ≤ 0.2 | 0.15 | met |" in lines
    assert "the fixed pool, never empty, has its first request after a lull 88 % lower" in lines
    assert targets({"fixed": live["fixed"], "predictive": live["predictive"]}) == {}
    assert _target_lines({}) == ["- not computable: the fixed, reactive and predictive pools must all run"]
