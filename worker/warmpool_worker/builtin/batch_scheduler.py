"""Continuous batching on the built-in engine: one thread runs the batch, step after step.

Requests (`BatchJob`) are submitted from the HTTP side and wait, first come first served,
until the batch has room: fewer than ``--max-batch-size`` running, and the KV blocks for the
request's prompt plus its max_tokens free to reserve (``--kv-cache-bytes``).  The bounded
queue in front (``--max-queued-requests``, 429 past it) is the HTTP side's.  Each step
advances every running request by one token (or one prompt chunk, `engine.batch`); a
request joins or leaves at the boundary between two steps:

* it ends when its last token is out, when its client went away (the cancel flag is read
  before every step, so a hang-up costs at most the step under way), or when the engine
  fails it: a failure of its own row (non-finite logits, a draw that could not be sampled,
  its cache not allocated) or of its own callbacks ends it alone, and its batch-mates go on;
  only a failure of the shared step itself (the forward pass, e.g. weights that changed
  under the mapping) ends every request of that step;
* its KV blocks are given back the moment it ends.

Sleep and generation never overlap: both are decided under the engine gate (`engine_gate`),
admission included.  `sleep_when_idle` waits (bounded) for the batch to drain and nothing
to wait, then sleeps under the gate, or is refused (`SleepRefused`) saying what was still
running.  A request that finds the engine asleep when it reaches the head of the queue wakes
it first (through `waker`, counted as a wake on request).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from warmpool_worker.builtin.engine_gate import EngineGate
from warmpool_worker.engine_api import BatchingEngine, GenerationStep, RequestError, Sleepable

log = logging.getLogger(__name__)

#: Seconds `stop` waits for the step under way to finish.
STOP_JOIN_S = 30.0


class SchedulerStopped(RuntimeError):
    """The worker is stopping: a request still in the batch or its queue ends with this (503)."""


class KVCacheTooSmall(RequestError):
    """The prompt and max_tokens need more KV-cache positions than the whole cache holds (400)."""


class SleepRefused(Exception):
    """The batch did not drain in time: the engine stays awake; the message says what ran."""


@dataclass(frozen=True)
class BatchSettings:
    max_batch_size: int
    sleep_drain_timeout_s: float


@dataclass(eq=False)
class BatchJob:
    """One request's generation, as the HTTP side hands it over.  The callbacks run on the
    scheduler's thread: `on_admitted` once it joins the batch, `on_step` per token, `on_end`
    exactly once (None when it finished or was cancelled, else the error that ended it)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    cancel: threading.Event
    on_admitted: Callable[[], None]
    on_step: Callable[[GenerationStep], None]
    on_end: Callable[[BaseException | None], None]
    sequence: Any = field(default=None, repr=False)


class BatchObserver(Protocol):
    """What the scheduler reports (the worker's metrics implement it)."""

    def set_batch(self, running: int, waiting: int) -> None: ...

    def engine_step(self, seconds: float, tokens: int, batch: int, finished: int) -> None: ...


class _Unobserved:
    def set_batch(self, running: int, waiting: int) -> None:
        pass

    def engine_step(self, seconds: float, tokens: int, batch: int, finished: int) -> None:
        pass


