"""The worker as a real subprocess on loopback with a real tiny Llama checkpoint.

Every wait is bounded in count and time; only 127.0.0.1 is ever addressed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from warmpool_worker.memory import rss_bytes

from tests.support.procs import HOST, REPO, free_port, subprocess_env
from warmpool.contract.metrics import PHASES

pytestmark = pytest.mark.integration

GIB = 1024**3
# small buckets and one short decode: the point is the control flow, on 2 shared cores
FAST = ["--buckets", "16,32,64", "--prompts-per-bucket", "1", "--decode-tokens", "2", "--guard-interval", "0.2"]


class Worker:
    def __init__(self, model: Path, *extra: str, log_path: Path, wrap: Sequence[str] = ()) -> None:
        """`wrap`: a command the worker's command line is appended to (it must exec it)."""
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        self.log = log_path.open("wb")
        command = [*wrap, sys.executable, "-m", "warmpool", "worker", "serve", "--model", str(model)]
        command += ["--host", HOST, "--port", str(self.port), "--device", "cpu", *extra]
        self.proc = subprocess.Popen(command, env=subprocess_env(), stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)

    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def json(self, method: str, path: str, body: object = None, **kw: Any) -> tuple[int, Any]:
        status, payload = self.request(method, path, body, **kw)
        return status, json.loads(payload)

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited ({self.proc.returncode}) waiting for {what}:\n{self.tail()}")
            try:
                if check():
                    return
            except (OSError, urllib.error.URLError):
                pass  # not listening yet
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n{self.tail()}")

    def readyz(self) -> tuple[int, dict[str, Any]]:
        return self.json("GET", "/readyz")

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, payload = self.request("GET", "/metrics")
        assert status == 200
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(payload.decode())
            for sample in family.samples
        }

    def tail(self) -> str:
        return self.whole_log()[-4000:]

    def whole_log(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from warmpool_dev.testing_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny", layers=10, max_position_embeddings=256)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "token"
    path.write_text("s3cret-token\n")
    return path


@pytest.fixture(scope="module")
def worker(tiny_model: Path, token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    log_path = tmp_path_factory.mktemp("logs") / "worker.log"
    handle = Worker(tiny_model, *FAST, "--control-token-file", str(token_file), log_path=log_path)
    seen: list[int] = []
    try:
        # Polled from the start, finely: torch imports before the server binds, so a tiny model's
        # window between the bind and the end of its warm-up is a fraction of a second.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (seen and seen[-1] == 200):
            if handle.proc.poll() is not None:
                raise AssertionError(f"worker exited ({handle.proc.returncode}):\n{handle.tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                seen.append(handle.readyz()[0])
            time.sleep(0.01)
        assert seen and seen[-1] == 200, f"not ready within 180s:\n{handle.tail()}"
        assert handle.request("GET", "/livez")[0] == 200
        handle.readiness_seen = seen  # type: ignore[attr-defined]
        yield handle
    finally:
        handle.stop()


def test_ready_only_after_warm_up(worker: Worker) -> None:
    seen: list[int] = worker.readiness_seen  # type: ignore[attr-defined]
    assert 503 in seen and seen[-1] == 200  # live and answering before warm, ready after
    status, body = worker.readyz()
    assert status == 200 and body["stage"] == "ready" and body["tier"] in ("full", "unknown")
    assert body["layers_resident"] == body["layers_total"] == 10
    assert body["warmup"]["prefills"] == {"16": 1, "32": 1, "64": 1}
    metrics = worker.metrics()
    phases = list(PHASES)  # the built-in worker reaches every phase, in this order
    durations = [metrics[("warmpool_coldstart_phase_duration_seconds", (("phase", p),))] for p in phases]
    assert durations == sorted(durations) and durations[-1] > 0
    assert metrics[("warmpool_ready", ())] == 1
    assert metrics[("warmpool_layers_resident", ())] == 10
    assert metrics[("warmpool_warmup_prefills_total", (("bucket", "64"),))] == 1
    assert any(name == "warmpool_layer_heat" and value > 0 for (name, _), value in metrics.items())


def test_completions(worker: Worker) -> None:
    status, models = worker.json("GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny"
    request = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    status, first = worker.json("POST", "/v1/completions", request)
    assert status == 200, first
    assert first["usage"]["completion_tokens"] == 4 and first["choices"][0]["finish_reason"] == "length"
    _, second = worker.json("POST", "/v1/completions", request)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]  # greedy is deterministic
    status, by_ids = worker.json("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    assert status == 200 and by_ids["usage"]["prompt_tokens"] == 3
    ttft = worker.metrics()[("warmpool_time_to_first_token_seconds_count", ())]
    assert ttft >= 3


def test_tokens_per_request_and_busy_seconds(worker: Worker) -> None:
    """The prompt and generated tokens of each served request, at the contract's edges."""
    before = worker.metrics()
    for prompt, max_tokens in (([5] * 20, 3), ([7] * 100, 5)):
        status, body = worker.json("POST", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                               "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == max_tokens, body
    after = worker.metrics()

    def delta(name: str, le: str | None = None) -> float:
        key = (name, () if le is None else (("le", le),))
        return after[key] - before.get(key, 0.0)

    prompt_tokens, generated = "warmpool_request_prompt_tokens", "warmpool_request_generated_tokens"
    assert delta(prompt_tokens + "_count") == 2 and delta(prompt_tokens + "_sum") == 120
    assert delta(prompt_tokens + "_bucket", "16.0") == 0
    assert delta(prompt_tokens + "_bucket", "24.0") == 1  # the 20-token prompt
    assert delta(prompt_tokens + "_bucket", "96.0") == 1
    assert delta(prompt_tokens + "_bucket", "128.0") == 2  # and the 100-token one
    assert delta(generated + "_sum") == 8 and delta(generated + "_bucket", "16.0") == 2
    assert delta("warmpool_generated_tokens_total") == 8
    assert delta("warmpool_engine_busy_seconds_total") > 0


def test_streaming(worker: Worker) -> None:
    body = json.dumps({"prompt": "Stream me", "max_tokens": 5, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(worker.base + "/v1/completions", data=body, method="POST")
    events: list[str] = []
    with urllib.request.urlopen(req, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) > 50:
                break
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    _, whole = worker.json("POST", "/v1/completions", {"prompt": "Stream me", "max_tokens": 5, "temperature": 0})
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


@pytest.mark.parametrize(
    ("raw", "status", "needle"),
    [
        (b"{not json", 400, "malformed JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "unknown model"),
        (json.dumps({"prompt": [1] * 300}).encode(), 400, "prompt too long"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": "ten"}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 10**6}).encode(), 400, "prompt too long"),
        (json.dumps({"prompt": ""}).encode(), 400, "empty"),
        (json.dumps({"prompt": ["a", "b"]}).encode(), 400, "batched"),
        (json.dumps({"prompt": 42}).encode(), 400, "prompt must be"),
        (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
        (json.dumps({"prompt": [99999], "max_tokens": 1}).encode(), 400, "vocabulary"),
    ],
)
def test_bad_requests_then_still_serving(worker: Worker, raw: bytes, status: int, needle: str) -> None:
    got, payload = worker.request("POST", "/v1/completions", raw=raw)
    body = json.loads(payload)
    assert got == status, body
    assert needle in body["error"]["message"]
    ok, _ = worker.json("POST", "/v1/completions", {"prompt": "still here", "max_tokens": 1})
    assert ok == 200


def test_unknown_path_is_json_404(worker: Worker) -> None:
    status, body = worker.json("GET", "/nope")
    assert status == 404 and "error" in body


def test_control_endpoint(worker: Worker) -> None:
    directive = {"tier": "truncated", "ttl_seconds": 1.5}
    status, _ = worker.json("POST", "/control/tier", directive)
    assert status == 401
    status, _ = worker.json("POST", "/control/tier", directive, headers={"Authorization": "Bearer wrong"})
    assert status == 403
    good = {"Authorization": "Bearer s3cret-token"}
    status, body = worker.json("POST", "/control/tier", {"tier": "hot"}, headers=good)
    assert status == 400 and "tier" in body["error"]["message"]
    status, body = worker.json("POST", "/control/tier", {"tier": "paused", "ttl_seconds": -1}, headers=good)
    assert status == 400
    status, body = worker.json("POST", "/control/tier", directive, headers=good)
    assert status == 200 and body["tier"] == "truncated" and body["directive"] == "truncated"
    metrics = worker.metrics()
    assert metrics[("warmpool_tier", (("tier", "truncated"),))] == 1
    assert metrics[("warmpool_directive_active", ())] == 1
    # the operator stops sending: the directive expires and the local tier rules again
    worker.wait_for("directive expiry", lambda: worker.readyz()[1]["directive"] is None, timeout=10)
    assert worker.readyz()[1]["tier"] == worker.readyz()[1]["local_tier"]
    assert worker.readyz()[0] == 200  # a stricter tier never un-readies a warm worker


class Ballast:
    """A separate process holding a resizable buffer of real, written memory."""

    # 16 MiB anonymous mappings, each written (so resident) and unmapped on shrink: the
    # figure moves at once and never dips far below or above the target on the way
    # (a bytearray shrink keeps its block; freed heap chunks may never go back to the OS).
    CODE = (
        "import mmap, sys\n"
        "chunks = []\n"
        "for line in sys.stdin:\n"
        "    size = int(line)\n"
        "    while chunks and sum(map(len, chunks)) > size:\n"
        "        chunks.pop().close()\n"
        "    while sum(map(len, chunks)) < size:\n"
        "        n = min(1 << 24, size - sum(map(len, chunks)))\n"
        "        m = mmap.mmap(-1, n)\n"
        "        m.write(b'\\x01' * n)\n"
        "        chunks.append(m)\n"
        "    print('ok', flush=True)\n"
    )

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.size = 0

    def resize(self, size: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{max(0, int(size))}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"
        self.size = max(0, int(size))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def test_memory_drives_tier_and_warm_up_depth(tiny_model: Path, tmp_path: Path) -> None:
    capacity = 2 * GIB
    ballast = Ballast()
    ballast.resize(int(0.93 * capacity))  # paused from the start whatever the worker's own size
    handle = Worker(
        tiny_model,
        *FAST,
        "--memory-capacity-bytes",
        str(capacity),
        "--memory-account-pid",
        str(ballast.proc.pid),
        log_path=tmp_path / "worker.log",
    )
    try:
        handle.wait_for("ready", lambda: handle.readyz()[0] == 200, timeout=180)
        body = handle.readyz()[1]
        assert body["tier"] == "paused" and body["memory"]["source"] == "configured"
        assert body["warmup"]["prefills"] == {} and body["warmup"]["layers_forced"] == 0

        def others() -> int:
            """Fresh usage of all but the ballast's buffer, read as the worker's probe reads it."""
            return rss_bytes(handle.proc.pid) + rss_bytes(ballast.proc.pid) - ballast.size

        def drive(ratio: float, tier: str) -> dict[str, Any]:
            # the worker's own usage moves while it warms: size the ballast once it is steady
            previous = others()
            for _ in range(20):
                time.sleep(0.3)
                current = others()
                if abs(current - previous) < 0.005 * capacity:
                    break
                previous = current
            ballast.resize(int(ratio * capacity) - current)
            handle.wait_for(f"tier {tier} at {ratio:.0%}", lambda: handle.readyz()[1]["tier"] == tier, timeout=30)
            return handle.readyz()[1]

        body = drive(0.80, "truncated")
        handle.wait_for("truncated top-up", lambda: handle.readyz()[1]["warmup"]["tier"] == "truncated", timeout=60)
        warm = handle.readyz()[1]["warmup"]
        assert warm["layers_forced"] == 3 and warm["prefills"] == {"16": 1}  # hottest 30 %, shortest bucket
        metrics = handle.metrics()
        assert metrics[("warmpool_warmup_prefills_total", (("bucket", "16"),))] == 1
        assert ("warmpool_warmup_prefills_total", (("bucket", "64"),)) not in metrics

        drive(0.30, "full")
        handle.wait_for("full top-up", lambda: handle.readyz()[1]["warmup"]["tier"] == "full", timeout=90)
        warm = handle.readyz()[1]["warmup"]
        assert warm["layers_forced"] == 10 and warm["prefills"] == {"16": 1, "32": 1, "64": 1}

        # up again and back down inside the hysteresis band: no flapping
        drive(0.95, "paused")
        time.sleep(1.0)
        body = drive(0.89, "paused")  # below 90 but not 5 points below: stays paused
        time.sleep(1.0)
        assert handle.readyz()[1]["tier"] == "paused"
        drive(0.80, "truncated")
        metrics = handle.metrics()
        ratio = metrics[("warmpool_accelerator_memory_used_ratio", (("source", "configured"),))]
        assert 0.7 <= ratio < 0.9
        assert handle.readyz()[0] == 200
    finally:
        handle.stop()
        ballast.close()


def test_load_failure_exits_nonzero_never_ready(tiny_model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "pickled"
    bad.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (bad / name).write_bytes((tiny_model / name).read_bytes())
    (bad / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    handle = Worker(bad, *FAST, log_path=tmp_path / "worker.log")
    statuses: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while handle.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError, urllib.error.URLError):
                statuses.append(handle.readyz()[0])
            time.sleep(0.1)
        assert handle.proc.poll() is not None, "worker did not exit"
    finally:
        code = handle.stop()
    assert code != 0
    assert 200 not in statuses
    assert "model load failed" in handle.tail() and "pytorch_model.bin" in handle.tail()


def test_missing_model_dir(tmp_path: Path) -> None:
    handle = Worker(tmp_path / "absent", *FAST, log_path=tmp_path / "worker.log")
    try:
        handle.proc.wait(timeout=90)
    finally:
        code = handle.stop()
    assert code != 0 and "absent" in handle.tail()


def test_kv_prefix_persisted_and_reused(tiny_model: Path, tmp_path: Path) -> None:
    kv_dir = tmp_path / "kv"
    extra = [*FAST, "--buckets", "16", "--kv-prefix-dir", str(kv_dir)]
    for attempt, expected in enumerate([(0, 1), (1, 0)]):
        handle = Worker(tiny_model, *extra, log_path=tmp_path / f"worker{attempt}.log")
        try:
            handle.wait_for("ready", lambda h=handle: h.readyz()[0] == 200, timeout=180)  # type: ignore[misc]
            warm = handle.readyz()[1]["warmup"]
            assert (warm["kv_loaded"], warm["kv_saved"]) == expected, handle.tail()
        finally:
            handle.stop()
    assert len(list(kv_dir.glob("*.safetensors"))) == 1


# -- issue #12: hardening of the request path and of warm-up --------------------------------------


def test_health_path_answers_like_readyz(worker: Worker) -> None:
    """vLLM, SGLang, TGI and llama.cpp answer GET /health; so does the built-in worker."""
    status, body = worker.json("GET", "/health")
    assert status == 200 and body == {"status": "ok"}
    assert worker.readyz()[0] == 200


class HangUpClient:
    """A real HTTP/1.1 client on a bare loopback socket, so a test can hang up mid-response."""

    def __init__(self, port: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection((HOST, port), timeout=60)
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + payload)
        self.received = b""

    def read_until(self, marker: bytes, limit: int = 1 << 20) -> None:
        """Read until `marker` arrived (bounded in size; each read by the socket's timeout)."""
        while marker not in self.received:
            chunk = self.sock.recv(65536)
            if not chunk or len(self.received) > limit:
                raise AssertionError(f"no {marker!r} in the response: {self.received[:500]!r}")
            self.received += chunk

    def hang_up(self) -> None:
        self.sock.close()


def _value(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


LONG_MAX_TOKENS = 4000
LONG_PROMPT = list(range(20, 45))


@pytest.fixture(scope="module")
def long_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A model with a 4096-token context and no EOS: a completion runs to max_tokens, long enough
    to hang up in the middle; at most one request may wait for the engine, and one runs at a
    time (--max-batch-size 1: a second one waits in the queue)."""
    from warmpool_dev.testing_models import make_tiny_llama

    model = make_tiny_llama(
        tmp_path_factory.mktemp("models") / "long", layers=8, hidden=128, intermediate=512,
        max_position_embeddings=4096, with_eos=False,
    )
    log_path = tmp_path_factory.mktemp("logs") / "long-worker.log"
    # 4 KiB of K/V per position (8 layers x K,V x 2 heads x 32 x fp32); a long completion's
    # prompt + max_tokens fill 252 blocks of 16 positions, of the 300 the cache holds.
    kv_cache_bytes = 300 * 16 * 4096
    handle = Worker(model, *FAST, "--max-queued-requests", "1", "--max-tokens-limit", str(LONG_MAX_TOKENS),
                    "--kv-cache-bytes", str(kv_cache_bytes), "--max-batch-size", "1", log_path=log_path)
    try:
        handle.wait_for("ready", lambda: handle.readyz()[0] == 200, timeout=180)
        yield handle
    finally:
        handle.stop()


def _wait_cancelled(worker: Worker, before: float, count: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    def cancelled() -> bool:
        return _value(worker.metrics(), "warmpool_requests_cancelled_total") >= before + count

    worker.wait_for(f"{count} cancelled request(s)", cancelled, timeout=60)
    return worker.metrics()


def _assert_disconnect_logged_quietly(worker: Worker, since: int) -> None:
    log = worker.whole_log()[since:]
    assert "client disconnected" in log, log
    for noise in ("Traceback", "unexpected error", "Error handling request", "generation failed"):
        assert noise not in log, log


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_hang_up_stops_generation_within_one_step(long_worker: Worker, stream: bool) -> None:
    before = long_worker.metrics()
    log_start = len(long_worker.whole_log())
    tokens_before = _value(before, "warmpool_generated_tokens_total")
    client = HangUpClient(long_worker.port, {"prompt": LONG_PROMPT, "max_tokens": LONG_MAX_TOKENS,
                                             "temperature": 0, "stream": stream})
    if stream:
        client.read_until(b"data: ")  # a token is out: the generation is under way
    else:
        long_worker.wait_for(
            "generation under way",
            lambda: _value(long_worker.metrics(), "warmpool_generated_tokens_total") >= tokens_before + 5,
            timeout=60,
        )
        # the KV cache held for it follows the tokens generated so far, not max_tokens
        # (one scrape: the KV figure is read before the token count, which only grows)
        metrics = long_worker.metrics()
        positions = len(LONG_PROMPT) + _value(metrics, "warmpool_generated_tokens_total") - tokens_before
        kv_slots = _value(metrics, "warmpool_kv_cache_tokens")
        assert 0 < kv_slots <= 1.25 * positions + 64, (kv_slots, positions)
        assert kv_slots < len(LONG_PROMPT) + LONG_MAX_TOKENS
    client.hang_up()
    after = _wait_cancelled(long_worker, _value(before, "warmpool_requests_cancelled_total"), 1)
    generated = _value(after, "warmpool_generated_tokens_total") - tokens_before
    after_hang_up = _value(after, "warmpool_tokens_after_disconnect_total") - _value(
        before, "warmpool_tokens_after_disconnect_total")
    assert 1 <= generated < LONG_MAX_TOKENS
    assert after_hang_up <= 1  # the engine stopped within one decode step of the hang-up
    assert _value(after, "warmpool_kv_cache_tokens") == 0  # and let go of its KV cache
    _assert_disconnect_logged_quietly(long_worker, log_start)
    status, _ = long_worker.json("POST", "/v1/completions", {"prompt": "still serving", "max_tokens": 2})
    assert status == 200


def test_max_tokens_above_the_limit_is_a_400_naming_the_field(long_worker: Worker) -> None:
    status, body = long_worker.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": LONG_MAX_TOKENS + 1})
    assert status == 400, body
    assert body["error"]["param"] == "max_tokens"
    assert "max_tokens" in body["error"]["message"] and str(LONG_MAX_TOKENS) in body["error"]["message"]


def test_full_queue_is_a_429_with_retry_after(long_worker: Worker) -> None:
    before = long_worker.metrics()
    long_request = {"prompt": LONG_PROMPT, "max_tokens": LONG_MAX_TOKENS, "temperature": 0}
    running = HangUpClient(long_worker.port, {**long_request, "stream": True})
    waiting: HangUpClient | None = None
    try:
        running.read_until(b"data: ")  # holds the engine
        waiting = HangUpClient(long_worker.port, long_request)
        long_worker.wait_for("one request queued",
                             lambda: _value(long_worker.metrics(), "warmpool_requests_queued") == 1, timeout=60)
        request = urllib.request.Request(
            long_worker.base + "/v1/completions", data=json.dumps({"prompt": "one more", "max_tokens": 2}).encode(),
            method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 429
        assert refused.value.headers["Retry-After"] == "1"
        body = json.loads(refused.value.read())
        assert body["error"]["type"] == "queue_full" and "--max-queued-requests" in body["error"]["message"]
        assert _value(long_worker.metrics(), "warmpool_requests_rejected_total", reason="queue_full") == _value(
            before, "warmpool_requests_rejected_total", reason="queue_full") + 1
    finally:
        running.hang_up()
        if waiting is not None:
            waiting.hang_up()
    _wait_cancelled(long_worker, _value(before, "warmpool_requests_cancelled_total"), 2)
    assert _value(long_worker.metrics(), "warmpool_requests_queued") == 0
    status, _ = long_worker.json("POST", "/v1/completions", {"prompt": "served again", "max_tokens": 2})
    assert status == 200


def _watch_until_exit(handle: Worker, seconds: float) -> list[tuple[int, int]]:
    """(readyz, health) statuses polled until the worker exits (bounded in time)."""
    seen: list[tuple[int, int]] = []
    deadline = time.monotonic() + seconds
    while handle.proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError, urllib.error.URLError):
            seen.append((handle.readyz()[0], handle.request("GET", "/health")[0]))
        time.sleep(0.1)
    return seen


def test_nan_checkpoint_never_ready_exits_naming_the_model(tmp_path: Path) -> None:
    from warmpool_dev.testing_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny-nan", layers=4, poison_layers=(1,))
    handle = Worker(model, *FAST, log_path=tmp_path / "worker.log")
    try:
        seen = _watch_until_exit(handle, 120)
        assert handle.proc.poll() is not None, "worker did not exit"
    finally:
        code = handle.stop()
    assert code != 0
    assert all(200 not in pair for pair in seen), seen
    log = handle.whole_log()
    assert "'tiny-nan'" in log and "non-finite logits" in log and "model.layers.1.mlp.down_proj.weight" in log


def test_nan_checkpoint_at_the_paused_tier_never_ready(tmp_path: Path) -> None:
    """Paused tier: the warm-up runs no prefill, yet a NaN checkpoint must not turn Ready (a rollout
    under memory pressure would then retire the good pods): a one-token check prefill runs first."""
    from warmpool_dev.testing_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny-paused-nan", layers=4, poison_layers=(3,))
    # a 1 MiB "capacity" is far below the worker's own usage: paused from the first reading
    handle = Worker(model, *FAST, "--memory-capacity-bytes", str(1 << 20), log_path=tmp_path / "worker.log")
    try:
        seen = _watch_until_exit(handle, 120)
        assert handle.proc.poll() is not None, "worker did not exit"
    finally:
        code = handle.stop()
    assert code != 0
    assert all(200 not in pair for pair in seen), seen
    log = handle.whole_log()
    assert "warm-up plan at tier paused" in log and "one-token check prefill" in log
    assert "'tiny-paused-nan'" in log and "non-finite logits" in log and "model.layers.3.mlp.down_proj.weight" in log


#: A token whose embedding row holds a NaN: only a prompt holding it meets non-finite logits
#: (the readiness check's token, the first of "Hello", is another).
POISON_TOKEN = 100


def test_nan_met_by_a_request_later_is_a_5xx_and_unready(tmp_path: Path) -> None:
    """Logits that turn NaN only for some input pass the check before ready; the request that
    meets them gets a 500 naming the model, and the worker turns unready for good."""
    from warmpool_dev.testing_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny-late-nan", layers=4, poison_tokens=(POISON_TOKEN,))
    handle = Worker(model, *FAST, "--memory-capacity-bytes", str(1 << 20), log_path=tmp_path / "worker.log")
    try:
        handle.wait_for("ready", lambda: handle.readyz()[0] == 200, timeout=180)
        body = handle.readyz()[1]
        assert body["tier"] == "paused" and body["layers_resident"] == 4  # the check prefill passed them all
        assert handle.request("GET", "/health")[0] == 200
        status, answer = handle.json("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3})
        assert status == 200, answer  # a prompt without the poisoned token is served
        status, answer = handle.json("POST", "/v1/completions", {"prompt": [5, POISON_TOKEN, 7], "max_tokens": 3})
        assert status == 500, answer
        assert "'tiny-late-nan'" in answer["error"]["message"] and "non-finite" in answer["error"]["message"]
        status, body = handle.readyz()
        assert status == 503 and body["stage"] == "unhealthy"
        assert "model.embed_tokens.weight" in body["error"]
        assert handle.request("GET", "/health")[0] == 503
        status, _ = handle.json("POST", "/v1/completions", {"prompt": "again", "max_tokens": 3})
        assert status == 503  # refused up front from now on
        metrics = handle.metrics()
        assert _value(metrics, "warmpool_ready") == 0
        assert _value(metrics, "warmpool_non_finite_logits_total") == 1
        assert handle.proc.poll() is None  # unready, still up to say why
        assert "the worker is unready from now on" in handle.whole_log()
    finally:
        handle.stop()


def _can_mount_in_user_namespace() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt || exit 1"],
                           capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


@pytest.mark.parametrize(
    ("mount_options", "reason"),
    [("size=4k", "ENOSPC"), ("ro", "EROFS"), (None, "ENOTDIR")],
    ids=["disk-full", "read-only", "not-a-directory"],
)
def test_failed_kv_prefix_save_is_counted_never_fatal(
    tiny_model: Path, tmp_path: Path, mount_options: str | None, reason: str
) -> None:
    kv_dir = tmp_path / "kv"
    wrap: list[str] = []
    if mount_options is None:
        (tmp_path / "file").write_text("a file, not a directory\n")
        kv_dir = tmp_path / "file" / "kv"
    else:
        # a real small or read-only filesystem at kv_dir, in a mount namespace of the worker's own
        if not _can_mount_in_user_namespace():
            pytest.skip("unshare cannot mount a tmpfs in a user namespace here")
        kv_dir.mkdir()
        wrap = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o {mount_options} tmpfs "{kv_dir}" && exec "$@"', "sh"]
    handle = Worker(tiny_model, *FAST, "--buckets", "16", "--kv-prefix-dir", str(kv_dir),
                    log_path=tmp_path / "worker.log", wrap=wrap)
    try:
        handle.wait_for("ready", lambda: handle.readyz()[0] == 200, timeout=180)
        warm = handle.readyz()[1]["warmup"]
        assert (warm["kv_saved"], warm["kv_save_errors"], warm["prefills"]) == (0, 1, {"16": 1})
        assert _value(handle.metrics(), "warmpool_kv_prefix_save_errors_total", reason=reason) == 1
        assert "cannot persist warm prefix KV" in handle.whole_log()
        status, _ = handle.json("POST", "/v1/completions", {"prompt": "served anyway", "max_tokens": 2})
        assert status == 200
    finally:
        handle.stop()
    if mount_options is not None:
        assert list(kv_dir.iterdir()) == []  # the tmpfs lived in the worker's namespace only
