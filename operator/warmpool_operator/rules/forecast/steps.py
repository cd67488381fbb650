"""A pool's request history step by step, from the counters its workers export (pure: no I/O, no clock).

Each scrape gives, per pod, cumulative counters: ``warmpool_requests_total`` (completions
received), the prompt-token histogram of served requests (cumulative counts per graph-friendly
length, :data:`~warmpool.contract.TOKEN_LENGTH_EDGES`) and the engine's busy seconds.  The
:class:`StepAccumulator` turns them into one :class:`~warmpool_operator.rules.forecast.history.StepObservation` per
history step, summed over the pool:

* **Deltas**, never totals: a pod's first sample is only its baseline (its total holds requests
  from before we watched it: an operator restart must not read as a burst).
* **Counter resets**: a counter lower than the pod's last one restarted (the worker process
  restarted): the new value is what it counted since, so it is the delta.
* **Garbage** (a delta above :data:`MAX_REQUESTS_PER_POD_SECOND`, histogram bounds that are not
  the contract's, cumulative counts that fall): that pod's figure is dropped for the step and
  re-baselined, and the step says why.
* **Missing**: a step in which no pod gave a usable request delta is held as *missing* (None),
  never as zero; so is the step the accumulator started in (it saw only part of it).
* **At zero**: a scale-to-zero pool with no pod for a whole step, every pass of it at zero, had
  no request served: that step is a zero, not missing (a request sent then is held by the
  activator and counted by the pod started for it, in the step it is served).  Held as missing,
  a pool at zero would lose its forecast after a few steps, and with it the forecast's raise
  from zero ahead of a burst.

A sample is attributed to the step in which it is handed over.  :class:`CapacityMeter` keeps the
served requests and busy seconds of the recent steps, in all and by the batch size the engine ran
at (the worker's capacity-curve counters): finished ÷ busy seconds at one batch size is what one
pod serves per busy second at that size, and the best point measured is the per-pod capacity the
decision divides by.  A worker that exports no curve (an external engine) is measured in all:
served ÷ busy.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise

from warmpool.contract.files import TOKEN_LENGTH_EDGES
from warmpool_operator.model import Sample
from warmpool_operator.rules.forecast.history import PEAK_SUBSTEP_S, StepObservation, peak_of
from warmpool_operator.rules.forecast.lengths import BIN_COUNT

#: No engine serves this many completions per second per pod: a delta above it is garbage.
MAX_REQUESTS_PER_POD_SECOND = 100_000.0
#: The least work behind a capacity figure (all steps', or one batch size's): busy seconds, requests.
MIN_BUSY_SECONDS = 0.5
MIN_SERVED = 5.0
#: The prompt histogram's bounds a worker exports (the contract's edges, then +Inf).
PROMPT_BOUNDS: tuple[float, ...] = (*(float(e) for e in TOKEN_LENGTH_EDGES), math.inf)


@dataclass(frozen=True)
class PodCounters:
    """What one sample of one pod says, cumulatively (None: the worker does not export it)."""

    requests: float | None
    served: float | None  # the prompt histogram's count: requests served
    busy_seconds: float | None
    prompt_bins: tuple[float, ...] | None  # per-bin (not cumulative) counts, None when unusable
    #: the capacity curve's counters: batch-size bucket -> (finished, busy seconds)
    batch: Mapping[int, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, sample: Sample) -> PodCounters:
        return cls(sample.requests_total, sample.prompt_count, sample.busy_seconds,
                   prompt_bins(sample.prompt_buckets), batch_counters(sample))


def batch_counters(sample: Sample) -> dict[int, tuple[float, float]]:
    """The capacity curve's cumulative counters of one sample: bucket -> (finished, busy seconds)."""
    return {edge: (sample.batch_finished.get(edge, 0.0), seconds) for edge, seconds in sample.batch_seconds.items()}


def prompt_bins(buckets: Mapping[float, float]) -> tuple[float, ...] | None:
    """Per-bin counts from a cumulative histogram, or None when its bounds are not the contract's
    or its counts fall (garbage)."""
    if not buckets or tuple(sorted(buckets)) != PROMPT_BOUNDS:
        return None
    cumulative = [buckets[b] for b in PROMPT_BOUNDS]
    if any(later < earlier for earlier, later in pairwise(cumulative)):
        return None
    return tuple(c - p for c, p in zip(cumulative, [0.0, *cumulative[:-1]], strict=True))


def counter_delta(previous: float | None, current: float | None) -> float | None:
    """How much a cumulative counter moved; a lower value is a reset (counted from zero)."""
    if previous is None or current is None:
        return None
    return current - previous if current >= previous else current


