"""The request history at two resolutions: fine steps for the bursts, rolled up as they close into a
coarse tier kept for weeks (rules/forecast/history.py); both in one bounded ConfigMap value, an older
operator's single-resolution history re-held at the new limits without losing its days
(rules/forecast/history_reshape.py), and the coarse tier read by the forecaster's daily and weekly
features (rules/forecast/features.py)."""

from __future__ import annotations

import base64
import json
import random
import zlib

import numpy as np
import pytest
from warmpool_operator.control.forecasting import (
    COARSE_RETENTION_S,
    HISTORY_POINTS,
    copy_history,
    forecast_with,
    forecaster_config,
    limits_for,
    write_interval_s,
)
from warmpool_operator.io.history_store import StoreSettings, bounded_dump
from warmpool_operator.rules.forecast.features import FeatureConfig, Seasonal, feature_matrix, feature_set
from warmpool_operator.rules.forecast.forecaster import Forecaster
from warmpool_operator.rules.forecast.history import (
    MISSING,
    PREFIX,
    History,
    HistoryFormatError,
    HistoryLimits,
    StepObservation,
    dumps,
    loads,
)
from warmpool_operator.rules.forecast.history_reshape import adapted, held_steps, since
from warmpool_operator.rules.forecast.lengths import BIN_COUNT, histogram

pytestmark = pytest.mark.unit

HOUR = 3600
DAY = 86400
#: A 10 s step index on a whole day (so hour slots and 5 min groups start on it).
DAY0 = 20_000 * DAY // 10


def _lengths(*tokens: int) -> tuple[int, ...]:
    return tuple(histogram(tokens))


def test_the_operators_limits_hold_fine_steps_and_a_coarse_tier_of_four_weeks() -> None:
    limits = limits_for(10)
    assert (limits.step_s, limits.points) == (10, HISTORY_POINTS)  # 28 h of 10 s steps
    coarse = limits.coarse
    assert coarse is not None and (coarse.step_s, coarse.retention_s, coarse.points) == (300, 28 * DAY, 8064)
    assert limits_for(30).coarse_step_s == 300 and limits_for(16).coarse_step_s == 400  # 300 % 16: next one
    assert limits_for(300).coarse is None and limits_for(3600).coarse is None  # already as coarse
    assert History(limits=limits).coarse is not None and History().coarse is None  # the library's default: one tier
    for bad, message in (({"coarse_step_s": 45}, "multiple of step_s"), ({"coarse_step_s": 10}, "above it"),
                         ({"coarse_step_s": 700}, "divides slot_s"), ({"coarse_retention_s": 60}, "needs a coarse"),
                         ({"coarse_step_s": 300, "coarse_retention_s": 299}, "at least one coarse step")):
        with pytest.raises(ValueError, match=message):
            HistoryLimits(step_s=10, retention_s=1000, **bad)


def test_closed_fine_steps_roll_up_into_coarse_steps_and_a_missing_one_makes_its_coarse_step_missing() -> None:
    history = History(limits=limits_for(10))
    start = DAY0 + 27  # three fine steps before the first whole 5 min group: it is left out
    for step in range(start, DAY0 + 3 * 30):
        offset = step - DAY0
        if offset == 70:  # one missing step in the third group
            history.record(step, None)
            continue
        history.record(step, StepObservation(requests=2, prompt_tokens=100, generated_tokens=10,
                                             peak_requests=12 if offset == 40 else None))
    coarse = history.coarse
    assert coarse is not None
    # Groups 0 (partly before the first fine step), 1 (whole), 2 (a missing step): one rolled-up step, one missing.
    assert coarse.start == DAY0 // 30 + 1 and coarse.requests == [60, MISSING]
    assert coarse.prompt_tokens == [3000, MISSING] and coarse.generated_tokens == [300, MISSING]
    # The busiest fine step's peak (12 per 10 s) at the 5 min step's length.
    assert coarse.peak_requests == [12 * 30, MISSING]
    # The open group is not rolled up until its last fine step closes.
    history.record(DAY0 + 90, StepObservation(requests=5))
    assert len(coarse) == 2
    for step in range(DAY0 + 91, DAY0 + 120):
        history.record(step, StepObservation(requests=1))
    assert coarse.requests == [60, MISSING, 5 + 29] and coarse.peak_requests[-1] == 5 * 30


