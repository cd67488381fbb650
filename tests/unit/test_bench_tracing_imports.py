"""The tracing-imports bench: its figures from hand-made runs, and one real fresh interpreter."""

from __future__ import annotations

from typing import Any

import pytest
from warmpool_bench.tracing_imports import TRACING, figures, render_tracing_imports, time_variant

pytestmark = pytest.mark.unit


def test_figures_are_medians_and_the_share_is_tracing_over_the_start_path() -> None:
    runs: dict[str, list[dict[str, Any]]] = {
        "start_path": [{"phases_s": [2.0]}, {"phases_s": [3.0]}, {"phases_s": [2.5]}],
        "start_path_plus_tracing": [{"phases_s": [2.4, 0.2]}, {"phases_s": [2.6, 0.3]}, {"error": "boom"}],
        "tracing_alone": [{"phases_s": [0.4]}, {"phases_s": [0.5]}, {"phases_s": [0.6]}],
    }
    f = figures(runs)
    assert f["start_path_p50_s"] == 2.5
    assert f["tracing_after_start_path_p50_s"] == pytest.approx(0.25)  # the failed run is left out, not 0
    assert f["tracing_alone_p50_s"] == 0.5
    assert f["tracing_share_of_start_path"] == pytest.approx(0.1)


def test_a_fresh_interpreter_times_each_phase_and_counts_opentelemetry_modules() -> None:
    plain = time_variant([["json"]])
    assert len(plain["phases_s"]) == 1 and plain["phases_s"][0] >= 0.0
    assert plain["opentelemetry_modules"] == 0
    traced = time_variant([["json"], list(TRACING)])
    assert len(traced["phases_s"]) == 2
    assert traced["opentelemetry_modules"] > 0


def test_a_module_that_does_not_import_is_an_error_not_a_figure() -> None:
    assert "error" in time_variant([["warmpool_no_such_module"]])


def test_the_report_names_every_figure() -> None:
    runs = {name: [{"phases_s": [1.0, 0.1]}] for name in ("start_path", "start_path_plus_tracing", "tracing_alone")}
    result = {"started": "t", "cpus": 2, "load_average_before": 1.0, "load_average_after": 1.0, "python": "3",
              "rounds": 1, "wall_s": 1.0, "modules": {"start_path": ["a"], "tracing": ["b"]}, "runs": runs,
              "figures": figures(runs)}
    text = render_tracing_imports(result)
    assert "| OpenTelemetry imports, after the start path | 100 |" in text

