"""Warm-up lengths learned from the prompts a model really gets (``spec.warmup.learnBuckets``).

From the prompt-length histogram (bins at graph-friendly sizes, :mod:`.lengths`), take the
p50, p90 and p99 prompt lengths; each is read as the upper edge of the bin that holds it, so
it is already rounded up to a size an engine pads to.  Lengths past the model's context are
cut to the largest graph-friendly size within it (or the context itself when that is below
every size).  Equal lengths collapse, so a narrow mix yields fewer buckets.  Alongside:
how many observed prompts each bucket would serve (those longer than the bucket below it
and no longer than it) and how many are longer than every bucket.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from warmpool_operator.rules.forecast.lengths import BIN_COUNT, LENGTH_EDGES

DEFAULT_QUANTILES = (0.5, 0.9, 0.99)
#: Fewer prompts than this and a p99 is one or two requests: keep the configured buckets.
MIN_PROMPTS = 200


@dataclass(frozen=True)
class LearnedBuckets:
    buckets: tuple[int, ...]  # strictly ascending; empty when none could be learned
    prompts_per_bucket: tuple[int, ...]  # observed prompts each bucket serves
    longer_than_all: int  # observed prompts longer than the largest bucket
    observed: int
    reason: str

    @property
    def learned(self) -> bool:
        return bool(self.buckets)


def learn_buckets(prompt_histogram: Sequence[int], max_context: int,
                  quantiles: Sequence[float] = DEFAULT_QUANTILES, min_prompts: int = MIN_PROMPTS) -> LearnedBuckets:
    """Buckets at the prompt-length quantiles, within ``max_context`` tokens."""
    _check_histogram(prompt_histogram)
    if max_context < 1:
        raise ValueError(f"max_context must be >= 1 token, got {max_context}")
    if any(not 0 < q <= 1 for q in quantiles) or not quantiles:
        raise ValueError(f"quantiles must be within (0, 1], got {list(quantiles)}")
    observed = sum(prompt_histogram)
    if observed < min_prompts:
        return LearnedBuckets((), (), 0, observed,
                              f"{observed} prompts observed, fewer than {min_prompts}: configured buckets kept")
    ceiling = _largest_size_within(max_context)
    chosen = sorted({min(_quantile_edge(prompt_histogram, q), ceiling) for q in quantiles})
    per_bucket, longer = prompts_served(chosen, prompt_histogram)
    return LearnedBuckets(tuple(chosen), per_bucket, longer, observed,
                          f"p{'/p'.join(f'{100 * q:g}' for q in quantiles)} of {observed} prompts"
                          f" (rounded up to graph sizes, within a {max_context}-token context)")


def prompts_served(buckets: Sequence[int], prompt_histogram: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Prompts per bucket (longer than the bucket below, no longer than it) and those longer than all.

    Buckets should be graph-friendly sizes (the histogram's bin edges); a bin is counted in
    the first bucket at or above its upper edge.
    """
    _check_histogram(prompt_histogram)
    ordered = sorted(buckets)
    counts = [0] * len(ordered)
    longer = 0
    for index, count in enumerate(prompt_histogram):
        edge = LENGTH_EDGES[index] if index < len(LENGTH_EDGES) else None
        slot = len(ordered) if edge is None else bisect.bisect_left(ordered, edge)
        if slot < len(ordered):
            counts[slot] += count
        else:
            longer += count
    return tuple(counts), longer


def _quantile_edge(histogram: Sequence[int], q: float) -> int:
    """Upper edge of the bin holding the q-quantile (the overflow bin reads as the largest edge)."""
    needed = q * sum(histogram)
    running = 0
    for index, count in enumerate(histogram):
        running += count
        if running >= needed and count:
            return LENGTH_EDGES[min(index, len(LENGTH_EDGES) - 1)]
    return LENGTH_EDGES[-1]


def _largest_size_within(max_context: int) -> int:
    index = bisect.bisect_right(LENGTH_EDGES, max_context)
    return LENGTH_EDGES[index - 1] if index else max_context


def _check_histogram(histogram: Sequence[int]) -> None:
    if len(histogram) != BIN_COUNT or any(c < 0 for c in histogram):
        raise ValueError(f"a prompt-length histogram has {BIN_COUNT} non-negative counts, got {len(histogram)}")
