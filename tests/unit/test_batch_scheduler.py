"""Continuous batching on the real engine (tiny checkpoints): the scheduler's thread runs the
batch, requests join and leave it; greedy outputs equal a request served alone; cancellation,
the KV bound, sleep and wake, warm-up steps and the NaN guard with a batch in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_worker.builtin.batch_scheduler import BatchJob, BatchScheduler, BatchSettings, SleepRefused
from warmpool_worker.builtin.engine import LlamaEngine, load_engine
from warmpool_worker.builtin.engine_gate import AwakeOnly, EngineAsleep, EngineGate
from warmpool_worker.defaults import DEFAULT_KV_CACHE_BYTES
from warmpool_worker.engine_api import GenerationStep, NonFiniteLogitsError, RequestError
from warmpool_worker.warmup import WarmupProgress, execute_plan, plan_warmup

from warmpool.contract.api import Tier

pytestmark = pytest.mark.unit

WAIT_S = 120.0  # every wait on the batch's thread is bounded
POISON_TOKEN = 100
#: Mixed prompt lengths: shorter than a chunk, exactly one, just past one, several chunks.
LENGTHS = (1, 2, 5, 9, 16, 17, 31, 33, 48, 64, 70, 120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("m") / "tiny", layers=3, seed=9, max_position_embeddings=512,
                           with_eos=False)


@pytest.fixture(scope="module")
def poisoned_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One embedding row holds a NaN: a prompt holding that token meets non-finite logits."""
    return make_tiny_llama(tmp_path_factory.mktemp("m") / "poisoned", layers=3, seed=9, max_position_embeddings=512,
                           with_eos=False, poison_tokens=(POISON_TOKEN,))


@dataclass(eq=False)
class Collected:
    """One request's job and what the batch handed back for it."""

    job: BatchJob
    tokens: list[int] = field(default_factory=list)
    admitted: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def wait(self) -> None:
        assert self.ended.wait(WAIT_S), "the batch did not end the request in time"


def _request(prompt: list[int], max_tokens: int, temperature: float = 0.0) -> Collected:
    collected: Collected

    def step(item: GenerationStep) -> None:
        collected.tokens.append(item.token_id)

    def end(error: BaseException | None) -> None:
        collected.error = error
        collected.ended.set()

    job = BatchJob(prompt, max_tokens, temperature, threading.Event(), lambda: collected.admitted.set(), step, end)
    collected = Collected(job)
    return collected


class Serving:
    """An engine, its gate and a started scheduler, stopped at the end of the test."""

    def __init__(self, model_dir: Path, max_batch: int = 16, drain_s: float = 30.0,
                 kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES) -> None:
        self.engine: LlamaEngine = load_engine(model_dir, chunk_tokens=16, kv_cache_bytes=kv_cache_bytes)
        self.gate = EngineGate()
        self.scheduler = BatchScheduler(self.gate, BatchSettings(max_batch, drain_s))
        self.scheduler.attach(self.engine)

    def submit(self, prompt: list[int], max_tokens: int) -> Collected:
        collected = _request(prompt, max_tokens)
        self.scheduler.submit(collected.job)
        return collected

    def alone(self, prompt: list[int], max_tokens: int) -> list[int]:
        collected = self.submit(prompt, max_tokens)
        collected.wait()
        assert collected.error is None, collected.error
        return collected.tokens


@pytest.fixture()
def serving(model_dir: Path) -> Iterator[Serving]:
    handle = Serving(model_dir)
    try:
        yield handle
    finally:
        handle.scheduler.stop()


def _prompt(length: int, offset: int = 0) -> list[int]:
    return [5 + (offset + 11 * i) % 90 for i in range(length)]  # below the poisoned token


