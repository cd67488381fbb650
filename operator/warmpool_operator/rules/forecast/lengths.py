"""Graph-friendly token lengths: the bins of every length histogram and the sizes buckets round up to.

Compute graphs (CUDA graphs, compiled kernels) are captured per shape, so a warm-up length
is only worth having at a size an engine pads to: powers of two and the 1.5x step between
them (16, 24, 32, 48, 64, 96, ...).  The same sizes bin the prompt-length histogram, so a
quantile read off the histogram is already rounded up to such a size.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from warmpool.contract.files import TOKEN_LENGTH_EDGES

#: Upper edges (inclusive) of the length bins; a length above the last lands in the overflow bin.
#: The contract owns them: the workers' token histograms use the same buckets.
LENGTH_EDGES: tuple[int, ...] = TOKEN_LENGTH_EDGES
#: Bins: one per edge plus the overflow bin (lengths above ``LENGTH_EDGES[-1]``).
BIN_COUNT = len(LENGTH_EDGES) + 1


def bin_index(length: int) -> int:
    """Index of the bin holding ``length`` tokens: the first edge >= length (overflow past the last)."""
    if length < 0:
        raise ValueError(f"a token length cannot be negative, got {length}")
    return bisect.bisect_left(LENGTH_EDGES, length)


def histogram(lengths: Iterable[int]) -> list[int]:
    """Counts per bin of raw lengths."""
    counts = [0] * BIN_COUNT
    for length in lengths:
        counts[bin_index(length)] += 1
    return counts


def round_up(length: int) -> int | None:
    """The smallest graph-friendly size >= length; None past the largest."""
    index = bin_index(length)
    return LENGTH_EDGES[index] if index < len(LENGTH_EDGES) else None
