"""The piece of a trace that `warmpool bench predict --live` replays, and the history that precedes it.

A live replay cannot play an hour at full rate on a few CPU cores, so the trace is cut down the
same way for every policy, and the report says how:

* **window**: ``minutes`` of trace starting at ``start_min`` (trace minutes from its first request);
* **thinned**: every ``k``-th request of the trace (counted from its first request, so the history
  before the window is thinned the same way), ``k`` the smallest that leaves at most ``cap``
  requests in the window: the shape of the load is kept, its level divided by ``k``;
* **time-compressed**: trace time divided by ``compression`` (6x: a trace minute lasts 10 s, one
  operator step at ``--predict-step-seconds 10``);
* **capped**: prompts at ``max_prompt`` tokens and generation at ``max_generated`` (at least 1 each).

The steps before the window (:func:`seed_history`) are what the operator would have recorded had it
watched the trace from its start: one step per ``step_s`` of compressed time, its count and its peak
(the busiest :data:`~warmpool_operator.rules.forecast.history.PEAK_SUBSTEP_S` of compressed time, scaled to
the step, as the operator's :class:`~warmpool_operator.rules.forecast.steps.StepAccumulator` measures it), in the
operator's own format and limits (:func:`warmpool_operator.control.forecasting.limits_for`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from warmpool_operator.rules.forecast.history import PEAK_SUBSTEP_S, History, StepObservation, peak_of
from warmpool_operator.rules.forecast.lengths import histogram

from warmpool_bench.predict_trace import Trace, TraceError, TraceRequest


class SegmentError(ValueError):
    """A segment that cannot be replayed (outside the trace, no requests, bad bounds)."""


@dataclass(frozen=True)
class SegmentSpec:
    start_min: float = 12.0
    minutes: float = 12.0
    compression: float = 6.0
    max_prompt: int = 512
    max_generated: int = 16
    cap: int = 200  # requests replayed at most (per policy)

    def __post_init__(self) -> None:
        if self.start_min < 0 or self.minutes <= 0 or self.compression <= 0:
            raise SegmentError(f"need start >= 0, minutes > 0 and compression > 0, got {self}")
        if self.max_prompt < 1 or self.max_generated < 1 or self.cap < 1:
            raise SegmentError(f"need max_prompt, max_generated and the request cap >= 1, got {self}")


@dataclass(frozen=True)
class Segment:
    """Requests in compressed seconds from the window's start (prompt and generation capped)."""

    spec: SegmentSpec
    source: str
    thin: int  # every thin-th request of the trace is kept
    window_requests: int  # in the trace's window before thinning
    requests: tuple[TraceRequest, ...]
    before: tuple[TraceRequest, ...]  # thinned, compressed and capped, times negative (before the window)

    @property
    def duration_s(self) -> float:
        return self.spec.minutes * 60 / self.spec.compression


def cut(trace: Trace, spec: SegmentSpec) -> Segment:
    """The segment of ``trace``; :class:`SegmentError` when the window holds no request."""
    if not trace.requests:
        raise TraceError(f"{trace.source}: no requests")
    start, end = spec.start_min * 60, (spec.start_min + spec.minutes) * 60
    if start >= trace.duration_s:
        raise SegmentError(f"{trace.source}: the segment starts at minute {spec.start_min:g}, after the trace's "
                           f"last request (minute {trace.duration_s / 60:.1f})")
    window = [r for r in trace.requests if start <= r.t < end]
    if not window:
        raise SegmentError(f"{trace.source}: no requests in minutes {spec.start_min:g}-"
                           f"{spec.start_min + spec.minutes:g} of the trace: nothing to replay")
    thin = max(1, math.ceil(len(window) / spec.cap))

    def scaled(r: TraceRequest) -> TraceRequest:
        return TraceRequest((r.t - start) / spec.compression, max(1, min(r.prompt, spec.max_prompt)),
                            max(1, min(r.generated, spec.max_generated)))

    kept = [scaled(r) for i, r in enumerate(trace.requests) if i % thin == 0 and r.t < end]
    return Segment(spec=spec, source=trace.source, thin=thin, window_requests=len(window),
                   requests=tuple(r for r in kept if r.t >= 0), before=tuple(r for r in kept if r.t < 0))


def seed_history(segment: Segment, step_s: int, first_step: int) -> History:
    """The steps before the window as the operator records them, the last one at ``first_step - 1``
    (``first_step``: the step index, unix seconds // step_s, in which the replay starts)."""
    # Imported here: the operator's control layer brings kopf (a second), and every `warmpool bench`
    # command imports this module through the live bench's CLI.
    from warmpool_operator.control.forecasting import limits_for

    history = History(limits=limits_for(step_s))
    if not segment.before:
        return history
    count = math.ceil(-segment.before[0].t / step_s)
    subs = max(1, step_s // PEAK_SUBSTEP_S)
    sub_s = step_s / subs
    for back in range(count, 0, -1):
        lo, hi = -back * step_s, -(back - 1) * step_s
        seen = [r for r in segment.before if lo <= r.t < hi]
        buckets = [sum(1 for r in seen if lo + k * sub_s <= r.t < lo + (k + 1) * sub_s) for k in range(subs)]
        history.record(first_step - back, StepObservation(
            requests=len(seen), peak_requests=peak_of(buckets, step_s, sub_s),
            prompt_tokens=sum(r.prompt for r in seen), generated_tokens=sum(r.generated for r in seen),
            prompt_lengths=tuple(histogram(r.prompt for r in seen)),
            generated_lengths=tuple(histogram(r.generated for r in seen))))
    return history


def per_bin(times: list[float], bin_s: float, duration_s: float) -> list[int]:
    """Arrivals per ``bin_s`` over ``[0, duration_s)`` (the chart's request rate)."""
    bins = [0] * max(1, math.ceil(duration_s / bin_s))
    for t in times:
        if 0 <= t < duration_s:
            bins[int(t // bin_s)] += 1
    return bins

