"""Request history: bounded 60 s steps, missing is not zero, a round trip through the ConfigMap form,
and refusal of every kind of garbage with an error that names it (never a crash of the caller)."""

from __future__ import annotations

import base64
import json
import random
import re
import zlib
from typing import Any

import pytest
from warmpool_operator.rules.forecast.history import (
    MISSING,
    PREFIX,
    History,
    HistoryFormatError,
    HistoryLimits,
    StepObservation,
    dumps,
    loads,
    loads_or_empty,
)
from warmpool_operator.rules.forecast.lengths import BIN_COUNT, LENGTH_EDGES, bin_index, histogram, round_up

pytestmark = pytest.mark.unit

STEP0 = 29_000_000  # a step index in 2025 at 60 s


def _observation(requests: int, lengths: list[int] | None = None) -> StepObservation:
    lengths = lengths if lengths is not None else [100] * requests
    return StepObservation(requests=requests, prompt_tokens=sum(lengths), generated_tokens=requests * 10,
                           prompt_lengths=tuple(histogram(lengths)),
                           generated_lengths=tuple(histogram([10] * requests)))


def test_length_bins_are_graph_friendly_sizes() -> None:
    assert LENGTH_EDGES[:8] == (16, 24, 32, 48, 64, 96, 128, 192)
    assert LENGTH_EDGES[-1] == 131072 and len(LENGTH_EDGES) + 1 == BIN_COUNT
    assert bin_index(0) == 0 and bin_index(16) == 0 and bin_index(17) == 1
    assert bin_index(10**9) == BIN_COUNT - 1  # overflow bin
    assert round_up(1469) == 1536 and round_up(5186) == 6144 and round_up(7436) == 8192
    assert round_up(200_000) is None
    with pytest.raises(ValueError, match="negative"):
        bin_index(-1)


def test_missing_steps_are_held_as_missing_not_zero() -> None:
    history = History()
    history.record(STEP0, _observation(5))
    history.record(STEP0 + 1, _observation(0))  # zero is an observation: no traffic
    history.record(STEP0 + 2, None)  # the scrape failed
    history.record(STEP0 + 5, _observation(7))  # steps 3 and 4 never came
    assert history.start == STEP0 and history.end == STEP0 + 6
    assert history.rates() == [5.0, 0.0, None, None, None, 7.0]
    assert history.requests[2] == MISSING
    assert history.prompt_histogram()[bin_index(100)] == 12


def test_history_is_append_only() -> None:
    history = History()
    history.record(STEP0, _observation(1))
    with pytest.raises(ValueError, match="not after the last recorded step"):
        history.record(STEP0, _observation(1))


def test_history_is_bounded_by_its_retention_rates_and_histograms_alike() -> None:
    limits = HistoryLimits(step_s=60, retention_s=3 * 3600, slot_s=3600)  # 180 steps, 3 hour slots
    history = History(limits=limits)
    first = 30_000 * 60  # the start of an hour slot
    for offset in range(400):
        history.record(first + offset, _observation(offset % 7))
    assert len(history) == limits.points == 180
    assert history.start == first + 400 - 180
    held_slots = {(history.start * 60) // 3600, ((history.end - 1) * 60) // 3600}
    assert set(history.prompt_hist) <= set(range(min(held_slots), max(held_slots) + 1))
    # A gap longer than the retention leaves nothing of the old history.
    history.record(history.end + 10_000, _observation(3))
    assert len(history) == 1 and history.rates() == [3.0]
    assert sum(history.prompt_histogram()) == 3


def test_step_observation_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="requests"):
        StepObservation(requests=-1)
    with pytest.raises(ValueError, match="prompt_lengths"):
        StepObservation(requests=1, prompt_lengths=(1, 2, 3))


def test_round_trip_keeps_everything() -> None:
    history = History()
    history.record(STEP0, _observation(3, [10, 2000, 9000]))
    history.record(STEP0 + 1, None)
    history.record(STEP0 + 3, _observation(0))
    restored = loads(dumps(history))
    assert restored == history
    assert restored.rates() == [3.0, None, None, 0.0]
    assert restored.prompt_histogram() == history.prompt_histogram()
    # An empty history round-trips too (a WarmModel that has seen nothing yet).
    assert loads(dumps(History())) == History()


