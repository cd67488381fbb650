"""A step's peak (its busiest sub-step's rate, scaled to the step) beside its count: computed from the
sub-steps, held through gaps and the retention, stand-in by the count where unknown, round-tripped, and
a document written before peaks existed still loads (backward compatible within format version 1)."""

from __future__ import annotations

import base64
import json
import zlib

import pytest
from warmpool_operator.rules.forecast.history import (
    FORMAT_NAME,
    MISSING,
    PREFIX,
    History,
    HistoryFormatError,
    HistoryLimits,
    StepObservation,
    dumps,
    loads,
    peak_of,
)
from warmpool_operator.rules.forecast.lengths import LENGTH_EDGES

pytestmark = pytest.mark.unit

STEP0 = 29_000_000


def test_peak_is_the_busiest_sub_step_scaled_to_the_step() -> None:
    # 60 s step, 10 s sub-steps: 30 requests in one sub-step is the rate of 180 per step.
    assert peak_of([0, 30, 0, 0, 0, 0], 60, 10) == 180
    assert peak_of([5] * 6, 60, 10) == 30  # even load: the peak is the count
    assert peak_of([], 60, 10) == 0
    assert peak_of([7], 60, 15) == 28 and peak_of([1], 60, 7) == 9  # rounded up
    with pytest.raises(ValueError, match="sub-step"):
        peak_of([1], 60, 120)
    with pytest.raises(ValueError, match=">= 0"):
        peak_of([-1], 60, 10)
    with pytest.raises(ValueError, match="peak_requests"):
        StepObservation(requests=1, peak_requests=-1)


def test_peak_rates_use_the_peak_and_the_count_where_the_peak_is_unknown() -> None:
    history = History()
    history.record(STEP0, StepObservation(requests=30, peak_requests=180))
    history.record(STEP0 + 1, StepObservation(requests=12))  # no peak measured: the count stands in
    history.record(STEP0 + 2, None)  # missing step: missing peak
    history.record(STEP0 + 4, StepObservation(requests=10, peak_requests=6))  # below the count: not believed
    assert history.rates() == [30.0, 12.0, None, None, 10.0]
    assert history.peak_rates() == [180.0, 12.0, None, None, 10.0]
    assert history.peak_requests == [180, MISSING, MISSING, MISSING, 6]


def test_peaks_follow_the_retention_with_the_counts() -> None:
    history = History(limits=HistoryLimits(retention_s=5 * 60))
    for k in range(8):
        history.record(STEP0 + k, StepObservation(requests=k, peak_requests=10 * k))
    assert history.start == STEP0 + 3 and history.requests == [3, 4, 5, 6, 7]
    assert history.peak_requests == [30, 40, 50, 60, 70]
    history.record(STEP0 + 100, StepObservation(requests=1))  # a gap longer than the retention clears all
    assert history.requests == [1] and history.peak_requests == [MISSING]


def test_history_built_without_peaks_has_them_unknown_and_too_many_are_refused() -> None:
    history = History(start=STEP0, requests=[1, 2], prompt_tokens=[0, 0], generated_tokens=[0, 0])
    assert history.peak_requests == [MISSING, MISSING] and history.peak_rates() == history.rates()
    history.record(STEP0 + 2, StepObservation(requests=3, peak_requests=9))
    assert history.peak_requests == [MISSING, MISSING, 9]
    with pytest.raises(ValueError, match="peak_requests holds 2 steps"):
        History(start=STEP0, requests=[], prompt_tokens=[], generated_tokens=[], peak_requests=[1, 2])


def test_round_trip_keeps_the_peaks_and_omits_them_when_none_are_known() -> None:
    history = History()
    history.record(STEP0, StepObservation(requests=3, peak_requests=12))
    history.record(STEP0 + 2, StepObservation(requests=4))
    back = loads(dumps(history))
    assert back.peak_requests == [12, MISSING, MISSING] and back.peak_rates() == [12.0, None, 4.0]
    plain = History()
    plain.record(STEP0, StepObservation(requests=3))
    raw = json.loads(zlib.decompress(base64.b64decode(dumps(plain)[len(PREFIX):])))
    assert "peak_requests" not in raw  # what an operator without peaks wrote, byte for byte


def _encode(document: dict[str, object]) -> str:
    return PREFIX + base64.b64encode(zlib.compress(json.dumps(document).encode())).decode()


def _old_document() -> dict[str, object]:
    """A history exactly as the format was before peaks (no peak field)."""
    return {"format": FORMAT_NAME, "version": 1, "step_s": 60, "retention_s": 7 * 86400, "slot_s": 3600,
            "edges": list(LENGTH_EDGES), "start": STEP0, "requests": [5, -1, 7], "prompt_tokens": [50, -1, 70],
            "generated_tokens": [5, -1, 7], "prompt_hist": {}, "generated_hist": {}}


def test_a_document_written_before_peaks_loads_with_peaks_unknown() -> None:
    history = loads(_encode(_old_document()))
    assert history.rates() == [5.0, None, 7.0]
    assert history.peak_requests == [MISSING] * 3 and history.peak_rates() == history.rates()


@pytest.mark.parametrize(("peaks", "message"), [
    ([1, 2], "'peak_requests' holds 2 steps, 'requests' 3"),
    ([1, "x", 3], r"'peak_requests'\[1\] = 'x' is not a count"),
    ("many", "'peak_requests' must be a list"),
])
def test_a_garbage_peak_field_is_refused_naming_it(peaks: object, message: str) -> None:
    with pytest.raises(HistoryFormatError, match=message):
        loads(_encode({**_old_document(), "peak_requests": peaks}))
