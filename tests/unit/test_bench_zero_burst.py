"""`warmpool bench zero`'s burst: 429 and 503 refusals are reported apart from requests lost, and a
burst below each activator replica's maxHeldRequests meets its target only when every request was
answered (the bench used to count a refusal as not lost, and so as met)."""

from __future__ import annotations

import pytest
from warmpool_bench.zero_report import burst_outcome, render_zero

pytestmark = pytest.mark.unit


def test_refusals_are_counted_apart_and_fail_the_burst() -> None:
    outcome = burst_outcome([200] * 45 + [429] * 3 + [503] + [0], max_held_per_replica=100)
    assert (outcome["answered"], outcome["refused_429"], outcome["refused_503"], outcome["lost"]) == (45, 3, 1, 1)
    assert outcome["statuses"] == {"0": 1, "200": 45, "429": 3, "503": 1}
    assert outcome["met"] is False
    refused_only = burst_outcome([200] * 49 + [429], max_held_per_replica=100)
    assert refused_only["lost"] == 0 and refused_only["met"] is False
    line = render_zero({"model": "tiny", "rounds": 0, "burst": {**refused_only, "slowest_s": 3.0}})
    assert "refused 429 1, refused 503 0, lost 0" in line and "**missed**" in line


def test_a_burst_all_answered_below_the_bound_is_met() -> None:
    outcome = burst_outcome([200] * 50, max_held_per_replica=100)
    assert outcome["met"] is True and outcome["answered"] == 50 and outcome["lost"] == 0
    assert "**met**" in render_zero({"model": "tiny", "rounds": 0, "burst": {**outcome, "slowest_s": 3.0}})


def test_a_results_file_from_before_is_judged_by_its_statuses() -> None:
    """A burst recorded with statuses only (lost counted 429 and 503 as not lost, and so met)."""
    old = {"requests": 50, "statuses": {"200": 47, "429": 2, "503": 1}, "lost": 0, "slowest_s": 9.0}
    line = render_zero({"model": "smollm2", "rounds": 0, "burst": old})
    assert "answered 47, refused 429 2, refused 503 1, lost 0" in line and "**missed**" in line
