"""The tier rule shared by the worker's guard and the operator: a table of transitions."""

from __future__ import annotations

import math

import pytest

from warmpool.contract.api import Tier
from warmpool.tiering import ThresholdError, Thresholds, clean_ratio, decide_tier, raw_tier, stricter

pytestmark = pytest.mark.unit

F, T, P, U = Tier.FULL, Tier.TRUNCATED, Tier.PAUSED, Tier.UNKNOWN
DEFAULT = Thresholds()  # 70 / 90 / 5


@pytest.mark.parametrize(
    ("ratio", "previous", "expected"),
    [
        # no history: the level alone decides
        (0.0, U, F),
        (0.6999, U, F),
        (0.70, U, T),
        (0.8999, U, T),
        (0.90, U, P),
        (1.5, U, P),  # over-committed is paused, not garbage
        # entering from below
        (0.69, F, F),
        (0.70, F, T),
        (0.95, F, P),
        (0.90, T, P),
        # hysteresis on the way down from truncated (exit below 65)
        (0.69, T, T),
        (0.65, T, T),
        (0.6499, T, F),
        # hysteresis on the way down from paused (exit below 85)
        (0.89, P, P),
        (0.85, P, P),
        (0.8499, P, T),
        (0.70, P, T),
        (0.66, P, T),  # being paused implies truncated held: still within its margin
        (0.6499, P, F),
        (0.10, P, F),
        # garbage is unknown, never 0 % used
        (None, F, U),
        (None, P, U),
        (math.nan, T, U),
        (math.inf, F, U),
        (-0.1, F, U),
    ],
)
def test_transitions(ratio: float | None, previous: Tier, expected: Tier) -> None:
    assert decide_tier(ratio, previous, DEFAULT) is expected


def test_hovering_level_does_not_flap() -> None:
    tier = F
    seen = []
    for ratio in [0.69, 0.71, 0.69, 0.70, 0.68, 0.66, 0.71, 0.67]:
        tier = decide_tier(ratio, tier, DEFAULT)
        seen.append(tier)
    assert seen == [F, T, T, T, T, T, T, T]


def test_full_cycle_up_and_down() -> None:
    tier = U
    path = []
    for ratio in [0.5, 0.75, 0.92, 0.87, 0.84, 0.66, 0.64, 0.2]:
        tier = decide_tier(ratio, tier, DEFAULT)
        path.append(tier)
    assert path == [F, T, P, P, T, T, F, F]


def test_custom_thresholds() -> None:
    th = Thresholds(truncate_at=50, pause_at=80, hysteresis=10)
    assert decide_tier(0.45, T, th) is T
    assert decide_tier(0.39, T, th) is F
    assert decide_tier(0.75, P, th) is P
    assert decide_tier(0.69, P, th) is T
    assert raw_tier(0.79, th) is T


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [(F, T, T), (T, F, T), (P, T, P), (T, P, P), (U, T, T), (U, F, F), (F, U, F), (U, U, U), (P, P, P)],
)
def test_stricter(a: Tier, b: Tier, expected: Tier) -> None:
    assert stricter(a, b) is expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"truncate_at": 90, "pause_at": 70},
        {"truncate_at": 0},
        {"pause_at": 101},
        {"hysteresis": -1},
        {"hysteresis": 70},
        {"truncate_at": math.nan},
    ],
)
def test_bad_thresholds_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ThresholdError):
        Thresholds(**kwargs)


def test_parse() -> None:
    assert Thresholds.parse("60,80") == Thresholds(60, 80, 5)
    assert Thresholds.parse(" 60, 80 ,2") == Thresholds(60, 80, 2)
    for bad in ("60", "a,b", "1,2,3,4", "80,60"):
        with pytest.raises(ThresholdError):
            Thresholds.parse(bad)


def test_clean_ratio() -> None:
    assert clean_ratio(0.5) == 0.5
    assert clean_ratio(1) == 1.0
    assert clean_ratio(True) is None
    assert clean_ratio("0.5") is None
    assert clean_ratio(None) is None
