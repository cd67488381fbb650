"""The demo's and the e2e suite's cold-start timeline, from a worker's real metrics text."""

from __future__ import annotations

from pathlib import Path

import pytest
from warmpool_dev.timeline import PodTimeline, parse_phase_metric, phase_table, render_waterfall
from warmpool_worker.metrics import WorkerMetrics

from warmpool.contract.metrics import METRIC_PHASE_TIMESTAMP

pytestmark = pytest.mark.unit


def _metrics() -> str:
    metrics = WorkerMetrics(process_start=1000.0)
    metrics.mark_phase("weights_mapped", 1002.5)
    metrics.mark_phase("first_layer_ready", 1003.0)
    return metrics.render().decode()


def test_phases_parse_as_seconds_since_start_and_as_timestamps() -> None:
    text = _metrics()
    assert parse_phase_metric(text) == {"process_start": 0.0, "weights_mapped": 2.5, "first_layer_ready": 3.0}
    assert parse_phase_metric(text, METRIC_PHASE_TIMESTAMP)["weights_mapped"] == 1002.5


def test_table_marks_unreached_phases_absent_not_zero(tmp_path: Path) -> None:
    line = PodTimeline(pod="p-1", phases=parse_phase_metric(_metrics()), first_ttft_s=0.2, steady_ttft_s=0.1)
    table = phase_table([line])
    row = table.splitlines()[2].split()
    assert row[:8] == ["p-1", "-", "2.50s", "3.00s", "-", "-", "-", "200ms"]
    assert row[-1] == "2.00"  # first ÷ steady
    png = render_waterfall([line], tmp_path / "t.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
