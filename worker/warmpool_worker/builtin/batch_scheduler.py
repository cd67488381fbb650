"""Continuous batching on the built-in engine: one thread runs the batch, step after step.

Requests (`BatchJob`) are submitted from the HTTP side and wait until the batch takes them;
the bounded queue in front (``--max-queued-requests``, 429 past it) is the HTTP side's.  Each
step is planned against a token budget (`BatchSettings.step_tokens`, Sarathi-Serve's
stall-free batching), in this order:

1. every running decode (one token each): a decode is never stalled by a prefill;
2. the prefills already under way, one chunk each (`engine.batch`), oldest first;
3. new requests from the queue, while the budget, ``--max-batch-size`` and the KV blocks
   allow: shortest prompt first, with aging (a request's prompt counts
   ``aging_tokens_per_s`` tokens shorter per second it has waited, so a long prompt overtakes
   new short ones after a bounded wait and none starves), and a per-client share (a client
   past ``max_batch_size / clients with work`` running requests goes after the others'
   requests: one client cannot hold every slot while another waits).  The first chunk of a
   step always goes, so a prefill advances every step;
4. what is left of the budget: more chunks of the prefills in the step, the earliest admitted
   first, so the first prompt in finishes first instead of every prompt advancing one chunk a
   step together (chunks are cut where single steps would cut them: `engine.batch`).

KV blocks (``--kv-cache-bytes``) are taken as tokens come, never reserved for max_tokens up
front: before each step the scheduler reserves the blocks that step needs (a new request's
prompt, a block now and then as a generation grows).  When the pool cannot give them, it
preempts the running request with the lowest priority (a client past its share first, then
the most recently admitted): its KV is dropped and it goes back to the queue (first in line,
its age kept; it comes back once the pool has its blocks and one more per running request,
so it is not preempted again at once); when it runs again its prompt and the tokens it
already generated are prefilled anew (recompute), so its output is the one it would have had.  A request whose
prompt and max_tokens need more than the whole cache is refused up front (it could never
finish alone).

A request joins or leaves at the boundary between two steps:

* it ends when its last token is out, when its client went away (the cancel flag is read
  before every step, so a hang-up costs at most the step under way), or when the engine
  fails it: a failure of its own row (non-finite logits, a draw that could not be sampled,
  its cache not allocated) or of its own callbacks ends it alone, and its batch-mates go on;
  only a failure of the shared step itself (the forward pass, e.g. weights that changed
  under the mapping) ends every request of that step;
* its KV blocks are given back the moment it ends (or is preempted).

Sleep and generation never overlap: both are decided under the engine gate (`engine_gate`),
admission included.  `sleep_when_idle` waits (bounded) for the batch to drain and nothing
to wait, then sleeps under the gate, or is refused (`SleepRefused`) saying what was still
running.  A request that finds the engine asleep when it reaches the head of the queue wakes
it first (through `waker`, counted as a wake on request).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from warmpool_worker.builtin.engine_gate import EngineGate
from warmpool_worker.defaults import DEFAULT_STEP_TOKENS
from warmpool_worker.engine_api import BatchingEngine, GenerationStep, RequestError, Sleepable

log = logging.getLogger(__name__)

#: Seconds `stop` waits for the step under way to finish.
STOP_JOIN_S = 30.0
#: Aging: a waiting request's prompt counts this many tokens shorter per second it has waited.
#: A prompt of L tokens overtakes any newly arrived one after at most L / rate seconds.
DEFAULT_AGING_TOKENS_PER_S = 256.0


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
    step_tokens: int = DEFAULT_STEP_TOKENS
    aging_tokens_per_s: float = DEFAULT_AGING_TOKENS_PER_S

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {self.step_tokens}")
        if self.aging_tokens_per_s < 0:
            raise ValueError(f"aging_tokens_per_s must be >= 0, got {self.aging_tokens_per_s}")


@dataclass(eq=False)
class BatchJob:
    """One request's generation, as the HTTP side hands it over.  The callbacks run on the
    scheduler's thread: `on_admitted` once it first joins the batch, `on_step` per token,
    `on_end` exactly once (None when it finished or was cancelled, else the error that ended
    it).  `client` names who sent it, for the per-client share (the HTTP side's choice)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    cancel: threading.Event
    on_admitted: Callable[[], None]
    on_step: Callable[[GenerationStep], None]
    on_end: Callable[[BaseException | None], None]
    sequence: Any = field(default=None, repr=False)
    client: str = ""
    #: monotonic seconds it was submitted (aging counts from here, preemptions keep it)
    arrived: float = field(default=0.0, repr=False)
    #: the order it (last) joined the batch in: the most recent is preempted first
    joined: int = field(default=0, repr=False)
    started: bool = field(default=False, repr=False)
    preempted: int = field(default=0, repr=False)


class BatchObserver(Protocol):
    """What the scheduler reports (the worker's metrics implement it)."""

    def set_batch(self, running: int, waiting: int) -> None: ...

    def engine_step(self, seconds: float, tokens: int, batch: int, finished: int) -> None: ...

    def batch_admitted(self, waited_s: float, overtook: bool) -> None: ...

    def batch_preempted(self) -> None: ...


class _Unobserved:
    def set_batch(self, running: int, waiting: int) -> None:
        pass

    def engine_step(self, seconds: float, tokens: int, batch: int, finished: int) -> None:
        pass

    def batch_admitted(self, waited_s: float, overtook: bool) -> None:
        pass

    def batch_preempted(self) -> None:
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
        self._waiting: list[BatchJob] = []  # in arrival order; the plan picks by priority
        self._running: list[BatchJob] = []  # in the order they joined
        self._joins = itertools.count(1)
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
        sequence.lease.bounded = True  # its blocks come from the scheduler's reservations
        job.arrived = time.monotonic()
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
                waiting, self._waiting = list(self._waiting), []
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
                running = self._plan(engine)
                if not running:
                    return
                if self.weights_check is not None:
                    self.weights_check()
                started = time.perf_counter()
                outcomes = list(engine.step([job.sequence for job in running]))
                steps = [outcome.step for outcome in outcomes if outcome.step is not None]
                self.observer.engine_step(time.perf_counter() - started, len(steps), len({id(j) for j in running}),
                                          sum(1 for step in steps if step.finished))
        except Exception as error:  # a failed step ends every request in it
            log.error("a batch step failed, ending its %d request(s): %s", len(self._running), error)
            with self._cond:
                running = list(self._running)
            for job in running:
                self._end(job, error)
            return
        self._deliver(outcomes)

    # ---- planning one step (module docstring) ------------------------------------------------
    def _plan(self, engine: BatchingEngine) -> list[BatchJob]:
        """The jobs this step runs, their KV blocks reserved (module docstring)."""
        budget = self.settings.step_tokens
        with self._cond:
            running = list(self._running)
        decodes = [job for job in running if not job.sequence.prefilling]
        chosen = list(decodes)
        used = len(decodes)
        prefilled = False
        for job in running:
            if job.sequence.prefilling:
                tokens = engine.next_tokens(job.sequence)
                if prefilled and used + tokens > budget:
                    continue  # its next chunk waits for a step with room
                chosen.append(job)
                used += tokens
                prefilled = True
        chosen = self._reserve_or_preempt(engine, chosen)
        admitted = self._admit(engine, budget - used, prefilled)
        return chosen + admitted + more_chunks(engine, chosen, admitted, budget - used)

    def _reserve_or_preempt(self, engine: BatchingEngine, chosen: list[BatchJob]) -> list[BatchJob]:
        """Reserve the chosen jobs' blocks, preempting while the pool lacks them (one job alone fits)."""
        while sum(engine.blocks_wanted(job.sequence) for job in chosen) > engine.kv_blocks().free:
            with self._cond:
                if len(self._running) < 2:
                    break
                counts = client_counts(self._running, self._waiting)
                share = fair_share(self.settings.max_batch_size, len(counts))
                # preempted first: a client past its share, then the most recently joined
                victim = max(self._running, key=lambda job: (counts[job.client] > share, job.joined))
            self._preempt(engine, victim)
            chosen = [job for job in chosen if job is not victim]
        for job in chosen:
            job.sequence.lease.try_reserve(engine.blocks_wanted(job.sequence))
        return chosen

    def _preempt(self, engine: BatchingEngine, job: BatchJob) -> None:
        engine.preempt_sequence(job.sequence)
        job.preempted += 1
        with self._cond:
            self._running.remove(job)
            self._waiting.insert(0, job)
        log.info("KV cache full: preempted a request (%d before), recomputed when it runs again", job.preempted - 1)
        self.observer.batch_preempted()
        self._report()

    def _admit(self, engine: BatchingEngine, budget_left: int, prefilled: bool) -> list[BatchJob]:
        """Move waiting jobs into the batch, best priority first, while the step's token budget,
        the batch's size and the KV pool allow; the jobs admitted."""
        admitted: list[BatchJob] = []
        with self._cond:
            if not self._waiting:
                return admitted
            now = time.monotonic()
            counts = client_counts(self._running, self._waiting)
            share = fair_share(self.settings.max_batch_size, len(counts))
            aging = self.settings.aging_tokens_per_s
            ranked = sorted(self._waiting, key=lambda job: waiting_rank(job, now, counts, share, aging))
            for job in ranked:
                if len(self._running) >= self.settings.max_batch_size:
                    break
                others_waiting = any(other.client != job.client for other in self._waiting)
                if counts.get(job.client, 0) >= share and others_waiting:
                    continue  # past its client's share while another client waits
                tokens = engine.next_tokens(job.sequence)
                if prefilled and tokens > budget_left:
                    continue  # a shorter one may still fit this step
                wanted = engine.blocks_wanted(job.sequence)
                if job.preempted and engine.kv_blocks().free < wanted + len(self._running):
                    break  # back only with a block of room per running job, or it would thrash
                if not job.sequence.lease.try_reserve(wanted):
                    break  # the blocks go to the best-ranked first: lower ones do not take them meanwhile
                budget_left -= tokens
                prefilled = True
                counts[job.client] = counts.get(job.client, 0) + 1
                job.joined = next(self._joins)
                self._waiting.remove(job)
                self._running.append(job)
                admitted.append(job)
            earliest = min((job.arrived for job in self._waiting), default=None)
        for job in admitted:
            self.observer.batch_admitted(now - job.arrived, earliest is not None and earliest < job.arrived)
            if not job.started:
                job.started = True
                self._callback(job, job.on_admitted)
        if admitted:
            self._report()
        return admitted

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


def more_chunks(engine: BatchingEngine, chosen: list[BatchJob], admitted: list[BatchJob],
                budget_left: int) -> list[BatchJob]:
    """Each prefilling job once more per further chunk the budget holds once the ``admitted`` jobs'
    first chunks are in, the first jobs first (module docstring, 4): the engine advances a job
    given k times by k chunks."""
    budget_left -= sum(engine.next_tokens(job.sequence) for job in admitted)
    extra: list[BatchJob] = []
    for job in chosen + admitted:
        if not job.sequence.prefilling:
            continue
        after = 1
        while budget_left > 0:
            tokens = engine.next_tokens(job.sequence, after)
            if tokens == 0 or tokens > budget_left:
                break
            extra.append(job)
            budget_left -= tokens
            after += 1
    return extra


def client_counts(running: list[BatchJob], waiting: list[BatchJob]) -> dict[str, int]:
    """Running jobs per client with work (running or waiting)."""
    counts: dict[str, int] = dict.fromkeys((job.client for job in waiting), 0)
    for job in running:
        counts[job.client] = counts.get(job.client, 0) + 1
    return counts


def fair_share(max_batch_size: int, clients: int) -> int:
    """Running slots each client with work may hold while another client waits."""
    return max(1, max_batch_size // max(1, clients))


def waiting_rank(job: BatchJob, now: float, counts: dict[str, int], share: int,
                 aging_tokens_per_s: float) -> tuple[bool, bool, float]:
    """Sort key of a waiting job: a client within its share first, a preempted job first,
    then the shortest prompt, aged (module docstring)."""
    aged = _prefill_tokens(job) - aging_tokens_per_s * (now - job.arrived)
    return counts.get(job.client, 0) >= share, job.preempted == 0, aged


def _prefill_tokens(job: BatchJob) -> int:
    """Tokens its prefill still has to feed (its prompt, or all it knows once preempted)."""
    sequence = job.sequence
    known = getattr(sequence, "known", None)
    return int(known) if known is not None else len(job.prompt_ids)
