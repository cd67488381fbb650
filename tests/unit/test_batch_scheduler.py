"""Continuous batching on the real engine (tiny checkpoints): the scheduler's thread runs the
batch, requests join and leave it; greedy outputs equal a request served alone (preempted
ones included); short requests are not stuck behind long ones, aging lets a long prompt
through, a client gets its share; cancellation, the KV bound, sleep and wake, warm-up steps
and the NaN guard with a batch in flight."""

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
    ended_at: float = 0.0

    def wait(self) -> None:
        assert self.ended.wait(WAIT_S), "the batch did not end the request in time"


def _request(prompt: list[int], max_tokens: int, temperature: float = 0.0) -> Collected:
    collected: Collected

    def step(item: GenerationStep) -> None:
        collected.tokens.append(item.token_id)

    def end(error: BaseException | None) -> None:
        collected.error = error
        collected.ended_at = time.monotonic()
        collected.ended.set()

    job = BatchJob(prompt, max_tokens, temperature, threading.Event(), lambda: collected.admitted.set(), step, end)
    collected = Collected(job)
    return collected


class Serving:
    """An engine, its gate and a started scheduler, stopped at the end of the test."""

    def __init__(self, model_dir: Path, max_batch: int = 16, drain_s: float = 30.0,
                 kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES, aging_tokens_per_s: float | None = None) -> None:
        self.engine: LlamaEngine = load_engine(model_dir, chunk_tokens=16, kv_cache_bytes=kv_cache_bytes)
        self.gate = EngineGate()
        settings = BatchSettings(max_batch, drain_s)
        if aging_tokens_per_s is not None:
            settings = BatchSettings(max_batch, drain_s, aging_tokens_per_s=aging_tokens_per_s)
        self.recorder = StepRecorder(engine=self.engine)
        self.scheduler = BatchScheduler(self.gate, settings, self.recorder)
        self.scheduler.attach(self.engine)

    def submit(self, prompt: list[int], max_tokens: int, client: str = "") -> Collected:
        collected = _request(prompt, max_tokens)
        collected.job.client = client
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


@pytest.mark.parametrize("concurrent", [1, 4, 12])
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


def test_a_prompt_the_step_budget_holds_is_prefilled_in_one_step(serving: Serving) -> None:
    """The budget a step has left goes to more chunks of the prefill under way: a 120-token
    prompt (8 chunks of 16, within the 256-token budget) is in after one step, not eight."""
    steps = _greedy_alone_in_steps(serving, _prompt(120), 4)
    assert steps == 4  # one step took the whole prompt and sampled; three decodes followed


def _greedy_alone_in_steps(serving: Serving, prompt: list[int], max_tokens: int) -> int:
    before = len(serving.recorder.steps)
    tokens = serving.alone(prompt, max_tokens)
    assert len(tokens) == max_tokens
    return len(serving.recorder.steps) - before


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


@pytest.mark.parametrize("concurrent", [1, 4, 12])
def test_preempted_requests_answer_as_alone_under_a_small_kv_budget(model_dir: Path, concurrent: int) -> None:
    """KV for 12 blocks: mixed prompts whose prompt + max_tokens need up to 9 blocks each all run,
    taking blocks as they generate; when the blocks run out the most recent is preempted and
    recomputed, and every greedy answer is still the one it gets alone."""
    probe = load_engine(model_dir)
    serving = Serving(model_dir, kv_cache_bytes=12 * probe.kv_pool.block_bytes)
    try:
        prompts = [_prompt(n, offset=n) for n in LENGTHS]
        budgets = [20 + (i * 7) % 24 for i in range(len(prompts))]
        alone = [serving.alone(p, b) for p, b in zip(prompts, budgets, strict=True)]
        got: list[list[int]] = []
        for start in range(0, len(prompts), concurrent):
            wave = [serving.submit(p, b) for p, b in zip(prompts[start : start + concurrent],
                                                         budgets[start : start + concurrent], strict=True)]
            for collected in wave:
                collected.wait()
                assert collected.error is None, collected.error
            got += [c.tokens for c in wave]
        assert got == alone
        if concurrent > 1:
            assert serving.recorder.preemptions > 0  # the budget did force preemption
        assert max(serving.recorder.reserved) <= serving.engine.kv_blocks().total
        assert serving.engine.kv_blocks().reserved == serving.engine.kv_blocks().used == 0
        with pytest.raises(RequestError, match="kv-cache-bytes"):
            serving.scheduler.submit(_request(_prompt(100), 200).job)  # never fits alone: refused up front
    finally:
        serving.scheduler.stop()


