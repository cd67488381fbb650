"""Engine sleep on the built-in worker, as a real subprocess with real checkpoints.

The memory a sleep releases is the worker's own measurement (``warmpool_sleep_released_bytes``,
from the process's VmRSS) cross-checked against /proc from outside; no timing is asserted.
Every wait is bounded; only 127.0.0.1 is addressed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_worker_server import FAST, HangUpClient, Worker

pytestmark = pytest.mark.integration

TOKEN = "sleepy-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MIB = 1024**2
PROMPT = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}


def _vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _model(dest: Path, dtype: str) -> Path:
    from warmpool_dev.testing_models import make_tiny_llama

    # ~60 MB of weights in float32: large enough that what a sleep frees stands far above the
    # allocator's and the interpreter's noise.
    return make_tiny_llama(dest, layers=4, hidden=512, heads=8, kv_heads=4, intermediate=2048,
                           vocab_size=512, dtype=dtype, max_position_embeddings=256)


def _start(model: Path, tmp: Path, *extra: str) -> Worker:
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    worker = Worker(model, *FAST, "--dtype", "float32", "--control-token-file", str(token), *extra,
                    log_path=tmp / "worker.log")
    worker.wait_for("ready", lambda: worker.readyz()[0] == 200, timeout=240)
    return worker


@pytest.fixture(scope="module")
def fp16_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A float16 checkpoint served in float32: the weights are converted copies (anonymous memory)."""
    tmp = tmp_path_factory.mktemp("fp16")
    worker = _start(_model(tmp / "model", "float16"), tmp)
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def fp32_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A float32 checkpoint served in float32: the weights are the file mapping (zero copy)."""
    tmp = tmp_path_factory.mktemp("fp32")
    worker = _start(_model(tmp / "model", "float32"), tmp, "--vllm-sleep-api")
    try:
        yield worker
    finally:
        worker.stop()


def _complete(worker: Worker) -> str:
    status, body = worker.json("POST", "/v1/completions", PROMPT)
    assert status == 200, body
    text: str = body["choices"][0]["text"]
    return text


def _sleep_and_measure(worker: Worker, level: int) -> tuple[int, int, dict[str, object]]:
    """(VmRSS before, VmRSS after, the answer) around one sleep at `level`."""
    before = _vm_rss(worker.proc.pid)
    status, state = worker.json("POST", "/control/sleep", {"level": level}, headers=AUTH)
    assert status == 200, state
    return before, _vm_rss(worker.proc.pid), state


@pytest.mark.parametrize("worker_name", ["fp16_worker", "fp32_worker"])
def test_sleep_releases_memory_and_wake_on_request_answers_the_same(
    worker_name: str, request: pytest.FixtureRequest
) -> None:
    """Level 1 on converted copies, level 2 on the zero-copy mapping: each frees the weights'
    memory (measured), the pod stays Ready, and a completion wakes it with the same greedy text."""
    worker: Worker = request.getfixturevalue(worker_name)
    level = 1 if worker_name == "fp16_worker" else 2
    expected = _complete(worker)
    # float32 bytes: 4 layers of q/o (512x512), k/v (512x256), MLP (3 x 512x2048), plus embed and head
    weights_bytes = 4 * (4 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 2048) + 2 * 512 * 512)

    before, after, state = _sleep_and_measure(worker, level)
    assert state["sleeping"] is True and state["level"] == level
    released = int(state["released_bytes"])  # type: ignore[call-overload]
    # Most of the weights' bytes left the process, by the worker's figure and by /proc's.
    assert released >= 0.9 * weights_bytes, (released, weights_bytes)
    assert before - after >= 0.9 * weights_bytes, (before, after, weights_bytes)
    metrics = worker.metrics()
    assert metrics[("warmpool_sleep_level", ())] == level
    assert metrics[("warmpool_sleep_released_bytes", ())] == released

    status, ready = worker.readyz()  # asleep, still Ready: it can serve within its wake time
    assert status == 200 and ready["sleep"]["sleeping"] is True
    assert worker.request("GET", "/health")[0] == 200

    wakes_before = metrics.get(("warmpool_wakes_on_request_total", ()), 0.0)
    assert _complete(worker) == expected  # woken by the request, same greedy text
    status, state = worker.json("GET", "/control/sleep", headers=AUTH)
    assert status == 200 and state["sleeping"] is False
    metrics = worker.metrics()
    assert metrics[("warmpool_sleep_level", ())] == 0
    assert metrics[("warmpool_wakes_on_request_total", ())] == wakes_before + 1
    assert metrics[("warmpool_wake_duration_seconds_count", ())] >= 1
    assert _vm_rss(worker.proc.pid) - after >= 0.8 * weights_bytes  # the weights are back


def test_control_wake_then_sleep_again(fp16_worker: Worker) -> None:
    expected = _complete(fp16_worker)
    for level in (2, 1):
        _sleep_and_measure(fp16_worker, level)
        status, state = fp16_worker.json("POST", "/control/wake", headers=AUTH)
        assert status == 200 and state["sleeping"] is False, state
        assert _complete(fp16_worker) == expected
    assert fp16_worker.metrics()[("warmpool_sleeps_total", ())] >= 2


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), ({"Authorization": "Bearer wrong"}, 403), ({"Authorization": "Basic x"}, 401)],
)
def test_sleep_needs_the_control_token(fp16_worker: Worker, headers: dict[str, str], status: int) -> None:
    for method, path in (("POST", "/control/sleep"), ("POST", "/control/wake"), ("GET", "/control/sleep")):
        got, _ = fp16_worker.json(method, path, {"level": 1} if method == "POST" else None, headers=headers)
        assert got == status, (method, path)
    assert fp16_worker.readyz()[1]["sleep"]["sleeping"] is False  # nothing slept


@pytest.mark.parametrize("level", [0, 3, "deep", True, None])
def test_bad_level_is_a_400_naming_it(fp16_worker: Worker, level: object) -> None:
    status, body = fp16_worker.json("POST", "/control/sleep", {"level": level}, headers=AUTH)
    assert status == 400 and "level" in body["error"]["message"] and body["error"]["param"] == "level", body
    assert fp16_worker.readyz()[1]["sleep"]["sleeping"] is False


def test_vllm_dev_mode_sleep_api(fp32_worker: Worker) -> None:
    """The shapes vLLM's dev-mode server answers, so the worker can stand in as a vLLM engine."""
    expected = _complete(fp32_worker)
    assert fp32_worker.json("GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert fp32_worker.request("POST", "/sleep?level=1")[0] == 200
    assert fp32_worker.json("GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert fp32_worker.request("POST", "/wake_up")[0] == 200
    assert fp32_worker.json("GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert fp32_worker.request("POST", "/sleep?level=7")[0] == 400
    assert _complete(fp32_worker) == expected


def test_vllm_dev_mode_api_is_off_by_default(fp16_worker: Worker) -> None:
    assert fp16_worker.request("POST", "/sleep?level=1")[0] == 404
    assert fp16_worker.request("GET", "/is_sleeping")[0] == 404


# -- sleep never overlaps generation ------------------------------------------------------------

RACE_PROMPT = "Once upon a time"
RACE_REQUESTS = 6


@pytest.fixture(scope="module")
def race_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A model with no EOS and a long context: one streaming completion keeps the engine busy
    for as long as the test holds it."""
    from warmpool_dev.testing_models import make_tiny_llama

    tmp = tmp_path_factory.mktemp("race")
    model = make_tiny_llama(tmp / "model", layers=8, hidden=128, intermediate=512, max_position_embeddings=4096,
                            with_eos=False)
    worker = _start(model, tmp, "--max-tokens-limit", "4000")
    try:
        yield worker
    finally:
        worker.stop()


def test_sleep_asked_while_requests_wait_never_runs_one_on_a_sleeping_engine(race_worker: Worker) -> None:
    """Requests that passed their "asleep?" check while the engine was busy, then a sleep: each
    request runs awake (before the sleep, or after a wake), never on the sleeping engine.

    Driven through the real handlers: a long streaming completion holds the engine, six more
    completions and then POST /control/sleep arrive, the long one hangs up.  Whatever order the
    engine takes them in, the end state is consistent (asleep with no weight resident, or
    awake), and every completion gets the greedy text it gets alone.
    """
    worker = race_worker
    request = {"prompt": RACE_PROMPT, "max_tokens": 4, "temperature": 0}
    status, alone = worker.json("POST", "/v1/completions", request)
    assert status == 200, alone
    expected = alone["choices"][0]["text"]

    arrived = worker.metrics()[("warmpool_requests_total", ())]
    holder = HangUpClient(worker.port, {"prompt": list(range(20, 45)), "max_tokens": 4000, "temperature": 0,
                                        "stream": True})
    answers: list[tuple[int, object]] = []
    slept: list[tuple[int, object]] = []

    def complete() -> None:
        answers.append(worker.json("POST", "/v1/completions", request))

    def sleep() -> None:
        slept.append(worker.json("POST", "/control/sleep", {"level": 1}, headers=AUTH))

    threads = [threading.Thread(target=complete) for _ in range(RACE_REQUESTS)]
    try:
        holder.read_until(b"data: ")  # the engine is generating for it
        for thread in threads:
            thread.start()
        worker.wait_for("the completions' arrival (each checks 'asleep?' first)",
                        lambda: worker.metrics()[("warmpool_requests_total", ())] >= arrived + 1 + RACE_REQUESTS,
                        timeout=60)
        sleeper = threading.Thread(target=sleep)
        sleeper.start()
        threads.append(sleeper)
        # the sleep reaches the engine's side (a thread waiting for its turn) before the holder lets go
        time.sleep(1.0)
    finally:
        holder.hang_up()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a request did not finish within 120 s"

    assert [status for status, _ in answers] == [200] * RACE_REQUESTS, answers
    assert all(json.dumps(body).count(json.dumps(expected)) for _, body in answers), (expected, answers)
    assert len(slept) == 1 and slept[0][0] in (200, 409), slept
    status, ready = worker.readyz()
    assert status == 200
    # The invariant the race broke: an engine that says it sleeps holds no weight.
    if ready["sleep"]["sleeping"]:
        assert ready["layers_resident"] == 0, ready
    metrics = worker.metrics()
    if metrics[("warmpool_sleep_level", ())] > 0:
        assert metrics[("warmpool_layers_resident", ())] == 0, metrics
    # and it is back to serving: a completion wakes it if it sleeps, with the same text
    assert _complete_text(worker, request) == expected


def _complete_text(worker: Worker, request: dict[str, object]) -> str:
    status, body = worker.json("POST", "/v1/completions", request)
    assert status == 200, body
    text: str = body["choices"][0]["text"]
    return text
