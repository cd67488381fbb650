"""The built-in engine's scheduling figures, in process (no HTTP), on a tiny model.

``python -m warmpool_bench.serve_scheduling [OUT.json]`` prints, with the load average at
start and end:

* TTFT p95 and time-between-tokens p95 at 12 closed-loop clients (about 130-token prompts, 32
  tokens out, 4 requests each, starts staggered by a request's duration alone ÷ 12, as
  ``bench serve`` does) ÷ the same figures for a request alone, and aggregate throughput ÷ alone;
* an 8-token request (max_tokens 8) behind three clients asking max_tokens=1000, with KV for
  3,000 tokens, ÷ the same request alone.

The model is `warmpool_dev.testing_models.make_tiny_llama` at 8 layers x 512 (compute, not
Python, dominates a step); the scheduler and engine are the worker's own.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from warmpool_dev.testing_models import make_tiny_llama
from warmpool_worker.builtin.batch_scheduler import BatchJob, BatchScheduler, BatchSettings
from warmpool_worker.builtin.engine import load_engine
from warmpool_worker.builtin.engine_gate import EngineGate
from warmpool_worker.engine_api import GenerationStep

CONCURRENCY = 12
PROMPT_TOKENS = 130
OUTPUT_TOKENS = 32
REQUESTS_PER_CLIENT = 4
KV_TOKENS_FOR_HEAD_OF_LINE = 3000
WAIT_S = 600.0


class Timed:
    """One request: when it was sent and when each token came."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.times: list[float] = []
        self.done = threading.Event()
        self.error: BaseException | None = None

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent

    @property
    def total(self) -> float:
        return self.times[-1] - self.sent

    def gaps(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.times, self.times[1:], strict=False)]


def _send(scheduler: BatchScheduler, prompt: list[int], max_tokens: int) -> Timed:
    timed = Timed()

    def step(_item: GenerationStep) -> None:
        timed.times.append(time.perf_counter())

    def end(error: BaseException | None) -> None:
        timed.error = error
        timed.done.set()

    scheduler.submit(BatchJob(prompt, max_tokens, 0.0, threading.Event(), lambda: None, step, end))
    return timed


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def _prompt(length: int, seed: int) -> list[int]:
    return [5 + (seed * 7 + 13 * i) % 250 for i in range(length)]


def _serve(model: Path, kv_cache_bytes: int) -> BatchScheduler:
    scheduler = BatchScheduler(EngineGate(), BatchSettings(16, 30.0))
    scheduler.attach(load_engine(model, kv_cache_bytes=kv_cache_bytes))
    return scheduler


def concurrency_figures(model: Path) -> dict[str, float]:
    scheduler = _serve(model, 1 << 30)
    try:
        for seed in range(3):  # warm
            _send(scheduler, _prompt(PROMPT_TOKENS, 100 + seed), OUTPUT_TOKENS).done.wait(WAIT_S)
        alone = []
        for seed in range(6):
            timed = _send(scheduler, _prompt(PROMPT_TOKENS, seed), OUTPUT_TOKENS)
            timed.done.wait(WAIT_S)
            alone.append(timed)
        stagger = statistics.median(t.total for t in alone) / CONCURRENCY
        served: list[Timed] = []
        lock = threading.Lock()

        def client(number: int) -> None:
            time.sleep(number * stagger)
            for index in range(REQUESTS_PER_CLIENT):
                timed = _send(scheduler, _prompt(PROMPT_TOKENS, 1000 + number * 10 + index), OUTPUT_TOKENS)
                with lock:
                    served.append(timed)
                timed.done.wait(WAIT_S)

        started = time.perf_counter()
        clients = [threading.Thread(target=client, args=(n,)) for n in range(CONCURRENCY)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(WAIT_S)
        wall = time.perf_counter() - started
    finally:
        scheduler.stop()
    ttft_alone = statistics.median(t.ttft for t in alone)
    tbt_alone = _p95([gap for t in alone for gap in t.gaps()])
    rate_alone = statistics.median(OUTPUT_TOKENS / t.total for t in alone)
    ttft = _p95([t.ttft for t in served])
    tbt = _p95([gap for t in served for gap in t.gaps()])
    rate = sum(len(t.times) for t in served) / wall
    return {"stagger_s": stagger, "ttft_alone_s": ttft_alone, "ttft_p95_s": ttft, "ttft_ratio": ttft / ttft_alone,
            "tbt_alone_p95_s": tbt_alone, "tbt_p95_s": tbt, "tbt_ratio": tbt / tbt_alone,
            "tokens_per_s_alone": rate_alone, "tokens_per_s": rate, "throughput_ratio": rate / rate_alone}


def head_of_line_figures(model: Path) -> dict[str, Any]:
    block_bytes = load_engine(model).kv_pool.block_bytes
    scheduler = _serve(model, (KV_TOKENS_FOR_HEAD_OF_LINE // 16) * block_bytes)
    try:
        alone = []
        for seed in range(3):
            timed = _send(scheduler, _prompt(8, 500 + seed), 8)
            timed.done.wait(WAIT_S)
            alone.append(timed.total)
        longs = [_send(scheduler, _prompt(8, 600 + seed), 1000) for seed in range(3)]
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and min(len(t.times) for t in longs[:2]) < 5:
            time.sleep(0.005)
        short = _send(scheduler, _prompt(8, 700), 8)
        short.done.wait(WAIT_S)
        at_short = [len(t.times) for t in longs]
        for timed in longs:
            timed.done.wait(WAIT_S)
    finally:
        scheduler.stop()
    return {"short_alone_s": statistics.median(alone), "short_behind_s": short.total,
            "head_of_line_ratio": short.total / statistics.median(alone), "long_tokens_when_short_done": at_short,
            "errors": [repr(t.error) for t in (*longs, short) if t.error is not None]}


def main(argv: list[str]) -> None:
    figures: dict[str, Any] = {"load_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "model", layers=8, hidden=512, heads=8, kv_heads=4, intermediate=1536,
                                max_position_embeddings=2048, with_eos=False, seed=21)
        figures.update(concurrency_figures(model))
        figures.update(head_of_line_figures(model))
    figures["load_end"] = os.getloadavg()
    text = json.dumps(figures, indent=1)
    print(text)
    if argv:
        Path(argv[0]).write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
