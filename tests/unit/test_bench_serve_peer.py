"""`warmpool bench serve`'s llama-server peer: where the binary is looked for and
what is said when it is absent, its command (--parallel = the level's concurrency, continuous
batching, the context of all slots), and the side-by-side scaling table."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
from warmpool_bench.serve import ServeSettings, run_serve
from warmpool_bench.serve_report import render_serve, scaling_table
from warmpool_bench.serve_servers import LLAMA_SERVER_ENV, find_llama_server, llama_server_command
from warmpool_dev.paths import ENV_CACHE_DIR
from warmpool_dev.testing_models import build_tokenizer_json

pytestmark = pytest.mark.unit


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def no_llama_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv(LLAMA_SERVER_ENV, raising=False)
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path / "cache"))  # no `make llama-server` build either


def test_absent_binary_names_every_place_looked(no_llama_server: None) -> None:
    with pytest.raises(FileNotFoundError) as error:
        find_llama_server(None)
    message = str(error.value)
    assert f"${LLAMA_SERVER_ENV} (unset)" in message and "llama-server on PATH" in message
    assert "`make llama-server`'s build (none)" in message
    assert "build it with `make llama-server`" in message and "--llama-server PATH" in message


def test_explicit_env_and_path_lookups(tmp_path: Path, no_llama_server: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match=f"--llama-server {tmp_path / 'nope'}"):
        find_llama_server(tmp_path / "nope")
    binary = _executable(tmp_path / "llama-server")
    assert find_llama_server(binary) == binary
    monkeypatch.setenv(LLAMA_SERVER_ENV, str(binary))
    assert find_llama_server(None) == binary
    monkeypatch.delenv(LLAMA_SERVER_ENV)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_llama_server(None) == binary


def test_command_batches_one_slot_per_client() -> None:
    command = llama_server_command(Path("/opt/llama-server"), Path("/m/model.gguf"), 8080, threads=2, parallel=12,
                                   context_per_slot=384)
    joined = " ".join(command)
    assert command[0] == "/opt/llama-server"
    assert "--parallel 12" in joined and "--cont-batching" in command
    assert "--ctx-size 4608" in joined  # every slot gets the whole per-request context
    assert "--threads 2" in joined and "--threads-batch 2" in joined and "--host 127.0.0.1" in joined
    with pytest.raises(ValueError, match="parallel"):
        llama_server_command(Path("/x"), Path("/m"), 1, threads=2, parallel=0, context_per_slot=384)


def _level(concurrency: int, steady: float | None, throughput: float) -> dict[str, object]:
    return {"concurrency": concurrency, "steady_tok_s": steady, "throughput_tok_s": throughput}


def test_scaling_side_by_side() -> None:
    servers: dict[str, dict[str, Any]] = {
        "warmpool": {"levels": {"1": _level(1, 10.0, 9.0), "12": _level(12, 42.0, 40.0)}},
        "llama_server": {"levels": {"1": _level(1, None, 20.0), "12": _level(12, None, 110.0)}},
        "llama_server_f32": {"error": "FileNotFoundError: no llama-server binary (...)"},
    }
    lines = scaling_table(servers)
    assert "| concurrency | warmpool | llama_server | llama_server_f32 |" in lines
    assert "| 1 | 1.00 | 1.00 | - |" in lines
    assert "| 12 | 4.20 | 5.50 | - |" in lines  # steady where there is one, wall throughput where not
    assert any(line.startswith("Not measured: llama_server_f32: FileNotFoundError") for line in lines)


def test_run_without_the_binary_reports_it_and_measures_the_rest(tmp_path: Path, no_llama_server: None) -> None:
    """No server is started: the llama-server entry fails at once, naming what is missing, and the
    report still renders with its scaling table."""
    model = tmp_path / "model"
    model.mkdir()
    build_tokenizer_json(model / "tokenizer.json")
    settings = ServeSettings(concurrency=(1, 2), servers=("llama_server",), prompt_tokens=16, max_tokens=4,
                             requests_per_client=1, work_dir=tmp_path / "work")
    result = run_serve(model, None, settings, log=lambda _line: None)
    assert "no llama-server binary" in result["servers"]["llama_server"]["error"]
    assert result["settings"]["llama_server"] is None
    text = render_serve(result)
    assert "--parallel" in text and "Failed: FileNotFoundError: no llama-server binary" in text


def test_the_report_names_each_ggufs_tensor_types() -> None:
    from warmpool_bench.serve_report import gguf_line

    line = gguf_line({"path": "/m/smollm2.Q4_K_M.gguf", "bytes": 100 * 2**20,
                      "tensor_types": {"Q5_0": 166, "F32": 61, "Q4_K": 16}})
    assert line == "GGUF: `smollm2.Q4_K_M.gguf`, 100.0 MiB; tensors: 166 Q5_0, 61 F32, 16 Q4_K."


def test_cpu_seconds_of_a_process_and_tokens_per_cpu_second() -> None:
    import os
    import time

    from warmpool_bench.serve_load import RequestTiming
    from warmpool_bench.serve_report import level_figures
    from warmpool_bench.serve_servers import cpu_seconds

    before, spent_from = cpu_seconds(os.getpid()), time.process_time()
    for _ in range(100_000_000):  # bounded: about 0.2 s of this process's CPU
        if time.process_time() - spent_from >= 0.2:
            break
    used = cpu_seconds(os.getpid()) - before
    assert used == pytest.approx(time.process_time() - spent_from, abs=0.05)
    timing = RequestTiming(0, 0, 0, 0.0, [0.1 * i for i in range(1, 9)])
    assert level_figures([timing], 1.0, 1, cpu_s=0.5)["tok_per_cpu_s"] == pytest.approx(16.0)
    assert level_figures([timing], 1.0, 1)["tok_per_cpu_s"] is None