def test_a_closed_hour_moves_its_lengths_into_the_coarse_tier_and_the_histogram_counts_them_once() -> None:
    history = History(limits=limits_for(10))
    for k in range(HOUR // 10 + 30):  # an hour and one 5 min group more
        history.record(DAY0 + k, StepObservation(requests=1, prompt_lengths=_lengths(100 if k < 360 else 3000)))
    coarse = history.coarse
    assert coarse is not None and len(coarse) == 13
    slot = DAY0 * 10 // HOUR
    assert coarse.prompt_hist[slot] == history.prompt_hist[slot]  # the closed hour, copied whole
    assert slot + 1 not in coarse.prompt_hist  # the open hour is only in the fine steps
    total = history.prompt_histogram()
    assert sum(total) == HOUR // 10 + 30 and total == [a + b for a, b in zip(
        _lengths(*[100] * 360), _lengths(*[3000] * 30), strict=True)]


def test_both_tiers_keep_their_own_retention_and_a_long_outage_leaves_a_gap_in_the_coarse_tier() -> None:
    limits = HistoryLimits(step_s=10, retention_s=600, slot_s=HOUR, coarse_step_s=60, coarse_retention_s=1800)
    history = History(limits=limits)
    for k in range(360):  # an hour of 10 s steps
        history.record(DAY0 + k, StepObservation(requests=1, prompt_lengths=_lengths(50)))
    coarse = history.coarse
    assert coarse is not None
    assert len(history) == 60 and history.start == DAY0 + 300  # ten minutes of fine steps
    assert len(coarse) == 30 and coarse.start == DAY0 // 6 + 30 and set(coarse.requests) == {6}  # half an hour
    # Twenty minutes without a step: more than the fine retention, less than the coarse one.  The fine
    # steps start again; the coarse tier holds the outage as missing (it cannot know it was quiet).
    history.record(DAY0 + 480, StepObservation(requests=3))
    assert (len(history), history.start, len(coarse)) == (1, DAY0 + 480, 30)
    for k in range(481, 492):
        history.record(DAY0 + k, StepObservation(requests=3))
    assert coarse.requests == [6] * 8 + [MISSING] * 20 + [18, 18] and coarse.end == DAY0 // 6 + 82


