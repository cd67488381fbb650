"""Warm-up stops a bucket once its latency has settled, on synthetic latencies:
the rule itself, and `execute_plan` driven by a clock that each prefill advances by a scripted time."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from warmpool_worker.defaults import DEFAULT_SETTLE_MIN_PREFILLS, DEFAULT_SETTLE_TOLERANCE
from warmpool_worker.engine_api import GenerationStep
from warmpool_worker.warmup import SettleRule, WarmupProgress, execute_plan, plan_warmup

from tests.support.fake_engine import FakeEngine
from warmpool.contract.api import Tier

pytestmark = pytest.mark.unit

CEILING = 6


class ScriptedClock:
    """A clock that moves only when a prefill runs, by that bucket's next scripted latency."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedEngine(FakeEngine):
    """The fake engine, each generate taking the next scripted seconds of its bucket on `clock`."""

    def __init__(self, clock: ScriptedClock, latencies: dict[int, Sequence[float]]) -> None:
        super().__init__("timed", num_layers=2)
        self.clock = clock
        self.latencies = {bucket: list(times) for bucket, times in latencies.items()}
        self.calls: dict[int, int] = {}

    def generate(
        self, token_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0
    ) -> Iterator[GenerationStep]:
        bucket = len(token_ids)
        index = self.calls.get(bucket, 0)
        self.calls[bucket] = index + 1
        self.clock.now += self.latencies[bucket][index]
        yield from super().generate(token_ids, max_new_tokens, temperature)


def run(latencies: dict[int, Sequence[float]], ceiling: int = CEILING) -> tuple[WarmupProgress, TimedEngine]:
    clock = ScriptedClock()
    engine = TimedEngine(clock, latencies)
    plan = plan_warmup(Tier.FULL, layer_order=[0, 1], buckets=tuple(latencies), prompts_per_bucket=ceiling,
                       decode_tokens=1)
    progress = execute_plan(engine, plan, ["warm me up with these words"], WarmupProgress(), clock=clock)
    return progress, engine


def test_the_rule_on_sequences() -> None:
    rule = SettleRule()
    assert (rule.tolerance, rule.min_prefills) == (DEFAULT_SETTLE_TOLERANCE, DEFAULT_SETTLE_MIN_PREFILLS)
    assert not rule.settled([])
    assert not rule.settled([1.0])  # one prefill cannot show two in a row
    assert rule.settled([1.0, 1.0])
    assert rule.settled([3.0, 1.00, 1.04])  # the last two agree: the cold first one does not matter
    assert not rule.settled([1.0, 1.06])  # 6 % apart: not yet
    assert not rule.settled([1.0, 0.5])  # faster and faster is still warming
    assert not SettleRule(min_prefills=3).settled([1.0, 1.0])
    assert SettleRule(min_prefills=3).settled([2.0, 1.0, 1.0])


@pytest.mark.parametrize("tolerance, min_prefills", [(-0.1, 2), (float("nan"), 2), (float("inf"), 2), (0.05, 1)])
def test_the_rule_refuses_bad_settings(tolerance: float, min_prefills: int) -> None:
    with pytest.raises(ValueError, match="settle"):
        SettleRule(tolerance=tolerance, min_prefills=min_prefills)


def test_flat_latency_stops_each_bucket_at_the_minimum() -> None:
    progress, engine = run({16: [0.2] * CEILING, 32: [0.4] * CEILING})
    assert engine.calls == {16: DEFAULT_SETTLE_MIN_PREFILLS, 32: DEFAULT_SETTLE_MIN_PREFILLS}
    assert progress.prefills == progress.settled == {16: DEFAULT_SETTLE_MIN_PREFILLS, 32: DEFAULT_SETTLE_MIN_PREFILLS}
    assert progress.describe()["settled"] == {"16": 2, "32": 2}


def test_a_cold_first_prefill_settles_one_later() -> None:
    progress, engine = run({16: [1.5, 0.2, 0.201, 0.2, 0.2, 0.2]})
    assert engine.calls == {16: 3} and progress.settled == {16: 3}
    assert "16: settled after 3/6" in progress.settle_report(
        plan_warmup(Tier.FULL, layer_order=[0, 1], buckets=(16,), prompts_per_bucket=CEILING))


def test_noisy_latency_runs_to_the_ceiling_and_never_past_it() -> None:
    noisy = [0.2, 0.3, 0.2, 0.3, 0.2, 0.3, 0.2, 0.2, 0.2]  # would settle at the 8th: past the ceiling
    progress, engine = run({16: noisy})
    assert engine.calls == {16: CEILING} and progress.prefills == {16: CEILING}
    assert progress.settled == {}
    plan = plan_warmup(Tier.FULL, layer_order=[0, 1], buckets=(16,), prompts_per_bucket=CEILING)
    assert progress.settle_report(plan) == "16: ceiling 6/6, not settled"
    assert progress.remaining(plan).buckets == ()


def test_a_settled_bucket_is_complete_at_a_deeper_plan() -> None:
    """A top-up with a higher ceiling does not re-run a bucket that has settled; one that ran to
    its ceiling unsettled does get the extra prompts."""
    progress, _ = run({16: [0.2, 0.2], 32: [0.2, 0.5]}, ceiling=2)
    deeper = plan_warmup(Tier.FULL, layer_order=[0, 1], buckets=(16, 32), prompts_per_bucket=4)
    assert progress.settled == {16: 2}
    assert progress.remaining(deeper).buckets == (32,)


def test_at_ceiling_one_the_rule_changes_nothing() -> None:
    """The truncated tier's one prompt per bucket: one prefill, as before the rule."""
    progress, engine = run({16: [0.2, 0.2]}, ceiling=1)
    assert engine.calls == {16: 1} and progress.settled == {}
