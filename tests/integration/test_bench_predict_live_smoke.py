"""`warmpool bench predict --live --quick` end to end through the CLI on a small synthetic trace, against the
session's local cluster, real worker pods of a tiny random model and the operator of this checkout: the
files exist and the figures hang together; a segment with no request is refused before any pod starts.

One of the three policies, as small as it still means something: the predictive one, from zero, which runs
the bench's emulated HPA and the generator's stand-in for the activator too (reactive is that HPA and that
stand-in without the operator's forecast; the fixed pool is neither: the same code paths, each another
third of the wall time).  All three, at full size, are the benchmark's own run
(bench/results/predict-live.json, rendered by tests/unit/test_newcomer_cli.py).

No timed assertions: the figures only have to exist and agree with each other.
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
from warmpool_devcluster.testing import ClusterHandle

pytestmark = pytest.mark.integration

START = calendar.timegm((2023, 11, 16, 18, 0, 0, 0, 0, 0))  # a UTC minute boundary
POLICIES = ("predictive",)


def _trace(path: Path) -> None:
    """Seven minutes: a request every 6 s, an idle minute 4, a burst (one every 0.5 s) in minute 5."""
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    t = 0.0
    while t < 7 * 60:
        if not 4 * 60 <= t < 5 * 60:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(START + t)) + f".{int((t % 1) * 1e7):07d}"
            rows.append(f"{stamp},{(20, 300, 2000)[len(rows) % 3]},{4 + len(rows) % 30}")
        t += 0.5 if 5 * 60 <= t < 6 * 60 else 6.0
    path.write_text("\n".join(rows) + "\n")


def _run(cluster: ClusterHandle | None, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MPLBACKEND="Agg")  # the suite's cache: where the session cluster's state is
    env.pop("POD_IP", None)
    where = ["--cluster", cluster.name] if cluster is not None and cluster.name is not None else []
    command = [sys.executable, "-m", "warmpool", "bench", "predict", "--live", "--quick", *where,
               "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "results"), "--name", "smoke", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)


def test_live_replay_quick(cluster: ClusterHandle, tmp_path: Path) -> None:
    if cluster.name is None:
        pytest.skip("the live replay runs pods on the local cluster's real node")
    _trace(tmp_path / "trace.csv")
    # Minutes 4-6 (idle, then the burst), 20 s of replay: the emulated HPA syncs every 15 s.  Minutes 0-3
    # seed the predictive pool's history, 8 steps of 5 s (a trace minute lasts 10 s); the replay starts on a
    # step boundary, 2.5 s away on average.
    proc = _run(cluster, tmp_path, "--trace", str(tmp_path / "trace.csv"), "--segment-start", "4",
                "--segment-minutes", "2", "--max-requests", "24", "--prime-seconds", "8",
                "--policies", ",".join(POLICIES), "--predict-step-seconds", "5")
    print(proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "results"
    result = json.loads((out / "smoke.json").read_text())
    print(f"bench wall {result['wall_s']:.0f}s, per policy "
          + ", ".join(f"{name} {figures['wall_s']:.0f}s" for name, figures in result["policies"].items()))
    assert result["benchmark"] == "predict-live" and result["mode"].startswith("sequential")
    assert (out / "smoke.png").stat().st_size > 10_000
    assert (out / "smoke.md").read_text().startswith("# warmpool bench predict --live")
    segment = result["segment"]
    assert segment["compression"] == 6 and 0 < segment["requests"] <= 24 and segment["seeded_requests_before"] > 0
    assert set(result["policies"]) == set(POLICIES) and not result["skipped"]
    for name, figures in result["policies"].items():
        assert figures["requests"] == segment["requests"], name  # every request was sent
        assert figures["served"] + figures["errors"] == figures["requests"], name
        assert figures["served"] > 0 and figures["primed"] > 0, name
        assert 0 <= figures["no_warm_capacity"] <= figures["requests"], name
        assert figures["warm_hit_rate"] == pytest.approx(1 - figures["no_warm_capacity_share"])
        assert 0 < figures["ttft_p50_s"] <= figures["ttft_p95_s"], name
        assert figures["pod_seconds"] > 0 and figures["max_pods"] >= 1, name
        assert figures["cold_starts_s"] and all(c > 0 for c in figures["cold_starts_s"]), name
    predictive = result["policies"]["predictive"]
    assert predictive["hpa_decisions"], "the emulated HPA never synced"
    # The predictive pool ran from zero (scaleToZero after a compressed trace minute without a request), with
    # the generator standing in for the activator; the targets need reactive too, so none is judged here.
    assert result["settings"]["min_warm"] == 0 and result["settings"]["zero_after_idle_s"] == 10
    assert predictive["held_errors"] == [] and "held_writes" in predictive
    assert predictive["first_request_count"] >= 1 and predictive["first_request_p95_s"] > 0
    assert result["targets"] == {}
    assert predictive["seeded_steps"] == 8  # trace minutes 0-3, two 5 s steps each
    # The seed was loaded: the operator held its 8 steps when the replay began (priming lasted 8 s, too
    # short to record that many steps itself), then added the replay's.
    samples = predictive["forecast_samples"]
    assert samples and samples[0]["historySteps"] >= 8, samples[:3]
    assert samples[-1]["historySteps"] > samples[0]["historySteps"], samples[-3:]
    offline = result["offline"]
    assert set(offline["policies"]) == set(result["policies"]) and offline["cold_start_s"] > 0
    for figures in offline["policies"].values():
        assert figures["requests"] == segment["requests"]

    (out / "smoke.md").unlink()
    rendered = subprocess.run([sys.executable, "-m", "warmpool", "bench", "render", str(out / "smoke.json")],
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    assert (out / "smoke.md").read_text().startswith("# warmpool bench predict --live")


def test_live_replay_refuses_bad_input_before_any_cluster(tmp_path: Path) -> None:
    _trace(tmp_path / "trace.csv")
    proc = _run(None, tmp_path, "--trace", str(tmp_path / "trace.csv"), "--segment-start", "4",
                "--segment-minutes", "0.9")  # minute 4 is idle
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no requests in minutes 4-4.9 of the trace: nothing to replay" in proc.stderr
    proc = _run(None, tmp_path, "--trace", str(tmp_path / "trace.csv"), "--segment-start", "60")
    assert proc.returncode == 2 and "after the trace's last request" in proc.stderr, proc.stderr[-2000:]
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,10,1\n2023-11-16 18:17:04,x,1\n")
    proc = _run(None, tmp_path, "--trace", str(bad))
    assert proc.returncode == 2
    assert f"{bad}:3: ContextTokens 'x' is not a whole number of tokens" in proc.stderr
    assert not (tmp_path / "results").exists()
    assert "control plane" not in proc.stderr  # refused before any cluster was started