def batch_deltas(previous: Mapping[int, tuple[float, float]],
                 current: Mapping[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """How far each batch-size bucket's (finished, seconds) moved; a bucket new since the previous
    sample counted from zero (a labelled counter appears when first incremented), a lower value is
    a reset (counted from zero)."""
    moved: dict[int, tuple[float, float]] = {}
    for edge, (finished, seconds) in current.items():
        was_finished, was_seconds = previous.get(edge, (0.0, 0.0))
        delta = (counter_delta(was_finished, finished) or 0.0, counter_delta(was_seconds, seconds) or 0.0)
        if delta != (0.0, 0.0):
            moved[edge] = delta
    return moved


@dataclass(frozen=True)
class ClosedStep:
    step: int
    observation: StepObservation | None  # None: missing (no usable request figure)
    served: float  # requests served (prompt histogram counts) during the step
    busy_seconds: float
    #: what was wrong with the pool's request metrics in the step (None: nothing; the partial first
    #: step is missing with no problem)
    problem: str | None
    #: the capacity curve's points in the step: batch-size bucket -> (finished, busy seconds)
    batch: Mapping[int, tuple[float, float]] = field(default_factory=dict)


@dataclass
class _Open:
    step: int
    requests: float = 0.0
    counted_pods: int = 0
    prompt: list[float] = field(default_factory=lambda: [0.0] * BIN_COUNT)
    prompt_known: bool = False
    served: float = 0.0
    busy: float = 0.0
    batch: dict[int, tuple[float, float]] = field(default_factory=dict)  # bucket -> (finished, seconds)
    problems: dict[str, str] = field(default_factory=dict)  # pod name -> what was wrong
    #: (when, requests, seconds since that pod's previous sample) per counted delta: the step's peak
    deltas: list[tuple[float, float, float]] = field(default_factory=list)
    #: every pass of the step saw the pool at zero with no pod (see the module docstring)
    at_zero: bool = True


#: How far back :meth:`StepAccumulator.arrivals_within` can look (the fast loop reads 10 s).
RECENT_S = 60.0


@dataclass
class StepAccumulator:
    step_s: int
    last: dict[str, PodCounters] = field(default_factory=dict)
    last_at: dict[str, float] = field(default_factory=dict)
    seen: dict[str, Sample] = field(default_factory=dict)
    started_step: int | None = None
    current: _Open | None = None
    #: (when, requests) of every counted delta of the last RECENT_S seconds, whatever the step
    recent: deque[tuple[float, float]] = field(default_factory=deque)

    def arrivals_within(self, window_s: float, now: float) -> float:
        """Requests the pool's counters moved by in the last ``window_s`` seconds (at most RECENT_S)."""
        return sum(requests for when, requests in self.recent if when > now - window_s)

    def observe(self, samples: Mapping[str, tuple[str, Sample | None]], now: float,
                at_zero: bool = False) -> list[ClosedStep]:
        """Feed this pass's samples (uid -> (pod name, latest sample)); the steps that closed.
        ``at_zero``: the pass saw a scale-to-zero pool at zero."""
        step = int(now // self.step_s)
        closed: list[ClosedStep] = []
        if self.current is None:
            self.started_step, self.current = step, _Open(step)
        elif step > self.current.step:
            closed.append(self._close(self.current))
            self.current = _Open(step)
        if samples or not at_zero:
            self.current.at_zero = False
        for uid in set(self.last) - set(samples):  # pods gone: forget their baselines
            self.last.pop(uid, None)
            self.last_at.pop(uid, None)
            self.seen.pop(uid, None)
        for uid, (name, sample) in samples.items():
            if sample is None:  # never scraped (not Running yet, or its IP outside --scrape-network)
                self.current.problems[name] = "no metrics read from it"
                continue
            if self.seen.get(uid) is sample:
                continue  # nothing new from this pod since the last pass
            self.seen[uid] = sample
            self._add(uid, name, sample, now)
        return closed

    def _add(self, uid: str, name: str, sample: Sample, now: float) -> None:
        step = self.current
        assert step is not None
        if not sample.ok:
            step.problems[name] = f"metrics unreadable ({sample.error})"
            return
        counters = PodCounters.of(sample)
        if counters.requests is None:
            step.problems[name] = "no warmpool_requests_total"
            return
        previous, previous_at = self.last.get(uid), self.last_at.get(uid, now)
        self.last[uid], self.last_at[uid] = counters, now
        if previous is None:
            return  # a baseline: its total is from before we watched it
        requests = counter_delta(previous.requests, counters.requests)
        assert requests is not None
        if requests > MAX_REQUESTS_PER_POD_SECOND * max(1.0, now - previous_at):
            step.problems[name] = f"warmpool_requests_total jumped by {requests:g}: garbage"
            return
        step.requests += requests
        step.counted_pods += 1
        step.deltas.append((now, requests, now - previous_at))
        self.recent.append((now, requests))
        while self.recent and self.recent[0][0] <= now - RECENT_S:
            self.recent.popleft()
        served = counter_delta(previous.served, counters.served)
        busy = counter_delta(previous.busy_seconds, counters.busy_seconds)
        if served is not None and busy is not None:
            step.served += served
            step.busy += busy
        for edge, (finished, seconds) in batch_deltas(previous.batch, counters.batch).items():
            had_finished, had_seconds = step.batch.get(edge, (0.0, 0.0))
            step.batch[edge] = (had_finished + finished, had_seconds + seconds)
        if previous.prompt_bins is not None and counters.prompt_bins is not None:
            bins = [c - p for c, p in zip(counters.prompt_bins, previous.prompt_bins, strict=True)]
            if any(b < 0 for b in bins):  # a reset: the histogram counted from zero since
                bins = list(counters.prompt_bins)
            for index, count in enumerate(bins):
                step.prompt[index] += count
            step.prompt_known = True

    def _close(self, step: _Open) -> ClosedStep:
        problems = "; ".join(f"{name}: {why}" for name, why in sorted(step.problems.items())) or None
        if step.step == self.started_step:  # missing, but no fault of the metrics: problem None
            return ClosedStep(step.step, None, step.served, step.busy, None, step.batch)
        if step.counted_pods == 0 and step.at_zero:
            return ClosedStep(step.step, StepObservation(requests=0, peak_requests=0), 0.0, 0.0, None)
        if step.counted_pods == 0:
            return ClosedStep(step.step, None, step.served, step.busy,
                              problems or "no pod's request counter was read twice in the step", step.batch)
        observation = StepObservation(
            requests=round(step.requests),
            prompt_lengths=tuple(round(c) for c in step.prompt) if step.prompt_known else (),
            peak_requests=self._peak(step),
        )
        return ClosedStep(step.step, observation, step.served, step.busy, problems, step.batch)

    def _peak(self, step: _Open) -> int:
        """The step's busiest sub-step, scaled to the step (the figure the forecaster forecasts).

        A sub-step is PEAK_SUBSTEP_S, or the longest span a pod's non-zero delta covers when
        scrapes come less often (a 30 s delta in a 10 s bucket would triple the peak), at most the
        step.  A delta is counted in the sub-step its sample arrived in.
        """
        span = max([PEAK_SUBSTEP_S, *(covered for _, requests, covered in step.deltas if requests > 0)])
        sub_step_s = min(float(self.step_s), span)
        start = step.step * self.step_s
        buckets = [0.0] * max(1, math.ceil(self.step_s / sub_step_s))
        for when, requests, _ in step.deltas:
            index = min(len(buckets) - 1, max(0, int((when - start) // sub_step_s)))
            buckets[index] += requests
        return peak_of([round(b) for b in buckets], self.step_s, sub_step_s)


@dataclass
class CapacityMeter:
    """Per-pod capacity (requests per second while busy) over the recent steps that served any.

    With the workers' capacity curve, the best point measured with enough work behind it (the
    throughput a pod was seen to sustain at some batch size); without one (or before any point has
    enough work), served ÷ busy over all the window's steps.  A pool that never filled its pods'
    batches only knows the points it ran at: it sizes on them, never on a guess above them.
    """

    window: int = 30
    min_busy_seconds: float = MIN_BUSY_SECONDS
    min_served: float = MIN_SERVED
    steps: deque[tuple[float, float, Mapping[int, tuple[float, float]]]] = field(default_factory=deque)

    def add(self, served: float, busy_seconds: float,
            batch: Mapping[int, tuple[float, float]] | None = None) -> None:
        """One step's figures; an idle step (nothing served) is no news and leaves the window as it is."""
        if served <= 0 or busy_seconds <= 0:
            return
        self.steps.append((served, busy_seconds, dict(batch or {})))
        while len(self.steps) > self.window:
            self.steps.popleft()

    def curve(self) -> dict[int, float]:
        """Batch-size bucket -> requests per busy second there, for the points with enough work seen."""
        return capacity_curve((batch for _, _, batch in self.steps), self.min_busy_seconds, self.min_served)

    def capacity_rps(self) -> float | None:
        """The curve's best point, else served ÷ busy over the window, once enough work was seen to
        mean something; else None."""
        curve = self.curve()
        if curve:
            return max(curve.values())
        served = sum(s for s, _, _ in self.steps)
        busy = sum(b for _, b, _ in self.steps)
        if busy < self.min_busy_seconds or served < self.min_served:
            return None
        return served / busy


def capacity_curve(points: Iterable[Mapping[int, tuple[float, float]]], min_busy_seconds: float = MIN_BUSY_SECONDS,
                   min_served: float = MIN_SERVED) -> dict[int, float]:
    """Batch-size bucket -> requests finished per busy second at that size, summed over ``points``
    (each bucket -> (finished, busy seconds)); only buckets with at least ``min_busy_seconds`` and
    ``min_served`` behind them (a few requests in a fraction of a second say nothing yet)."""
    finished: dict[int, float] = {}
    seconds: dict[int, float] = {}
    for point in points:
        for edge, (done, busy) in point.items():
            finished[edge] = finished.get(edge, 0.0) + done
            seconds[edge] = seconds.get(edge, 0.0) + busy
    return {edge: finished[edge] / seconds[edge] for edge in sorted(seconds)
            if seconds[edge] >= min_busy_seconds and finished[edge] >= min_served}