def test_a_short_request_is_not_stuck_behind_long_generations(model_dir: Path) -> None:
    """Three long generations whose prompt + max_tokens would reserve the whole KV cache: a
    short request arriving after them joins at once and finishes while they still run."""
    probe = load_engine(model_dir)
    serving = Serving(model_dir, kv_cache_bytes=3 * 26 * probe.kv_pool.block_bytes)  # 3 x (8 + 400) positions
    try:
        short_prompt = _prompt(8, offset=50)
        expected = serving.alone(short_prompt, 8)
        longs = [serving.submit(_prompt(8, offset=k), 400) for k in range(3)]
        _until("the long ones decoding", lambda: min(len(c.tokens) for c in longs) >= 2)
        short = serving.submit(short_prompt, 8)
        short.wait()
        assert short.error is None and short.tokens == expected
        assert not any(c.ended.is_set() for c in longs)  # it did not wait for any of them
        for c in longs:
            c.job.cancel.set()
            c.wait()
    finally:
        serving.scheduler.stop()


def _long_prompt_among_short_ones(serving: Serving, shorts: int) -> tuple[Collected, list[Collected]]:
    """One slot: a 120-token prompt waits while short requests keep arriving (two always
    waiting beside it), `shorts` of them in all; the long one and the short ones."""
    first = serving.submit(_prompt(4), 4)  # holds the slot while the long one queues
    long = serving.submit(_prompt(120, offset=1), 2)
    served: list[Collected] = [first]
    deadline = time.monotonic() + WAIT_S
    while len(served) < shorts and time.monotonic() < deadline:
        if serving.scheduler.counts()[1] < 3:  # the long one and two short ones wait
            served.append(serving.submit(_prompt(4, offset=len(served)), 4))
        else:
            time.sleep(0.001)
    for collected in (long, *served):
        collected.wait()
    return long, served


def test_shortest_first_puts_a_long_prompt_behind_short_ones_without_aging(model_dir: Path) -> None:
    serving = Serving(model_dir, max_batch=1, aging_tokens_per_s=0.0)
    try:
        long, served = _long_prompt_among_short_ones(serving, shorts=40)
        # shortest first, no aging: every short request that arrived while it waited went before it
        assert sum(c.ended_at < long.ended_at for c in served) >= 39
    finally:
        serving.scheduler.stop()


def test_aging_lets_a_long_prompt_through(model_dir: Path) -> None:
    serving = Serving(model_dir, max_batch=1, aging_tokens_per_s=5000.0)  # 116 tokens longer: 23 ms
    try:
        long, served = _long_prompt_among_short_ones(serving, shorts=60)
        assert long.error is None
        # it went once aged, with short requests still arriving after it
        assert sum(c.ended_at > long.ended_at for c in served) >= 10
    finally:
        serving.scheduler.stop()


def test_a_client_gets_its_share_beside_a_client_that_sent_many(model_dir: Path) -> None:
    """Four slots; client a queues eight long requests, then client b two short ones: b runs
    beside a at once (half the slots each) instead of waiting for a's requests to finish."""
    serving = Serving(model_dir, max_batch=4)
    try:
        with serving.gate:  # all of them wait before the first step
            many = [serving.submit(_prompt(10, offset=k), 80, client="a") for k in range(8)]
            few = [serving.submit(_prompt(6, offset=20 + k), 6, client="b") for k in range(2)]
        for collected in few:
            collected.wait()
            assert collected.error is None
        assert not any(c.ended.is_set() for c in many)  # b did not wait for a's requests to finish
        for c in many:
            c.wait()
            assert c.error is None
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
    """The scheduler's observer: every step's (batch size, requests finished in it, seconds),
    the preemptions and admissions it reported."""

    steps: list[tuple[int, int, float]] = field(default_factory=list)
    preemptions: int = 0
    admissions: int = 0
    overtakes: int = 0
    reserved: list[int] = field(default_factory=lambda: [0])
    engine: LlamaEngine | None = None

    def set_batch(self, running: int, waiting: int) -> None:
        pass

    def engine_step(self, seconds: float, tokens: int, batch: int, finished: int) -> None:
        self.steps.append((batch, finished, seconds))
        if self.engine is not None:
            self.reserved.append(self.engine.kv_blocks().reserved)

    def batch_admitted(self, waited_s: float, overtook: bool) -> None:
        self.admissions += 1
        self.overtakes += overtook

    def batch_preempted(self) -> None:
        self.preemptions += 1


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
