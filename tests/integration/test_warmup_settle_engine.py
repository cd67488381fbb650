"""The settled-warm-up rule on the real built-in engine: a tiny model, real
prefills timed by the real clock.  A bucket stops early when its latency is flat, and no bucket
ever runs past the plan's prompts per bucket (the ceiling)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_worker.builtin.engine import load_engine
from warmpool_worker.warmup import DEFAULT_PROMPTS, SettleRule, WarmupProgress, execute_plan, plan_warmup

from warmpool.contract.api import Tier

pytestmark = pytest.mark.integration

CEILING = 5
BUCKETS = (16, 64)


def _warm(model: Path, rule: SettleRule) -> WarmupProgress:
    engine = load_engine(model, "cpu", "float32")
    plan = plan_warmup(Tier.FULL, layer_order=list(range(engine.num_layers)), buckets=BUCKETS,
                       prompts_per_bucket=CEILING, decode_tokens=2, max_context=engine.max_context)
    return execute_plan(engine, plan, DEFAULT_PROMPTS, WarmupProgress(), settle=rule)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("settle") / "tiny", layers=2, max_position_embeddings=256)


def test_flat_latency_stops_early(tiny: Path) -> None:
    """Flat as far as a shared 2-core host can promise: prefills of one length there differ by up to
    a few times under load, so "flat" is judged at a tolerance that load hardly breaks (10x), and the
    buckets stop well under the ceiling.  A tiny model's prefill takes about a millisecond, so the
    collector is held off while it runs; even so, one descheduling inside a prefill can make it 10x
    its neighbour on a loaded machine (seen twice in full suites: a bucket stopped at 3).  So each
    bucket is checked against the rule on its own measured timings, and the flat case asks that the
    buckets stop early, not that none ever met such a pause."""
    rule = SettleRule(tolerance=10.0)
    gc.collect()
    gc.disable()
    try:
        progress = _warm(tiny, rule)
    finally:
        gc.enable()
    _assert_stopped_where_settled(progress, rule)
    assert rule.min_prefills < CEILING
    assert all(progress.prefills[bucket] < CEILING for bucket in BUCKETS), progress.seconds


def _assert_stopped_where_settled(progress: WarmupProgress, rule: SettleRule) -> None:
    """Each bucket stopped at the first prefill after which its last two agreed (by the engine's
    real timings), or ran exactly to the ceiling when they never did."""
    for bucket in BUCKETS:
        seconds = progress.seconds[bucket]
        assert len(seconds) == progress.prefills[bucket] <= CEILING
        first_settled = next((n for n in range(1, CEILING + 1) if rule.settled(seconds[:n])), None)
        if first_settled is None:
            assert progress.prefills[bucket] == CEILING and bucket not in progress.settled, seconds
        else:
            assert progress.prefills[bucket] == progress.settled[bucket] == first_settled, seconds


def test_default_rule_stops_where_the_latencies_settle_and_never_past_the_ceiling(tiny: Path) -> None:
    """At the shipped tolerance the outcome depends on the host's noise, so the test checks the
    engine's real timings against the rule: each bucket stopped at the first prefill after which
    its last two agreed, or ran exactly to the ceiling when they never did."""
    rule = SettleRule()
    _assert_stopped_where_settled(_warm(tiny, rule), rule)