class BatchScheduler:
    def __init__(self, gate: EngineGate, settings: BatchSettings, observer: BatchObserver | None = None) -> None:
        self.gate = gate
        self.settings = settings
        self.observer: BatchObserver = observer or _Unobserved()
        #: Wakes a sleeping engine (blocking) for a request at the head of the queue.
        self.waker: Callable[[], None] | None = None
        #: Called before every step; raises (WeightsChangedError) when the weights cannot be used.
        self.weights_check: Callable[[], None] | None = None
        self._engine: BatchingEngine | None = None
        self._cond = threading.Condition()
        self._waiting: deque[BatchJob] = deque()
        self._running: list[BatchJob] = []
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- the HTTP side ----------------------------------------------------------------------
    def attach(self, engine: BatchingEngine) -> None:
        """Serve with this engine from now on: the batch's thread starts."""
        self._engine = engine
        self._thread = threading.Thread(target=self._run, name="batch", daemon=True)
        self._thread.start()

    @property
    def attached(self) -> bool:
        return self._engine is not None

    def counts(self) -> tuple[int, int]:
        """(running, waiting) now."""
        with self._cond:
            return len(self._running), len(self._waiting)

    def submit(self, job: BatchJob) -> None:
        """Queue a job (never blocks: the HTTP side bounded the queue); RequestError if the
        engine cannot serve it at all (checked here, before it waits)."""
        engine = self._engine
        if engine is None:
            raise RuntimeError("no engine attached yet")
        sequence = engine.open_sequence(job.prompt_ids, job.max_tokens, job.temperature)
        total = engine.kv_blocks().total
        if sequence.blocks_needed > total:
            block_tokens = engine.kv_blocks().block_tokens
            raise KVCacheTooSmall(
                f"the prompt and max_tokens need {sequence.blocks_needed * block_tokens} KV-cache positions, more "
                f"than this worker's whole cache holds ({total * block_tokens}, --kv-cache-bytes): ask for fewer")
        job.sequence = sequence
        with self._cond:
            self._waiting.append(job)
            self._cond.notify_all()
        self._report()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_JOIN_S)

    # ---- sleep ------------------------------------------------------------------------------
    def sleep_when_idle(self, do_sleep: Callable[[], None]) -> None:
        """Run `do_sleep` under the gate once nothing runs or waits; SleepRefused if the batch
        has not drained within the drain timeout."""
        timeout = self.settings.sleep_drain_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                while self._running or self._waiting:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise SleepRefused(
                            f"sleep refused: {len(self._running)} request(s) running and {len(self._waiting)} "
                            f"waiting after {timeout:g}s of waiting for the batch to drain (--sleep-drain-timeout)")
                    self._cond.wait(min(left, 1.0))
            with self.gate:  # admission happens under the gate: idle now means idle until we let go
                with self._cond:
                    idle = not self._running and not self._waiting
                if idle:
                    do_sleep()
                    return

    # ---- the batch's thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    break
            self._drop_cancelled()
            if self._asleep():
                with self._cond:
                    needs_wake = bool(self._waiting) and not self._running
                if needs_wake:
                    self._wake_for_waiting()
                    continue
            self._step_once()
        reason: BaseException = SchedulerStopped("the worker is stopping")
        if self.weights_check is not None:
            try:
                self.weights_check()
            except Exception as error:  # the weights changing is why it stops: say so
                reason = error
        self._end_everything(reason)

    def _asleep(self) -> bool:
        engine = self._engine
        return isinstance(engine, Sleepable) and engine.sleep_level is not None

    def _wake_for_waiting(self) -> None:
        try:
            if self.waker is not None:
                self.waker()
            else:
                with self.gate:
                    if isinstance(self._engine, Sleepable):
                        self._engine.wake()
        except Exception as error:  # the wake check failed (NaN/Inf) or the weights changed
            log.error("waking the engine for a waiting request failed: %s", error)
            with self._cond:
                waiting, self._waiting = list(self._waiting), deque()
            for job in waiting:
                self._end(job, error)

    def _step_once(self) -> None:
        engine = self._engine
        assert engine is not None
        outcomes: list[Any] = []
        try:
            with self.gate.step():
                if self._asleep():
                    return  # a sleep won the gate before this turn: the loop wakes it for the waiting
                self._admit(engine)
                running = list(self._running)
                if not running:
                    return
                if self.weights_check is not None:
                    self.weights_check()
                started = time.perf_counter()
                outcomes = list(engine.step([job.sequence for job in running]))
                steps = [outcome.step for outcome in outcomes if outcome.step is not None]
                self.observer.engine_step(time.perf_counter() - started, len(steps), len(running),
                                          sum(1 for step in steps if step.finished))
        except Exception as error:  # a failed step ends every request in it
            log.error("a batch step failed, ending its %d request(s): %s", len(self._running), error)
            with self._cond:
                running = list(self._running)
            for job in running:
                self._end(job, error)
            return
        self._deliver(outcomes)

    def _admit(self, engine: BatchingEngine) -> None:
        """Move jobs from the head of the queue into the batch while there is room."""
        admitted: list[BatchJob] = []
        with self._cond:
            while self._waiting and len(self._running) < self.settings.max_batch_size:
                job = self._waiting[0]
                if not job.sequence.lease.try_reserve(job.sequence.blocks_needed):
                    break  # first come, first served: no overtaking by a smaller request
                self._waiting.popleft()
                self._running.append(job)
                admitted.append(job)
        for job in admitted:
            self._callback(job, job.on_admitted)
        if admitted:
            self._report()

    def _deliver(self, outcomes: list[Any]) -> None:
        by_sequence = {id(job.sequence): job for job in self._running}
        for outcome in outcomes:
            job = by_sequence.get(id(outcome.sequence))
            if job is None:
                continue
            if outcome.error is not None:
                self._end(job, outcome.error)
            elif (outcome.step is not None and self._callback(job, job.on_step, outcome.step)
                  and outcome.step.finished):
                self._end(job, None)

    def _callback(self, job: BatchJob, callback: Callable[..., None], *args: object) -> bool:
        """Run one of the job's callbacks; when it fails, that job ends (with the error) and
        the batch goes on.  True when it ran."""
        try:
            callback(*args)
        except Exception as error:
            log.exception("a request's callback failed: ending that request alone")
            self._end(job, error)
            return False
        return True

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [job for job in (*self._running, *self._waiting) if job.cancel.is_set()]
        for job in gone:
            self._end(job, None)

    def _end(self, job: BatchJob, error: BaseException | None) -> None:
        """Take the job out of the batch or the queue, give back its KV blocks, tell its side."""
        with self._cond:
            if job in self._running:
                self._running.remove(job)
            elif job in self._waiting:
                self._waiting.remove(job)
            else:
                return  # ended already
            self._cond.notify_all()
        if self._engine is not None and job.sequence is not None:
            self._engine.close_sequence(job.sequence)
        try:
            job.on_end(error)
        except Exception:  # a callback's failure must not stop the batch
            log.exception("a request's end callback failed")
        self._report()

    def _end_everything(self, error: BaseException) -> None:
        with self._cond:
            jobs = [*self._running, *self._waiting]
        for job in jobs:
            self._end(job, error)

    def _report(self) -> None:
        running, waiting = self.counts()
        self.observer.set_batch(running, waiting)
