"""`warmpool bench wake` end to end on a tiny random model, one round: every variant, sane figures.

The new-pod variant uses the session's local cluster (its real node runs the new pod) and the
operator of this checkout as a subprocess.  No timed assertions: the figures only have to
exist, be positive and hang together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from warmpool_bench.wake_figures import FIRST_OVER_STEADY_MAX, NEW_POD_SPEEDUP_MIN, RELEASED_SHARE_MIN
from warmpool_bench.wake_settings import VARIANTS, WAKE_VARIANTS
from warmpool_devcluster.testing import ClusterHandle

pytestmark = pytest.mark.integration
#: Each judged target's limit and direction (True: at most), by the start of its name.
LIMITS = {"new pod ÷ wake": (NEW_POD_SPEEDUP_MIN, False), "first TTFT after wake": (FIRST_OVER_STEADY_MAX, True),
          "anon released": (RELEASED_SHARE_MIN, False)}


def test_wake_tiny_one_round(cluster: ClusterHandle, tmp_path: Path) -> None:
    if cluster.name is None:
        pytest.skip("the new-pod variant runs pods on the local cluster's real node")
    env = dict(os.environ)  # the cache (and with it the session cluster's state) is the suite's own
    env.pop("POD_IP", None)
    command = [
        sys.executable, "-m", "warmpool", "bench", "wake", "--sizes", "tiny", "--rounds", "1", "--steady", "1",
        "--buckets", "16,32", "--request-tokens", "16", "--timeout", "300", "--cluster", cluster.name,
        "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "results"), "--name", "smoke",
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results" / "smoke.json").read_text())
    assert (tmp_path / "results" / "smoke.md").read_text().startswith("# warmpool bench wake")
    model = result["models"]["tiny"]
    assert set(model["variants"]) == set(VARIANTS)
    runs = {}
    for variant, data in model["variants"].items():
        (run,) = data["runs"]
        assert "error" not in run, (variant, run)
        assert data["summary"]["runs_ok"] == 1
        assert run["decision_to_first_token_s"] > 0 and run["steady_ttft_s"] > 0, (variant, run)
        assert data["summary"]["p50_s"] == data["summary"]["p95_s"] == run["decision_to_first_token_s"]
        runs[variant] = run
    for variant, (kind, level, woken_by) in WAKE_VARIANTS.items():
        run = runs[variant]
        assert run["engine_wake_s"] > 0, variant
        assert run["anon_awake_bytes"] > 10 * 2**20 and run["weights_file_awake_bytes"] > 0, variant
        if level == 2:  # the weight files' mapping left the process
            assert run["weights_file_asleep_bytes"] == 0, variant
        if woken_by == "control":
            # the wake call holds the engine's own wake, and the first token comes after it
            assert run["wake_call_s"] >= run["engine_wake_s"], variant
            assert run["decision_to_first_token_s"] > run["wake_call_s"], variant
        else:
            assert run["wakes_on_request"] == 1, variant
        if kind == "copies":  # float32 copies of a bf16 checkpoint: the model holds memory beyond the mapping
            assert run["beyond_mapping_bytes"] > 0 and run["anon_released_share"] is not None, variant
        else:
            assert run["beyond_mapping_bytes"] == 0 and run["anon_released_share"] is None, variant
    fresh = runs["fresh_process"]
    assert 0 < fresh["ready_s"] < fresh["first_token_s"] == fresh["decision_to_first_token_s"]
    pod = runs["new_pod"]
    assert 0 < pod["pod_created_s"] <= pod["pod_ip_s"] <= pod["readyz_s"] < pod["decision_to_first_token_s"]
    assert pod["kubelet_ready_s"] > 0 and pod["first_ttft_s"] > 0
    # the pod's start, step by step: every instant found, in order, adding up to decision -> pod Ready
    assert all(value is not None for value in pod["instants"].values()), pod["instants"]
    assert all(seconds >= 0 for seconds in pod["steps"].values()), pod["steps"]
    whole = pod["instants"]["pod_ready"] - pod["instants"]["decision"]
    assert sum(pod["steps"].values()) == pytest.approx(whole, abs=1e-6)
    assert set(fresh["steps"]) == {"imports", "weights", "warmup"} and all(v > 0 for v in fresh["steps"].values())
    for name, target in model["targets"].items():
        if "p95" in name:
            assert target["met"] is None and target["value"] > 0, name  # judged for SmolLM2 only
        else:
            assert target["value"] is not None and target["value"] > 0, name
            # the verdict is the figure's, against the limit the benchmark names, whichever way this run went
            limit, at_most = next(rule for prefix, rule in LIMITS.items() if name.startswith(prefix))
            assert target["met"] is (target["value"] <= limit if at_most else target["value"] >= limit), name
