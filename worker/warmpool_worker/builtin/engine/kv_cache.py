"""KV caches of generations in flight, and the block budget the batch shares.

A generation's K/V live in a `KVCache` of its own, whose capacity is always a whole number of
blocks of `KV_BLOCK_TOKENS` positions and grows with the tokens generated (never sized up
front for max_tokens), by a quarter each time when the pool has room for that (so the copies
stay amortised O(1) per token) and by the blocks it needs exactly when it does not.  Every
block held comes out of one `KVBlockPool`, bounded by bytes (``--kv-cache-bytes``).  Under the
batch's scheduler a generation's lease is *bounded*: the scheduler reserves, step by step, the
blocks each running generation's next step needs (a prompt's blocks when it joins, one more
block now and then as it decodes), and when the pool cannot give them it preempts a running
generation (`batch_scheduler`) rather than letting a request reserve its whole max_tokens up
front.  A lease outside the scheduler (a warm-up step, a direct engine call) borrows past the
bound: the batch is held while it runs.

Why one contiguous cache per sequence rather than a paged pool with a block table: on CPU,
attention over pages needs a gather (a copy of every page a sequence holds, per layer, per
step) before SDPA can read them, which triples the KV memory traffic of a decode step; a
contiguous cache is read in place.  The blocks are the unit of allocation and of the budget,
which is what admission needs.
"""

from __future__ import annotations

import threading

import torch
from warmpool_worker.engine_api import RequestError

#: Positions per KV block: the unit of allocation and of the batch's budget.
KV_BLOCK_TOKENS = 16


def blocks_for(positions: int) -> int:
    """Blocks that hold this many positions."""
    return -(-max(0, positions) // KV_BLOCK_TOKENS)


def kv_capacity(needed: int, current: int, limit: int) -> int:
    """Positions to allocate for `needed`: whole blocks, at least a quarter more than `current`
    (amortised growth), never more blocks than `limit` (prompt + the completion's budget) needs."""
    target = min(max(needed, current + current // 4), max(needed, limit))
    return blocks_for(target) * KV_BLOCK_TOKENS


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

    @property
    def blocks(self) -> int:
        return self.keys[0].shape[0] * blocks_for(self.capacity)

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    def ensure(self, needed: int, limit: int, size: int | None = None) -> int:
        """Grow (by copying into larger zeroed tensors) to hold `needed` positions, to `size`
        positions when given (else the amortised `kv_capacity`); blocks added.

        Zeroed, not empty: a padded batch row attends over the whole capacity under a mask,
        and 0 x NaN from uninitialised memory would poison it.
        """
        if needed <= self.capacity:
            return 0
        before = self.blocks
        size = kv_capacity(needed, self.capacity, limit) if size is None else size
        if size < needed:
            raise RequestError(f"the KV cache cannot grow to {needed} positions (limit {limit})")

        def grown(old: torch.Tensor) -> torch.Tensor:
            b, h, t, d = old.shape
            new = torch.zeros((b, h, size, d), dtype=old.dtype, device=old.device)
            new[:, :, :t] = old
            return new

        self.keys = [grown(k) for k in self.keys]
        self.values = [grown(v) for v in self.values]
        return self.blocks - before


class KVBlockPool:
    """The KV blocks the batch shares: `total` of them, *reserved* by admitted generations
    (admission), *used* as their caches are allocated and grow (used <= reserved per lease).
    Thread-safe: the scheduler reserves, the engine allocates, the metrics read."""

    def __init__(self, total_blocks: int, block_bytes: int) -> None:
        if total_blocks < 1:
            raise ValueError(f"a KV block pool needs at least one block, got {total_blocks}")
        self.total = total_blocks
        self.block_bytes = block_bytes
        self._reserved = 0
        self._used = 0
        self._lock = threading.Lock()

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def used(self) -> int:
        return self._used

    @property
    def free(self) -> int:
        """Blocks a new generation can still reserve."""
        return max(0, self.total - self._reserved)

    def try_reserve(self, blocks: int) -> bool:
        with self._lock:
            if self._reserved + blocks > self.total:
                return False
            self._reserved += blocks
            return True

    def force_reserve(self, blocks: int) -> None:
        """Reserve past the bound: a warm-up step or a direct engine call, outside admission
        (the batch is held while it runs, so it borrows at most one generation's blocks)."""
        with self._lock:
            self._reserved += blocks

    def _change(self, reserved: int, used: int) -> None:
        with self._lock:
            self._reserved += reserved
            self._used += used

    def lease(self) -> KVLease:
        return KVLease(self)


class KVExhausted(RequestError):
    """A bounded lease's cache had to grow past the blocks reserved for it and the pool had none."""


class KVLease:
    """The blocks one generation holds: reserved (ahead of its next step when `bounded`, by the
    scheduler; borrowed past the bound otherwise), used as its cache is allocated or grown,
    all given back by `release` (in the generation's `finally`, however it ends)."""

    def __init__(self, pool: KVBlockPool) -> None:
        self._pool = pool
        self.reserved = 0
        self.used = 0
        #: Under the scheduler: growth past the reserved blocks must find them free in the pool.
        self.bounded = False

    def try_reserve(self, blocks: int) -> bool:
        if not self._pool.try_reserve(blocks):
            return False
        self.reserved += blocks
        return True

    def force_reserve(self, blocks: int) -> None:
        self._pool.force_reserve(blocks)
        self.reserved += blocks

    def _use(self, blocks: int) -> None:
        self.used += blocks
        self._pool._change(0, blocks)

    def hold(self, cache: KVCache) -> KVCache:
        self._use(cache.blocks)
        return cache

    def cover(self, blocks: int) -> bool:
        """Hold at least `blocks` reserved in all: reserve the difference (past the bound when
        not `bounded`); False when a bounded lease cannot."""
        extra = blocks - self.reserved
        if extra <= 0:
            return True
        if self.bounded:
            return self.try_reserve(extra)
        self.force_reserve(extra)
        return True

    def grow(self, cache: KVCache, needed: int, limit: int) -> None:
        """Grow the cache to hold `needed` positions: by the amortised quarter when the blocks
        for it can be covered, else by exactly the blocks needed; KVExhausted when not even those."""
        if needed <= cache.capacity:
            return
        amortised = kv_capacity(needed, cache.capacity, limit)
        exact = blocks_for(needed) * KV_BLOCK_TOKENS
        for size in (amortised, exact):
            if self.cover(cache.rows * blocks_for(size)):
                self._use(cache.ensure(needed, limit, size))
                return
        raise KVExhausted(f"the KV cache is full: no block left to grow a generation to {needed} positions "
                          f"(--kv-cache-bytes holds {self._pool.total} blocks)")

    def release(self) -> None:
        self._pool._change(-self.reserved, -self.used)
        self.reserved = 0
        self.used = 0
