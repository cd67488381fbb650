"""The history store's bounding policy: a history over the byte bound keeps its newest steps, as
many as fit, and drops the oldest; the name and labels come from one place; bad settings are refused."""

from __future__ import annotations

import random

import pytest
from warmpool_operator.api.types import MAX_WARMMODEL_NAME_LENGTH
from warmpool_operator.io.history_store import (
    COMPONENT_HISTORY,
    CONFIGMAP_DATA_LIMIT,
    HISTORY_CONFIGMAP_SUFFIX,
    StoreSettings,
    bounded_dump,
    history_configmap_name,
    history_labels,
)
from warmpool_operator.rules.forecast.history import History, HistoryLimits, StepObservation, dumps, loads
from warmpool_operator.rules.forecast.lengths import histogram

from tests.support.history_cuts import newest_steps
from warmpool.contract.pods import LABEL_COMPONENT, LABEL_MANAGED_BY, LABEL_MODEL

pytestmark = pytest.mark.unit

STEP0 = 29_000_000


def _busy_history(steps: int, seed: int = 7) -> History:
    """Random counts at every step (what compresses worst), with length histograms."""
    rng = random.Random(seed)
    history = History(limits=HistoryLimits())
    for offset in range(steps):
        requests = rng.randint(0, 5000)
        lengths = [rng.randint(1, 9000) for _ in range(rng.randint(0, 20))]
        history.record(STEP0 + offset, StepObservation(
            requests=requests, prompt_tokens=rng.randint(0, 10**7), generated_tokens=rng.randint(0, 10**6),
            prompt_lengths=tuple(histogram(lengths)), generated_lengths=tuple(histogram(lengths[:3]))))
    return history


def test_a_history_within_the_bound_is_stored_whole() -> None:
    history = _busy_history(600)
    text, dropped = bounded_dump(history, StoreSettings().max_bytes)
    assert dropped == 0 and text == dumps(history)


def test_over_the_bound_the_newest_steps_that_fit_are_kept_and_the_oldest_dropped() -> None:
    history = _busy_history(3000)
    whole = len(dumps(history))
    bound = whole // 3
    text, dropped = bounded_dump(history, bound)
    assert text is not None and len(text) <= bound
    kept = loads(text)
    assert 0 < dropped < len(history) and len(kept) == len(history) - dropped
    # the newest steps, exactly; the oldest ones gone
    assert kept.end == history.end and kept.start == history.start + dropped
    assert kept.requests == history.requests[dropped:]
    assert kept.prompt_tokens == history.prompt_tokens[dropped:]
    assert kept.generated_tokens == history.generated_tokens[dropped:]
    first_slot = kept.start * kept.limits.step_s // kept.limits.slot_s
    assert kept.prompt_hist == {s: c for s, c in history.prompt_hist.items() if s >= first_slot}
    # as many as fit: one step more would not
    assert len(dumps(newest_steps(history, len(kept) + 1))) > bound
    # the history in memory is untouched
    assert len(history) == 3000


def test_nothing_is_stored_when_not_even_one_step_fits() -> None:
    history = _busy_history(5)
    assert bounded_dump(history, 10) == (None, 5)


def test_newest_steps_refuses_counts_outside_the_history() -> None:
    history = _busy_history(5)
    for bad in (0, 6):
        with pytest.raises(ValueError, match=r"count must be within 1\.\.5"):
            newest_steps(history, bad)


def test_the_name_and_labels_come_from_the_contract() -> None:
    assert history_configmap_name("smollm2") == "smollm2" + HISTORY_CONFIGMAP_SUFFIX == "smollm2-history"
    name = "x" * MAX_WARMMODEL_NAME_LENGTH
    assert len(history_configmap_name(name)) <= 63
    labels = history_labels("smollm2")
    assert labels[LABEL_COMPONENT] == COMPONENT_HISTORY
    assert labels[LABEL_MODEL] == "smollm2"
    # not a child the operator's watch restores (those carry managed-by)
    assert LABEL_MANAGED_BY not in labels


@pytest.mark.parametrize(("settings", "needle"), [
    ({"max_bytes": 0}, "max_bytes must be within"),
    ({"max_bytes": CONFIGMAP_DATA_LIMIT}, "a ConfigMap holds 1 MiB"),
    ({"min_interval_s": -1.0}, "min_interval_s must be >= 0"),
])
def test_bad_settings_are_refused_naming_the_field(settings: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        StoreSettings(**settings)  # type: ignore[arg-type]
