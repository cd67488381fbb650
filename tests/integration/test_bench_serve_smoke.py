"""`warmpool bench serve` end to end on a tiny random model, the worker only (llama.cpp needs the
real model's GGUF): the figures exist, are positive and hang together.  No timed assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import REPO, subprocess_env

pytestmark = pytest.mark.integration


def test_serve_tiny_worker_only(tmp_path: Path) -> None:
    from warmpool_dev.testing_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny", layers=2, max_position_embeddings=1024, with_eos=False)
    command = [sys.executable, "-m", "warmpool", "bench", "serve", "--model", str(model), "--servers", "warmpool",
               "--concurrency", "2,4", "--prompt-tokens", "40", "--max-tokens", "12", "--requests-per-client", "2",
               "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "results"), "--name", "smoke"]
    proc = subprocess.run(command, env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results" / "smoke.json").read_text())
    assert (tmp_path / "results" / "smoke.md").read_text().startswith("# warmpool bench serve")
    assert (tmp_path / "results" / "smoke.png").is_file()
    assert result["commit"] and len(result["load_average_start"]) == 3 and result["wall_s"] > 0
    server = result["servers"]["warmpool"]
    assert list(server["levels"]) == ["1", "2", "4"]  # level 1 always runs: the others are judged against it
    for concurrency, level in server["levels"].items():
        assert level["error_count"] == 0, level["errors"]
        assert level["requests"] == 2 * int(concurrency)
        assert level["output_tokens"] == 12 * level["requests"]  # no EOS: every completion runs to max_tokens
        assert level["throughput_tok_s"] > 0 and 0 < level["ttft_p50_s"] <= level["ttft_p95_s"]
    assert server["same_text"]["compared"] > 0 and server["same_text"]["equal"] == server["same_text"]["compared"]
    assert all(0 < u <= 1.05 for u in server["utilisation"].values())