def test_two_busy_tiers_fit_the_stores_bound_and_round_trip() -> None:
    rng = random.Random(0)
    limits = limits_for(10)
    fine = History(limits=limits)
    for k in range(limits.points):  # 28 h of random counts (what compresses worst)
        count = rng.randint(0, 5000)
        fine.record(DAY0 + k, StepObservation(
            requests=count, prompt_tokens=count * 1500, generated_tokens=count * 30, peak_requests=count * 2,
            prompt_lengths=_lengths(*(rng.choice((120, 900, 1500, 4000, 7000)) for _ in range(20)))))
    coarse_limits = limits.coarse
    assert coarse_limits is not None
    # Four full weeks of coarse steps up to the fine steps' end, as the same traffic rolls them up (built
    # whole: 241,920 fine steps recorded one by one would take most of a minute).
    points = coarse_limits.points
    first = fine.end // 30 - points
    generator = np.random.default_rng(0)
    counts = generator.integers(0, 5001, size=(points, 30))
    requests = counts.sum(axis=1).tolist()
    lengths = generator.multinomial(360 * 20, [0.2] * 5, size=points * 300 // HOUR)  # an hour's 7,200 prompts
    coarse = History(limits=coarse_limits, start=first, requests=requests,
                     prompt_tokens=[r * 1500 for r in requests], generated_tokens=[r * 30 for r in requests],
                     peak_requests=(counts.max(axis=1) * 2 * 30).tolist(),
                     prompt_hist={first * 300 // HOUR + i: _spread(row) for i, row in enumerate(lengths)})
    full = since(fine, fine.start)
    full.coarse = coarse
    text = dumps(full)
    print(f"two busy tiers: {len(text)} bytes, the fine one alone {len(dumps(since(fine, fine.start)))}")
    assert len(text) <= 300 * 1024, len(text)  # about 250 kB (the docstrings' figure); 768 KiB is the bound
    assert bounded_dump(full, StoreSettings().max_bytes) == (text, 0)
    restored = loads(text)
    assert restored == full and restored.coarse == coarse and restored.limits == limits


def _spread(five: np.ndarray) -> list[int]:
    """Counts of five prompt lengths (120, 900, 1500, 4000, 7000 tokens) in the length bins."""
    out = [0] * BIN_COUNT
    for tokens, count in zip((120, 900, 1500, 4000, 7000), five.tolist(), strict=True):
        out[histogram([tokens]).index(1)] += count
    return out


def test_over_the_bound_the_coarse_tiers_oldest_steps_go_first() -> None:
    history = History(limits=HistoryLimits(step_s=10, retention_s=3000, slot_s=HOUR, coarse_step_s=300,
                                           coarse_retention_s=10 * DAY))
    rng = random.Random(3)
    for k in range(2 * DAY // 10):  # two days: the fine tier holds 300 steps, the coarse one 576
        history.record(DAY0 + k, StepObservation(requests=rng.randint(0, 5000)))
    coarse = history.coarse
    assert coarse is not None and (len(history), len(coarse)) == (300, 576)
    whole = len(dumps(history))
    text, dropped = bounded_dump(history, whole * 2 // 3)
    assert text is not None and len(text) <= whole * 2 // 3
    kept = loads(text)
    assert kept.coarse is not None and len(kept) == len(history)  # the fine steps whole ...
    assert kept.coarse.end == coarse.end and 0 < len(kept.coarse) < len(coarse)  # ... the oldest coarse ones out
    assert dropped == held_steps(history) - held_steps(kept)
    assert bounded_dump(history, 10) == (None, held_steps(history))


def test_a_coarse_tier_in_a_document_is_checked_like_the_rest() -> None:
    history = History(limits=limits_for(10))
    for k in range(60):
        history.record(DAY0 + k, StepObservation(requests=1))
    document = json.loads(zlib.decompress(base64.b64decode(dumps(history)[len(PREFIX):])))
    document["coarse"]["coarse"] = dict(document["coarse"])  # a coarse tier of the coarse tier: not a thing
    nested = PREFIX + base64.b64encode(zlib.compress(json.dumps(document).encode())).decode()
    with pytest.raises(HistoryFormatError, match="coarse tier holds a coarse tier"):
        loads(nested)
    odd = since(history, history.start)
    odd.coarse = History(limits=HistoryLimits(step_s=45, retention_s=4500))  # no whole number of 10 s steps
    with pytest.raises(HistoryFormatError, match="coarse tier does not fit its steps"):
        loads(dumps(odd))


def _old_operators_week() -> History:
    """What the previous operator stored: seven days of 60 s steps, one resolution, length histograms per hour."""
    history = History(limits=HistoryLimits(step_s=60, retention_s=60 * 7 * 1440, slot_s=HOUR))
    first = DAY0 * 10 // 60
    for k in range(7 * 1440 + 7):  # a week and seven minutes more (the retention keeps the newest week)
        history.record(first + k, StepObservation(requests=k % 7, prompt_tokens=k % 7 * 100,
                                                  prompt_lengths=_lengths(900) if k % 60 == 0 else ()))
    return history


def test_an_older_operators_single_resolution_week_is_re_held_with_its_days_in_the_coarse_tier() -> None:
    old = _old_operators_week()
    text = dumps(old)
    stored = loads(text)  # what the new operator reads: no coarse tier, 60 s steps
    assert stored.coarse is None and stored.limits.step_s == 60
    history, kept = adapted(stored, limits_for(30))
    coarse = history.coarse
    assert coarse is not None
    # No 60 s step can be held at 30 s: the fine steps start empty; the week is in 5 min steps.
    assert len(history) == 0 and "cannot be held at 30 s" in kept and "rolled up from its steps" in kept
    first_group, end_group = -(-old.start // 5), old.end // 5  # the whole 5 min groups of the week
    assert (coarse.start, coarse.end) == (first_group, end_group) and len(coarse) == 7 * 288 - 1
    assert sum(coarse.requests) == sum(old.requests[first_group * 5 - old.start:end_group * 5 - old.start])
    assert history.prompt_histogram() == old.prompt_histogram()  # the learned lengths keep their week
    # The new operator's 30 s steps go on from the next 5 min group; the one the upgrade cut is missing.
    next_step = (end_group + 1) * 10
    for k in range(10):
        history.record(next_step + k, StepObservation(requests=4))
    assert len(coarse) == 7 * 288 + 1 and coarse.requests[-2:] == [MISSING, 40]
    # Written again, it is at the new limits and loads as it is.
    again = loads(dumps(history))
    assert again.limits == limits_for(30) and adapted(again, limits_for(30)) == (again, "kept whole")


def test_an_older_history_at_the_same_step_keeps_its_fine_steps_and_rolls_up_its_coarse_tier() -> None:
    old = History(limits=HistoryLimits(step_s=10, retention_s=10 * 10080, slot_s=HOUR))  # the old 10 s limits
    for k in range(600):
        old.record(DAY0 + k, StepObservation(requests=1, peak_requests=3))
    history, kept = adapted(loads(dumps(old)), limits_for(10))
    assert history.requests == old.requests and history.start == old.start and "600 of its 600" in kept
    assert history.coarse is not None
    assert history.coarse.requests == [30] * 20 and history.coarse.peak_requests == [90] * 20
    # A history at a step no coarse step is made of keeps nothing it cannot hold, and says why.
    odd = History(limits=HistoryLimits(step_s=16, retention_s=16 * 100, slot_s=HOUR))  # 300 s is no multiple
    odd.record(1000, StepObservation(requests=1))
    history, kept = adapted(odd, limits_for(10))
    assert len(history) == 0 and history.coarse is not None and len(history.coarse) == 0 and "do not divide" in kept


def test_the_coarse_tier_gives_the_forecaster_its_daily_and_weekly_features() -> None:
    config = FeatureConfig(step_s=10, time_of_day_min_steps=2 * 8640, day_of_week_min_steps=14 * 8640)
    # 28 h of fine steps alone cannot turn the daily features on (two days are needed) ...
    assert not feature_set(config, HISTORY_POINTS).time_of_day
    # ... three weeks of 5 min steps can, with the figure a day and a week before the target.
    values = np.arange(21 * 288, dtype=np.float64)
    seasonal = Seasonal(values, first_step=DAY0 // 30, step_s=300)
    features = feature_set(config, HISTORY_POINTS, seasonal=seasonal)
    assert features.time_of_day and features.day_of_week and features.names[-2:] == ("day_ago", "week_ago")
    series = np.ones(40)
    first = DAY0 + 15 * 8640  # fine steps on day 15
    matrix = feature_matrix(series, first, 6, features, 10, seasonal=seasonal)
    target_s = (first + 15 - 1 + 6) * 10  # the first row's target
    day_ago = values[(target_s - DAY) // 300 - DAY0 // 30] * 10 / 300
    week_ago = values[(target_s - 7 * DAY) // 300 - DAY0 // 30] * 10 / 300
    assert matrix[0, -2] == pytest.approx(day_ago) and matrix[0, -1] == pytest.approx(week_ago)
    with pytest.raises(ValueError, match="need seasonal"):
        feature_matrix(series, first, 6, features, 10)


def test_a_forecaster_fed_two_tiers_trains_on_the_coarse_daily_shape() -> None:
    limits = limits_for(60)  # 60 s fine steps keep the test's history short; the tiers work the same
    history = History(limits=limits)
    day_steps = DAY // 60
    first = DAY0 * 10 // 60
    for k in range(3 * day_steps):  # three days: a busy afternoon every day
        busy = 12 * 60 <= k % day_steps < 18 * 60
        history.record(first + k, StepObservation(requests=30 if busy else 2))
    fine_tail = since(history, history.end - 600)  # ten hours of fine steps, and the coarse tier's three days
    fine_tail.coarse = history.coarse
    assert fine_tail.coarse is not None and len(fine_tail.coarse) == 3 * 288
    forecaster = Forecaster(forecaster_config(60))
    prediction = forecast_with(forecaster, copy_history(fine_tail), 60, (1,))
    assert forecaster.model is not None and forecaster.model.features.names[-1] == "day_ago"
    assert prediction.last_step == fine_tail.end - 1


def test_the_store_writes_at_most_every_five_minutes_at_the_default_steps() -> None:
    assert write_interval_s(10) == write_interval_s(30) == write_interval_s(60) == 300.0
    assert write_interval_s(2) == 10.0  # tests and demos: every five steps
    assert COARSE_RETENTION_S == 28 * DAY
