"""`warmpool bench podstart` end to end on a tiny random model, one round: a new pod on the session's
real node and a plain process, each broken into its steps.  No timed assertions: the steps only have
to be found, in order, and add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from warmpool_bench.pod_start import STEPS
from warmpool_devcluster.testing import ClusterHandle

pytestmark = pytest.mark.integration


def test_podstart_tiny_one_round(cluster: ClusterHandle, tmp_path: Path) -> None:
    if cluster.name is None or cluster.node is None:
        pytest.skip("a new pod's steps come from the local cluster's real node (its containerd's events)")
    env = dict(os.environ)
    env.pop("POD_IP", None)
    command = [
        sys.executable, "-m", "warmpool", "bench", "podstart", "--sizes", "tiny", "--rounds", "1",
        "--buckets", "16,32", "--request-tokens", "16", "--timeout", "300", "--cluster", cluster.name,
        "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "results"), "--name", "smoke",
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results" / "smoke.json").read_text())
    assert result["benchmark"] == "podstart" and result["run"]["commit"]
    figures = result["models"]["tiny"]["breakdown"]
    assert figures["runs"] == {"new_pod": 1, "fresh_process": 1}
    assert list(figures["new_pod_steps_s"]) == [step for step, _ in STEPS]
    assert all(v is not None and v >= 0 for v in figures["new_pod_steps_s"].values()), figures
    assert sum(figures["new_pod_steps_s"].values()) == pytest.approx(figures["new_pod_ready_s"], abs=1e-6)
    shares = [figures[k] for k in ("runtime_share", "kubernetes_share", "worker_share")]
    assert all(0 < share < 1 for share in shares) and sum(shares) == pytest.approx(1.0, abs=1e-6)
    assert figures["fresh_process_ready_s"] > 0 and figures["new_pod_over_process"] > 0
    text = (tmp_path / "results" / "smoke.md").read_text()
    assert text.startswith("# warmpool bench podstart") and "worker ready → pod Ready (kubelet probes)" in text
