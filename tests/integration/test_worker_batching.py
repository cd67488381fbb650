"""Continuous batching through the worker's HTTP API, as a real subprocess with a real checkpoint:
twelve concurrent completions share one running batch and each gets the greedy text it gets
alone; the capacity metrics follow the batch.  Every wait is bounded; only 127.0.0.1 is addressed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_worker_server import FAST, Worker

pytestmark = pytest.mark.integration

CONCURRENT = 12
#: Prompt lengths (tokens) from below one prefill chunk to several chunks (the chunk is 64).
LENGTHS = (1, 7, 30, 63, 64, 65, 100, 129, 150, 200, 17, 90)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    from warmpool_dev.testing_models import make_tiny_llama

    model = make_tiny_llama(tmp_path_factory.mktemp("models") / "batch", layers=4, hidden=128, intermediate=256,
                            max_position_embeddings=1024, with_eos=False, seed=21)
    handle = Worker(model, *FAST, "--max-batch-size", "16", log_path=tmp_path_factory.mktemp("logs") / "worker.log")
    try:
        handle.wait_for("ready", lambda: handle.readyz()[0] == 200, timeout=180)
        yield handle
    finally:
        handle.stop()


def _requests() -> list[dict[str, Any]]:
    return [{"prompt": [5 + (n + 13 * i) % 250 for i in range(n)], "max_tokens": 24 + (7 * k) % 40, "temperature": 0}
            for k, n in enumerate(LENGTHS)]


def _text(worker: Worker, body: dict[str, Any]) -> tuple[str, int]:
    status, answer = worker.json("POST", "/v1/completions", body)
    assert status == 200, answer
    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]


def _value(worker: Worker, name: str) -> float:
    return worker.metrics().get((name, ()), 0.0)


def test_concurrent_completions_share_the_batch_and_answer_as_alone(worker: Worker) -> None:
    requests = _requests()
    alone = [_text(worker, body) for body in requests]
    assert [tokens for _, tokens in alone] == [body["max_tokens"] for body in requests]

    answers: dict[int, tuple[str, int]] = {}
    seen_running: list[float] = []
    seen_used: list[float] = []
    done = threading.Event()

    def client(index: int) -> None:
        answers[index] = _text(worker, requests[index])

    def watch() -> None:
        deadline = time.monotonic() + 120
        while not done.is_set() and time.monotonic() < deadline:
            metrics = worker.metrics()
            seen_running.append(metrics.get(("warmpool_requests_running", ()), 0.0))
            seen_used.append(metrics.get(("warmpool_kv_blocks_used", ()), 0.0))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(CONCURRENT)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(timeout=180)
        assert not thread.is_alive(), "a completion did not finish within 180 s"
    done.set()
    watcher.join(timeout=30)

    assert [answers[i] for i in range(CONCURRENT)] == alone
    assert max(seen_running) >= 2, seen_running  # they ran together, not one after another
    assert max(seen_used) > 0
    metrics = worker.metrics()
    assert metrics[("warmpool_requests_running", ())] == 0
    assert metrics[("warmpool_kv_blocks_used", ())] == metrics[("warmpool_kv_blocks_reserved", ())] == 0
    assert metrics[("warmpool_kv_blocks_free", ())] == metrics[("warmpool_kv_blocks_total", ())] > 0
    assert metrics[("warmpool_requests_queued", ())] == 0
    assert metrics[("warmpool_generation_tokens_per_second", ())] > 0  # tokens in the last 10 s


def test_a_small_kv_cache_preempts_and_refuses_only_what_never_fits(tmp_path: Path) -> None:
    """KV for 128 positions: a request needing more than that alone is a 400; four concurrent
    ones (two API keys) needing up to 112 each all run, preempted and recomputed as the blocks
    run out, each answering as alone; /metrics counts the preemptions and the queue."""
    from warmpool_dev.testing_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "m", layers=2, max_position_embeddings=1024, with_eos=False)
    # 2 layers x K,V x 2 heads x 16 x fp32 = 512 bytes a position: 64 KiB hold 128 positions
    handle = Worker(model, *FAST, "--kv-cache-bytes", str(64 * 1024), log_path=tmp_path / "worker.log")
    try:
        handle.wait_for("ready", lambda: handle.readyz()[0] == 200, timeout=180)
        status, body = handle.json("POST", "/v1/completions", {"prompt": [5] * 100, "max_tokens": 100})
        assert status == 400 and "--kv-cache-bytes" in body["error"]["message"], body
        assert handle.json("POST", "/v1/completions", {"prompt": [5] * 10, "max_tokens": 10})[0] == 200
        bodies = [{"prompt": [5 + (k + 3 * i) % 200 for i in range(12 + 4 * k)], "max_tokens": 90, "temperature": 0}
                  for k in range(4)]
        alone = [_text(handle, body) for body in bodies]
        answers: dict[int, tuple[str, int]] = {}

        def client(index: int) -> None:
            headers = {"Authorization": f"Bearer key-{index % 2}"}
            status, answer = handle.json("POST", "/v1/completions", bodies[index], headers=headers)
            assert status == 200, answer
            answers[index] = answer["choices"][0]["text"], answer["usage"]["completion_tokens"]

        clients = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(timeout=180)
            assert not thread.is_alive(), "a completion did not finish within 180 s"
        assert [answers[i] for i in range(len(bodies))] == alone
        metrics = handle.metrics()
        assert metrics[("warmpool_batch_preemptions_total", ())] > 0
        assert metrics[("warmpool_batch_queue_wait_seconds_total", ())] > 0
        assert metrics[("warmpool_batch_waiting", ())] == 0
        assert ("warmpool_batch_overtakes_total", ()) in metrics
        assert metrics[("warmpool_kv_blocks_used", ())] == metrics[("warmpool_kv_blocks_reserved", ())] == 0
    finally:
        handle.stop()
