"""The decoder's linear layers, and the packed layout their CPU weights are kept in.

On CPU, torch's default float32 matmul (MKL) is at its worst exactly where a continuous batch
lives: a handful of rows.  Measured here (2 threads, SmolLM2's shapes), for 1 / 4 / 12 rows:
the 49152 x 576 head 9.1 / 23.0 / 23.2 ms through MKL, 5.4 / 6.0 / 8.3 ms through oneDNN with
the weight reordered once into its blocked layout; the 1536 x 576 MLP matrices 0.21 -> 0.12 ms
at 4 rows, 0.29 -> 0.19 ms at 12.  oneDNN's result for a row also does not depend on how many
rows come with it (MKL's does, at the last bit), so a request's greedy tokens are the same in
a batch and alone.

Packing makes a copy, so it is done only where the engine copies anyway: a float32 weight
converted from another checkpoint dtype (a zero-copy weight stays the file's mapping).  A tied
head, converted, gets a packed copy of its own: the embedding rows stay plain for lookups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The weight-table keys of matrices used as `linear(x, weight)`.
LINEAR_KEYS = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "head"})
#: The batch size oneDNN is told to expect when it picks the packed layout.
PACK_ROWS_HINT = 16


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's packed layout for `linear` (a new tensor)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b, through oneDNN when `weight` is packed."""
    if weight.is_mkldnn:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the weight's values (a packed one unpacked: error paths and checks only)."""
    return weight.to_dense() if weight.is_mkldnn else weight
