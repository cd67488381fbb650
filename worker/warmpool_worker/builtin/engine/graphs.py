"""CUDA graphs of the single-token decode step, one per batch bucket (1/2/4/8).

A batch is padded up to the nearest bucket.  Graphs are captured after every layer is
resident (warm-up calls this only after a FULL warm-up: graphs cost memory); each holds its
own static KV cache of `max_len` positions.  All buckets share one memory pool, so replays
are serialised: a pool's temporaries are only safe when replays do not interleave.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from warmpool_worker.builtin.engine.kv_cache import KVCache
from warmpool_worker.engine_api import RequestError

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8)

#: (tokens [B], positions [B], cache) -> logits [B, V]: the decode step the graph records.
DecodeStep = Callable[[torch.Tensor, torch.Tensor, KVCache], torch.Tensor]


def bucket_for(batch: int, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> int:
    """The smallest bucket that holds this batch (a batch is padded up to it)."""
    for b in sorted(buckets):
        if batch <= b:
            return b
    raise RequestError(f"batch of {batch} exceeds the largest bucket {max(buckets)}")


@dataclass
class DecodeGraph:
    bucket: int
    graph: Any  # torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor
    cache: KVCache
    lock: threading.Lock  # one generation at a time uses a graph (and its cache)

    def try_acquire(self, positions_needed: int) -> bool:
        """Take this graph for a generation that needs this many positions; False if it cannot."""
        return positions_needed <= self.cache.capacity and self.lock.acquire(blocking=False)


class DecodeGraphs:
    def __init__(self, device: torch.device, max_len: int) -> None:
        self.device = device
        self.max_len = max_len
        self._graphs: dict[int, DecodeGraph] = {}
        self._replay_lock = threading.Lock()

    @property
    def buckets(self) -> list[int]:
        return sorted(self._graphs)

    def release(self) -> list[int]:
        """Free every captured graph (and its static cache, in the graph pool); the buckets
        they covered, so a wake can capture the same ones again."""
        buckets = self.buckets
        self._graphs.clear()
        return buckets

    def get(self, bucket: int) -> DecodeGraph | None:
        return self._graphs.get(bucket)

    def replay(self, graph: DecodeGraph, tokens: list[int], positions: list[int]) -> torch.Tensor:
        with self._replay_lock:
            graph.tokens.copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=False)
            graph.positions.copy_(torch.tensor(positions, dtype=torch.long), non_blocking=False)
            graph.graph.replay()
            return graph.logits.clone()

    def capture(self, buckets: Sequence[int], step: DecodeStep,
                new_cache: Callable[[int, int], KVCache]) -> dict[int, float]:
        """Record `step` per bucket (largest first); seconds per bucket.  The caller has made
        every layer resident: a load inside a capture would be recorded, not run."""
        timings: dict[int, float] = {}
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the shared memory pool is then sized once and reused by the smaller ones.
        for bucket in sorted(set(buckets), reverse=True):
            if bucket in self._graphs:
                continue
            started = time.perf_counter()
            with torch.inference_mode():
                tokens = torch.zeros(bucket, dtype=torch.long, device=self.device)
                positions = torch.zeros(bucket, dtype=torch.long, device=self.device)
                cache = new_cache(bucket, self.max_len)
                side = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):  # warm-up runs (lazy kernel init) must precede capture
                    for _ in range(2):
                        step(tokens, positions, cache)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = step(tokens, positions, cache)
                torch.cuda.synchronize(self.device)
            self._graphs[bucket] = DecodeGraph(bucket, graph, tokens, positions, logits, cache, threading.Lock())
            timings[bucket] = time.perf_counter() - started
        return timings