def test_seven_busy_days_fit_a_configmap_value() -> None:
    rng = random.Random(0)
    history = History()
    for offset in range(history.limits.points):
        count = rng.randint(0, 5000)
        lengths = [rng.choice((120, 900, 1500, 4000, 7000)) for _ in range(20)]
        history.record(STEP0 + offset, StepObservation(
            requests=count, prompt_tokens=count * 1500, generated_tokens=count * 30,
            prompt_lengths=tuple(histogram(lengths)), generated_lengths=tuple(histogram([30] * 20))))
    text = dumps(history)
    assert len(history) == 7 * 1440
    assert len(text) < 256 * 1024, len(text)  # the module docstring's figure; a ConfigMap holds 1 MiB
    assert loads(text) == history


def _encode(document: Any) -> str:
    return PREFIX + base64.b64encode(zlib.compress(json.dumps(document).encode())).decode()


def _valid_document() -> dict[str, Any]:
    history = History()
    history.record(STEP0, _observation(2))
    history.record(STEP0 + 1, _observation(1))
    raw = zlib.decompress(base64.b64decode(dumps(history)[len(PREFIX):]))
    document: dict[str, Any] = json.loads(raw)
    return document


def _with(**changes: Any) -> str:
    document = _valid_document()
    document.update(changes)
    return _encode(document)


GARBAGE = [
    ("", "not a warmpool history"),
    ("{}", "not a warmpool history"),
    (PREFIX + "!!!not base64!!!", "not valid base64"),
    (PREFIX + base64.b64encode(b"plain bytes, no zlib").decode(), "not valid zlib"),
    (PREFIX + base64.b64encode(zlib.compress(b'{"format": "warmpool.history"')[:-6]).decode(), "truncated"),
    (PREFIX + base64.b64encode(zlib.compress(b"\xff\xfe not json")).decode(), "not valid JSON"),
    (_encode([1, 2, 3]), "must be a JSON object"),
    (_with(format="something.else"), "format"),
    (_with(version=99), "version 99 is not supported"),
    (_with(step_s=0), "limits are invalid"),
    (_with(step_s="60"), "'step_s' must be an integer"),
    (_with(edges=[1, 2, 3]), "length bins differ"),
    (_with(requests=[1, -2]), "'requests'[1] = -2 is not a count"),
    (_with(requests=[1, True]), "'requests'[1] = True is not a count"),
    (_with(requests=[1, 2.5]), "'requests'[1] = 2.5 is not a count"),
    (_with(requests=[1, 2, 3]), "differ in length"),
    (_with(requests="12"), "must be a list of integers"),
    (_with(retention_s=60, requests=[1, 2], prompt_tokens=[1, 2], generated_tokens=[1, 2]), "more than its retention"),
    (_with(prompt_hist={"x": [1]}), "slot 'x' that is not an integer"),
    (_with(prompt_hist={str(STEP0 // 60): [-1]}), "non-negative counts"),
    (_with(prompt_hist={str(STEP0 // 60): [1] * (BIN_COUNT + 1)}), "non-negative counts"),
    (_with(prompt_hist={"12": [1]}), "outside the steps held"),
    (_with(generated_hist=[]), "must be an object"),
    # A zlib bomb: 64 MiB of zeros in a few kB must be refused, not inflated.
    (PREFIX + base64.b64encode(zlib.compress(b"0" * (64 * 2**20), 9)).decode(), "more than"),
]


@pytest.mark.parametrize(("text", "message"), GARBAGE, ids=[m for _, m in GARBAGE])
def test_garbage_is_refused_with_an_error_naming_it(text: str, message: str) -> None:
    with pytest.raises(HistoryFormatError, match=re.escape(message)):
        loads(text)


@pytest.mark.parametrize(("text", "message"), GARBAGE[:6], ids=[m for _, m in GARBAGE[:6]])
def test_a_caller_that_must_not_fail_gets_an_empty_history_and_the_reason(text: str, message: str) -> None:
    history, reason = loads_or_empty(text)
    assert len(history) == 0 and history.limits == HistoryLimits()
    assert reason is not None and reason.startswith("stored history refused") and message in reason


def test_loads_or_empty_without_stored_history_or_with_other_limits() -> None:
    history, reason = loads_or_empty(None)
    assert len(history) == 0 and reason == "no stored history"
    stored = History()
    stored.record(STEP0, _observation(4))
    other = HistoryLimits(retention_s=86400)
    history, reason = loads_or_empty(dumps(stored), other)
    assert len(history) == 0 and history.limits == other and reason is not None and "limits" in reason
    history, reason = loads_or_empty(dumps(stored), HistoryLimits())
    assert reason is None and history == stored
