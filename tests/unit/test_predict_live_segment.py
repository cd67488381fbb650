"""The live replay's segment: thinned, compressed and capped the same way before and inside the window, and
a seed history the operator's store loads with its own limits."""

from __future__ import annotations

import pytest
from warmpool_bench.predict_live_segment import SegmentError, SegmentSpec, cut, per_bin, seed_history
from warmpool_bench.predict_trace import Trace, TraceRequest
from warmpool_operator.control.forecasting import limits_for
from warmpool_operator.rules.forecast.history import dumps, loads_or_empty

pytestmark = pytest.mark.unit


def _trace() -> Trace:
    """Four minutes: one request a second in minutes 0-1, none in minute 2, four a second in minute 3."""
    requests = [TraceRequest(float(t), 100 + t, 3 + t % 40) for t in range(120)]
    requests += [TraceRequest(180 + k / 4, 2000, 50) for k in range(240)]
    return Trace("synthetic", 1_700_000_000.0, tuple(requests))


def test_the_window_is_thinned_compressed_and_capped() -> None:
    segment = cut(_trace(), SegmentSpec(start_min=2, minutes=2, compression=6, max_prompt=512, max_generated=16,
                                        cap=60))
    assert segment.window_requests == 240 and segment.thin == 4  # ⌈240 ÷ 60⌉
    assert len(segment.requests) == 60 and segment.duration_s == 20.0
    assert all(10.0 <= r.t < 20.0 for r in segment.requests)  # minute 3 -> seconds 10-20 of the replay
    assert {(r.prompt, r.generated) for r in segment.requests} == {(512, 16)}
    assert len(segment.before) == 30 and all(-20.0 <= r.t < 0.0 for r in segment.before)  # every 4th of 120
    assert per_bin([r.t for r in segment.requests], 10, segment.duration_s) == [0, 60]


def test_the_seed_is_the_operator_s_history_ending_before_the_replay() -> None:
    segment = cut(_trace(), SegmentSpec(start_min=2, minutes=2, cap=60))
    history = seed_history(segment, 10, first_step=5000)
    assert (history.start, history.end) == (4998, 5000)  # trace minutes 0 and 1, one 10 s step each
    assert history.requests == [15, 15] and history.peak_requests == [15, 15]
    loaded, why = loads_or_empty(dumps(history), limits_for(10))
    assert why is None and loaded.requests == history.requests


def test_a_segment_without_requests_or_past_the_end_is_refused() -> None:
    with pytest.raises(SegmentError, match="no requests in minutes 2-3 of the trace"):
        cut(_trace(), SegmentSpec(start_min=2, minutes=1))
    with pytest.raises(SegmentError, match="after the trace's last request"):
        cut(_trace(), SegmentSpec(start_min=10))
    with pytest.raises(SegmentError):
        SegmentSpec(compression=0)
