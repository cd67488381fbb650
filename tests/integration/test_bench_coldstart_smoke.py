"""`warmpool bench coldstart` end to end on a tiny random model, one run: every variant, sane figures.

No timed assertions: the figures only have to exist, be positive and hang together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from warmpool_bench.coldstart import CACHE_STATES, VARIANTS

pytestmark = pytest.mark.integration


def test_coldstart_tiny_one_run(tmp_path: Path) -> None:
    env = dict(os.environ, WARMPOOL_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("POD_IP", None)
    command = [
        sys.executable, "-m", "warmpool", "bench", "coldstart", "--sizes", "tiny", "--runs", "1", "--steady", "1",
        "--buckets", "16,32", "--request-tokens", "16", "--timeout", "300",
        "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "results"), "--name", "smoke",
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results" / "smoke.json").read_text())
    assert (tmp_path / "results" / "smoke.md").read_text().startswith("# warmpool bench coldstart")
    model = result["models"]["tiny"]
    assert model["weight_bytes"] > 0
    assert set(model["variants"]) == set(VARIANTS)
    for variant, states in model["variants"].items():
        assert set(states) == set(CACHE_STATES)
        for state, data in states.items():
            (run,) = data["runs"]
            assert "error" not in run, (variant, state, run)
            med = data["median"]
            assert med["first_ttft_s"] > 0 and med["steady_ttft_s"] > 0
            assert med["peak_rss_bytes"] > 10 * 2**20
            if variant == "floor":
                assert med["read_bytes"] == model["weight_bytes"]
                assert 0 < med["import_s"] < med["floor_s"]
            else:
                assert 0 < med["usable_s"] <= med["ready_s"] + 1e-6 < med["first_token_s"] + 1e-6
                # the worker logs its load time to 10 ms: a tiny model can read 0.00
                assert med["load_s"] >= 0
    runs = {v: model["variants"][v]["cold"]["runs"][0] for v in VARIANTS}
    assert runs["warmpool_truncated"]["tier"] == "truncated"
    assert runs["warmpool_full"]["tier"] in ("full", "unknown")
    assert runs["warmpool_kv_prefix"]["kv_loaded"] >= 1 and runs["warmpool_kv_prefix"]["kv_saved"] == 0
    assert runs["warmpool_truncated"]["layers_forced"] < runs["warmpool_full"]["layers_forced"]
    for state in CACHE_STATES:
        ratios = model["ratios"][state]
        for key in ("usable_speedup_vs_transformers", "ready_over_floor",
                    "first_over_steady.warmpool_full", "first_over_steady.transformers"):
            assert ratios[key] is not None and ratios[key] > 0, (state, key)
        # None when the tiny model's load logged as 0.00 s (no ratio is better than a division by 0)
        assert ratios["load_bandwidth_fraction"] is None or ratios["load_bandwidth_fraction"] > 0
