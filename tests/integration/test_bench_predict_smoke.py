"""`warmpool bench predict` end to end through the CLI on a small synthetic trace: the files exist, the
figures hang together, `bench render` rebuilds the Markdown, and a bad CSV is refused naming its line.

No timed assertions; the replay is simulated time.
"""

from __future__ import annotations

import calendar
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

START = calendar.timegm((2023, 11, 16, 18, 0, 0, 0, 0, 0))  # a UTC minute boundary


def _trace(path: Path) -> int:
    """Twenty minutes: quiet, a burst at minute 8, quiet again; prompts of a few lengths."""
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    t = 0.0
    while t < 20 * 60:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(START + t)) + f".{int((t % 1) * 1e7):07d}"
        rows.append(f"{stamp},{(200, 1500, 5000)[len(rows) % 3]},{10 + len(rows) % 20}")
        t += 0.25 if 8 * 60 <= t < 10 * 60 else 2.0
    path.write_text("\n".join(rows) + "\n")
    return len(rows) - 1


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-m", "warmpool", "bench", *args], env=env, capture_output=True,
                          text=True, timeout=600)


def test_predict_replays_a_trace_and_writes_json_markdown_and_chart(tmp_path: Path) -> None:
    count = _trace(tmp_path / "trace.csv")
    out = tmp_path / "results"
    proc = _run("predict", "--trace", str(tmp_path / "trace.csv"), "--cold-start", "5", "--wake", "0.5",
                "--extra-cold-starts", "30",
                "--forecasters", "auto,last_value,lightgbm", "--out", str(out), "--name", "smoke")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "smoke.json").read_text())
    assert result["benchmark"] == "predict" and result["trace"]["requests"] == count
    assert (out / "smoke.png").stat().st_size > 10_000
    markdown = (out / "smoke.md").read_text()
    assert markdown.startswith("# warmpool bench predict") and "![" in markdown and "smoke.png" in markdown
    # the wake scenario: new pods still cold-start (5 s), pods scaled down sleep and wake in 0.5 s
    assert [(s["cold_start_s"], s["wake_s"], s["lead_s"]) for s in result["scenarios"]] == [
        (5.0, None, 5.0), (5.0, 0.5, 0.5), (30.0, None, 30.0)]
    assert result["settings"]["step"]["step_s"] == result["settings"]["step_s"] in (5, 10, 15, 20, 30, 60)
    assert result["settings"]["fixed_replicas_used"] >= result["settings"]["fixed_replicas_mean"] >= 1
    for scenario in result["scenarios"]:
        assert set(scenario["policies"]) == {"fixed", "fixed@mean", "reactive", "reactive@minwarm1",
                                             "predictive:auto", "predictive:last_value", "predictive:lightgbm",
                                             "predictive:auto@minwarm1", "predictive60:auto"}
        assert scenario["policies"]["fixed"]["pods_started"] == 0  # a fixed pool
        for name, figures in scenario["policies"].items():
            assert figures["requests"] == count, name  # every request is served, none lost
            assert 0 <= figures["no_warm_capacity"] <= count
            assert figures["warm_hit_rate"] == pytest.approx(1 - figures["no_warm_capacity_share"])
            assert 0 < figures["ttft_p50_s"] <= figures["ttft_p95_s"]
            if name.startswith("fixed") or name.endswith("@minwarm1"):  # a pod held throughout at least
                assert figures["pod_hours"] >= result["trace"]["duration_s"] / 3600 - 1e-6
            assert figures["pod_hours"] >= figures["awake_pod_hours"] > 0
            if "forecast_error" in figures:  # the forecast each predictive policy acted on, scored
                assert figures["forecast_error"]["pairs"] > 0 and 0 <= figures["forecast_error"]["p90_coverage"] <= 1
        assert set(scenario["targets"]["figures"]) == {
            "no_warm_capacity_ratio_vs_reactive", "first_request_p95_reduction_vs_reactive",
            "warm_hit_points_vs_reactive", "pod_hours_ratio_vs_reactive", "pod_hours_ratio_vs_fixed"}
    auto = result["scenarios"][0]["policies"]["predictive:auto"]
    assert sum(auto["models_used"].values()) == auto["forecast_steps"] >= 19
    buckets = result["buckets"]
    assert buckets["learned"] == [1536, 6144]  # p50 1500 -> 1536; p90 and p99 5000 -> 6144
    assert buckets["share_within_learned"] == 1.0 and buckets["share_within_defaults"] == pytest.approx(1 / 3, 0.01)
    cost = result["forecaster_cost"]
    assert cost["full_history"]["steps"] == 7 * 1440 and cost["full_history"]["train_cpu_s"] > 0  # steps held
    # and the coarse tier's four weeks beside them, with the daily and weekly features they turn on
    assert cost["full_history"]["coarse_steps"] == 28 * 288 and "week_ago" in cost["full_history"]["features"]
    assert cost["percent_of_one_core_per_100_models"] > 0

    (out / "smoke.md").unlink()
    rendered = _run("render", str(out / "smoke.json"))
    assert rendered.returncode == 0, rendered.stderr
    assert (out / "smoke.md").read_text() == markdown


def test_predict_refuses_a_bad_trace_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,10,1\n2023-11-16 18:17:04,x,1\n")
    proc = _run("predict", "--trace", str(bad), "--out", str(tmp_path / "results"))
    assert proc.returncode == 2
    assert f"{bad}:3: ContextTokens 'x' is not a whole number of tokens" in proc.stderr
    assert not (tmp_path / "results").exists()