def _until(what: str, check: object, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(check) and check():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stored in bf16, served in float32: converted weights, packed for oneDNN (`engine.linear`)."""
    return make_tiny_llama(tmp_path_factory.mktemp("m") / "bf16", layers=3, seed=9, max_position_embeddings=512,
                           with_eos=False, dtype="bfloat16")


@pytest.mark.parametrize("concurrent", [1, 12])
@pytest.mark.parametrize("stored", ["float32", "bfloat16"], ids=["zero-copy", "packed"])
def test_greedy_outputs_equal_a_request_served_alone(model_dir: Path, bf16_dir: Path, stored: str,
                                                      concurrent: int) -> None:
    serving = Serving(model_dir if stored == "float32" else bf16_dir)
    try:
        _greedy_equal_alone(serving, concurrent)
    finally:
        serving.scheduler.stop()


def _greedy_equal_alone(serving: Serving, concurrent: int) -> None:
    prompts = [_prompt(n, offset=n) for n in LENGTHS]
    budgets = [4 + (i * 5) % 13 for i in range(len(prompts))]  # they leave the batch at different steps
    alone = [serving.alone(p, b) for p, b in zip(prompts, budgets, strict=True)]
    assert alone[0] == [s.token_id for s in serving.engine.generate(prompts[0], budgets[0])]
    got: list[list[int]] = []
    for start in range(0, len(prompts), concurrent):
        wave = [serving.submit(p, b) for p, b in zip(prompts[start : start + concurrent],
                                                     budgets[start : start + concurrent], strict=True)]
        for collected in wave:
            collected.wait()
            assert collected.error is None, collected.error
        got += [c.tokens for c in wave]
    assert got == alone
    assert serving.scheduler.counts() == (0, 0)
    assert serving.engine.kv_blocks().reserved == serving.engine.kv_blocks().used == 0


def test_requests_join_a_running_batch_at_token_boundaries(serving: Serving) -> None:
    long_prompt, late_prompt = _prompt(40), _prompt(70, offset=3)
    expected_long, expected_late = serving.alone(long_prompt, 60), serving.alone(late_prompt, 5)
    running = serving.submit(long_prompt, 60)
    _until("the first request decoding", lambda: len(running.tokens) >= 3)
    late = serving.submit(late_prompt, 5)
    late.wait()
    assert not running.ended.is_set()  # the late one joined, finished and left while the first ran on
    running.wait()
    assert (running.tokens, late.tokens) == (expected_long, expected_late)


def test_beyond_the_kv_bound_requests_wait_and_are_served_in_order(model_dir: Path) -> None:
    probe = load_engine(model_dir)
    # room for the blocks of two requests of 40 + 24 positions (4 blocks each), not three
    serving = Serving(model_dir, kv_cache_bytes=9 * probe.kv_pool.block_bytes)
    try:
        prompts = [_prompt(40, offset=i) for i in range(5)]
        alone = [serving.alone(p, 24) for p in prompts]
        collected = [serving.submit(p, 24) for p in prompts]
        _until("two admitted", lambda: sum(c.admitted.is_set() for c in collected) >= 2)
        running, waiting = serving.scheduler.counts()
        assert running <= 2 and running + waiting + sum(c.ended.is_set() for c in collected) == 5
        assert serving.engine.kv_blocks().reserved <= serving.engine.kv_blocks().total
        for c in collected:
            c.wait()
        assert [c.tokens for c in collected] == alone
        with pytest.raises(RequestError, match="kv-cache-bytes"):
            serving.scheduler.submit(_request(_prompt(100), 100).job)  # never fits: refused up front
    finally:
        serving.scheduler.stop()


def test_cancelling_one_request_leaves_the_others_running(serving: Serving) -> None:
    prompts = [_prompt(10 + i, offset=i) for i in range(4)]
    alone = [serving.alone(p, 40) for p in prompts]
    collected = [serving.submit(p, 40) for p in prompts]
    _until("the batch under way", lambda: len(collected[1].tokens) >= 2)
    collected[1].job.cancel.set()
    at_cancel = len(collected[1].tokens)
    for c in collected:
        c.wait()
    assert collected[1].error is None and at_cancel <= len(collected[1].tokens) <= at_cancel + 1
    assert collected[1].tokens == alone[1][: len(collected[1].tokens)]
    assert [collected[i].tokens for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    assert serving.engine.kv_blocks().used == 0


def test_a_nan_row_fails_its_request_only(poisoned_dir: Path) -> None:
    serving = Serving(poisoned_dir)
    try:
        good = [_prompt(12), _prompt(33, offset=2)]
        alone = [serving.alone(p, 6) for p in good]
        assert POISON_TOKEN not in alone[0] + alone[1]  # the good ones never feed the poisoned row
        first = serving.submit(good[0], 6)
        bad = serving.submit([5, POISON_TOKEN, 7], 6)
        second = serving.submit(good[1], 6)
        for c in (first, bad, second):
            c.wait()
        assert isinstance(bad.error, NonFiniteLogitsError) and bad.tokens == []
        assert [first.tokens, second.tokens] == alone
    finally:
        serving.scheduler.stop()


def test_sleep_waits_for_the_batch_to_drain(serving: Serving) -> None:
    running = serving.submit(_prompt(20), 30)
    _until("decoding", lambda: len(running.tokens) >= 2)
    slept_with: list[int] = []

    def sleep() -> None:
        serving.engine.sleep(1)
        slept_with.append(len(running.tokens))

    sleeper = threading.Thread(target=serving.scheduler.sleep_when_idle, args=(sleep,))
    sleeper.start()
    running.wait()
    sleeper.join(WAIT_S)
    assert slept_with == [30]  # it slept once the request had all its tokens, not before
    assert serving.engine.sleep_level == 1 and serving.engine.layers_resident() == 0


def test_sleep_is_refused_when_the_batch_does_not_drain(model_dir: Path) -> None:
    # A drain far shorter than the request's decode (the tiny model decodes 400 tokens in about
    # 0.3 s on a quiet core, so a 0.3 s drain sometimes saw the batch empty).
    serving = Serving(model_dir, drain_s=0.05)
    try:
        running = serving.submit(_prompt(20), 480)
        _until("decoding", lambda: len(running.tokens) >= 2)
        with pytest.raises(SleepRefused, match=r"1 request\(s\) running.*--sleep-drain-timeout"):
            serving.scheduler.sleep_when_idle(lambda: serving.engine.sleep(1))
        assert serving.engine.sleep_level is None
        running.job.cancel.set()
        running.wait()
    finally:
        serving.scheduler.stop()


def test_a_request_reaching_a_sleeping_engine_wakes_it_first(serving: Serving) -> None:
    prompt = _prompt(25)
    expected = serving.alone(prompt, 8)
    woke: list[int | None] = []

    def waker() -> None:
        with serving.gate:
            woke.append(serving.engine.sleep_level)
            serving.engine.wake()

    serving.scheduler.waker = waker
    serving.scheduler.sleep_when_idle(lambda: serving.engine.sleep(2))
    assert serving.engine.sleep_level == 2
    assert serving.alone(prompt, 8) == expected
    assert woke == [2] and serving.engine.sleep_level is None


def test_warm_up_steps_interleave_with_a_running_batch(serving: Serving) -> None:
    """A tier that relaxes mid-batch tops the warm-up up between the batch's steps."""
    prompt = _prompt(30)
    expected = serving.alone(prompt, 50)
    running = serving.submit(prompt, 50)
    _until("decoding", lambda: len(running.tokens) >= 2)
    plan = plan_warmup(Tier.FULL, layer_order=[2, 1, 0], buckets=(16, 32), prompts_per_bucket=1,
                       max_context=serving.engine.max_context)
    progress = execute_plan(serving.engine, plan, ["warm this up"], WarmupProgress(),
                            engine_lock=AwakeOnly(serving.gate, serving.engine))
    running.wait()
    assert progress.prefills == {16: 1, 32: 1}
    assert running.tokens == expected


def test_a_warm_up_step_never_runs_on_a_sleeping_engine(model_dir: Path) -> None:
    """The top-up's gap: it checked "asleep?", then a sleep won the engine before its step.
    Under the gate, the step sees the sleep and stops instead of loading weights back."""
    engine = load_engine(model_dir)
    engine.load_all()
    gate = EngineGate()
    plan = plan_warmup(Tier.FULL, layer_order=[0, 1, 2], buckets=(16,), prompts_per_bucket=1,
                       max_context=engine.max_context)
    progress = WarmupProgress(layers_forced={0, 1, 2})  # only the prefill is left to top up
    outcome: list[BaseException | None] = []

    def top_up() -> None:
        try:
            execute_plan(engine, plan, ["warm this up"], progress, engine_lock=AwakeOnly(gate, engine))
            outcome.append(None)
        except EngineAsleep as error:
            outcome.append(error)

    with gate:  # the sleep holds the engine while the top-up comes for its step
        thread = threading.Thread(target=top_up)
        thread.start()
        time.sleep(0.2)
        engine.sleep(1)
    thread.join(WAIT_S)
    assert len(outcome) == 1 and isinstance(outcome[0], EngineAsleep)
    assert engine.sleep_level == 1 and engine.layers_resident() == 0 and progress.prefills == {}


def test_an_exclusive_user_goes_before_the_next_batch_step() -> None:
    gate = EngineGate()
    order: list[str] = []
    in_step = threading.Event()
    release = threading.Event()

    def batch() -> None:
        with gate.step():
            in_step.set()
            release.wait(WAIT_S)
            order.append("step 1")
        with gate.step():
            order.append("step 2")

    def exclusive() -> None:
        with gate:
            order.append("exclusive")

    runner = threading.Thread(target=batch)
    runner.start()
    assert in_step.wait(WAIT_S)
    other = threading.Thread(target=exclusive)
    other.start()
    time.sleep(0.1)  # the exclusive user waits for step 1
    release.set()
    runner.join(WAIT_S)
    other.join(WAIT_S)
    assert order == ["step 1", "exclusive", "step 2"]


@dataclass
class StepRecorder:
    """The scheduler's observer: every step's (batch size, requests finished in it, seconds)."""

    steps: list[tuple[int, int, float]] = field(default_factory=list)

    def set_batch(self, running: int, waiting: int) -> None:
        pass

    def engine_step(self, seconds: float, tokens: int, batch: int, finished: int) -> None:
        self.steps.append((batch, finished, seconds))


def test_each_step_reports_its_batch_size_and_the_requests_it_finished(model_dir: Path) -> None:
    """The capacity curve's raw points: a batch of 12 that shrinks one request at a time reports
    each request's finish in a step of the size the batch had then."""
    recorder = StepRecorder()
    engine = load_engine(model_dir, chunk_tokens=16, kv_cache_bytes=DEFAULT_KV_CACHE_BYTES)
    gate = EngineGate()
    scheduler = BatchScheduler(gate, BatchSettings(16, 30.0), recorder)
    scheduler.attach(engine)
    try:
        with gate:  # an exclusive holder: no step runs until all twelve wait, so they start together
            requests = [_request(_prompt(5 + i, offset=i), 3 + 2 * i) for i in range(12)]
            for collected in requests:
                scheduler.submit(collected.job)
        for collected in requests:
            collected.wait()
            assert collected.error is None, collected.error
    finally:
        scheduler.stop()
    finishing = [(batch, finished) for batch, finished, _ in recorder.steps if finished]
    assert finishing == [(size, 1) for size in range(12, 0, -1)]  # the shortest first, from a batch of 12
    assert recorder.steps[0][0] == 12 and all(seconds >= 0 for _, _, seconds in recorder.steps)
