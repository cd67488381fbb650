"""Learned warm-up buckets: p50/p90/p99 of the prompt-length histogram rounded up to graph sizes, within the
model's context, with the prompts each would serve; too few prompts keep the configured buckets."""

from __future__ import annotations

import pytest
from warmpool_operator.rules.forecast.buckets import learn_buckets, prompts_served
from warmpool_operator.rules.forecast.lengths import histogram

pytestmark = pytest.mark.unit

MIX = [1000] * 500 + [5000] * 400 + [7000] * 95 + [20000] * 5  # p50 1000, p90 5000, p99 7000


def test_quantiles_rounded_up_to_graph_sizes() -> None:
    learned = learn_buckets(histogram(MIX), max_context=32768)
    assert learned.buckets == (1024, 6144, 8192)
    assert learned.prompts_per_bucket == (500, 400, 95) and learned.longer_than_all == 5
    assert learned.observed == 1000 and learned.learned and "p50/p90/p99 of 1000 prompts" in learned.reason


def test_buckets_stay_within_the_model_context() -> None:
    learned = learn_buckets(histogram(MIX), max_context=4096)
    assert learned.buckets == (1024, 4096)  # p90 and p99 both cut to the largest graph size within 4096
    assert learned.prompts_per_bucket == (500, 0) and learned.longer_than_all == 500
    assert learn_buckets(histogram(MIX), max_context=5000).buckets == (1024, 4096)
    assert learn_buckets(histogram([10] * 300), max_context=12).buckets == (12,)  # below every graph size


def test_a_narrow_mix_gives_fewer_buckets() -> None:
    assert learn_buckets(histogram([100] * 300), max_context=8192).buckets == (128,)


def test_too_few_prompts_keep_the_configured_buckets() -> None:
    learned = learn_buckets(histogram([100] * 50), max_context=8192)
    assert not learned.learned and learned.buckets == () and "50 prompts observed" in learned.reason


def test_prompts_served_counts_each_prompt_in_the_smallest_bucket_that_covers_it() -> None:
    served, longer = prompts_served((32, 128, 512), histogram([20, 100, 500, 600]))
    assert served == (1, 1, 1) and longer == 1


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="non-negative counts"):
        learn_buckets([1, 2, 3], max_context=8192)
    with pytest.raises(ValueError, match="max_context"):
        learn_buckets(histogram(MIX), max_context=0)
    with pytest.raises(ValueError, match="quantiles"):
        learn_buckets(histogram(MIX), max_context=8192, quantiles=(0.5, 1.5))
