"""KV caches of generations in flight: whole blocks that grow with the tokens generated,
and a count of the slots held now (what `kv_cache_tokens()` reports)."""

from __future__ import annotations

import threading

import torch
from warmpool_worker.engine_api import RequestError

#: KV caches of live generations are allocated in whole blocks of this many positions and
#: grow as tokens are generated (never sized up front for max_tokens), by at least a quarter
#: each time so the copies stay amortised O(1) per token.
KV_BLOCK_TOKENS = 64


def kv_capacity(needed: int, current: int, limit: int) -> int:
    """Positions to allocate for `needed`: whole blocks, at least a quarter more than `current`
    (amortised growth), never past `limit` (prompt + the completion's budget)."""
    target = max(needed, current + current // 4)
    return min(limit, -(-target // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS)


class KVCache:
    """Per-layer K and V, shape [batch, kv_heads, capacity, head_dim]."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys = keys
        self.values = values

    @classmethod
    def empty(cls, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
              dtype: torch.dtype, device: torch.device) -> KVCache:
        shape = (batch, kv_heads, capacity, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)])

    def row(self, index: int) -> KVCache:
        return KVCache([k[index : index + 1] for k in self.keys], [v[index : index + 1] for v in self.values])

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def slots(self) -> int:
        """Token slots held: rows x positions."""
        return self.keys[0].shape[0] * self.capacity

    def ensure(self, needed: int, limit: int) -> int:
        """Grow (by copying into larger zeroed tensors) to hold `needed` positions; slots added.

        Zeroed, not empty: a padded batch row attends over the whole capacity under a mask,
        and 0 x NaN from uninitialised memory would poison it.
        """
        if needed <= self.capacity:
            return 0
        before = self.slots
        size = kv_capacity(needed, self.capacity, limit)
        if size < needed:
            raise RequestError(f"the KV cache cannot grow to {needed} positions (limit {limit})")

        def grown(old: torch.Tensor) -> torch.Tensor:
            b, h, t, d = old.shape
            new = torch.zeros((b, h, size, d), dtype=old.dtype, device=old.device)
            new[:, :, :t] = old
            return new

        self.keys = [grown(k) for k in self.keys]
        self.values = [grown(v) for v in self.values]
        return self.slots - before


class LiveKVSlots:
    """Token slots held by the KV caches of generations in flight (CUDA graphs' static
    caches, sized once at capture, are not counted).  Each generation adds what it
    allocates or grows and takes it all back when it ends, however it ends."""

    def __init__(self) -> None:
        self._slots = 0
        self._lock = threading.Lock()

    @property
    def slots(self) -> int:
        return self._slots

    def add(self, slots: int) -> None:
        with self._lock:
            self._slots += slots

    def lease(self) -> KVLease:
        return KVLease(self)


class KVLease:
    """The slots one generation holds: counted as they are allocated or grown, all given
    back by `release` (in the generation's `finally`)."""

    def __init__(self, live: LiveKVSlots) -> None:
        self._live = live
        self._held = 0

    def _add(self, slots: int) -> None:
        self._held += slots
        self._live.add(slots)

    def hold(self, cache: KVCache) -> KVCache:
        self._add(cache.slots)
        return cache

    def grow(self, cache: KVCache, needed: int, limit: int) -> None:
        self._add(cache.ensure(needed, limit))

    def release(self) -> None:
        self._live.add(-self._held)
        self._held = 0
