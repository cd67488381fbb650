"""Generation outside the continuous batch, for the engine's own paths: one sequence on the
CUDA graph it holds (`LlamaEngine.generate` when a single-row graph is captured), and a padded
static batch (`LlamaEngine.generate_batch`: warm-up, benchmarks, the GPU check) on a bucket's
graph or the eager decode step.  Both run on the engine's steps (prefill, sampling, replay)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from warmpool_worker.builtin.engine.batch import SequenceState
from warmpool_worker.builtin.engine.decoding import check_generation, text_increment
from warmpool_worker.builtin.engine.graphs import DecodeGraph, bucket_for
from warmpool_worker.builtin.engine.kv_cache import KVBlockPool, KVCache, blocks_for, kv_capacity
from warmpool_worker.engine_api import GenerationStep, RequestError


class EngineSteps(Protocol):
    """What these paths use of the engine (`LlamaEngine`): its limits and its steps."""

    eos_token_ids: frozenset[int]
    kv_pool: KVBlockPool

    @property
    def max_context(self) -> int: ...
    def decode(self, token_ids: Sequence[int]) -> str: ...
    def checked_prompt(self, token_ids: Sequence[int]) -> list[int]: ...
    def new_cache(self, batch: int, capacity: int) -> KVCache: ...
    def long_tensor(self, values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor: ...
    def prefill_into(self, ids: list[int], cache: KVCache) -> torch.Tensor: ...
    def decode_static(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor: ...
    def check_finite(self, logits: torch.Tensor, where: str) -> None: ...
    def sample_tokens(self, logits: torch.Tensor, temperature: float) -> list[int]: ...
    def take_graph(self, bucket: int, positions: int) -> DecodeGraph | None: ...
    def replay_graph(self, graph: DecodeGraph, tokens: list[int], positions: list[int]) -> torch.Tensor: ...


def generate_on_graph(engine: EngineSteps, sequence: SequenceState, graph: DecodeGraph) -> Iterator[GenerationStep]:
    """One sequence decoded on the single-row CUDA graph it holds (released at the end)."""
    ids, budget, temperature = sequence.ids, sequence.budget, sequence.temperature
    try:
        with torch.inference_mode():
            logits = engine.prefill_into(ids, graph.cache)  # the graph's static cache
        engine.check_finite(logits, f"at the prefill of a {len(ids)}-token prompt")
        generated: list[int] = []
        emitted = ""
        position = len(ids)
        while True:
            token = engine.sample_tokens(logits, temperature)[0]
            generated.append(token)
            if token in engine.eos_token_ids:
                yield GenerationStep(token, "", True, "stop")
                return
            final = len(generated) >= budget
            text, emitted = text_increment(engine.decode, generated, emitted, final)
            if final:
                yield GenerationStep(token, text, True, "length")
                return
            yield GenerationStep(token, text, False)
            with torch.inference_mode():
                logits = engine.replay_graph(graph, [token], [position])
            engine.check_finite(logits, f"at decode step {len(generated)}")
            position += 1
    finally:
        graph.lock.release()


def generate_padded_batch(engine: EngineSteps, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          temperature: float, buckets: Sequence[int]) -> list[list[int]]:
    """Several prompts decoded together, padded up to a batch bucket: on the bucket's CUDA graph
    when one is captured, else with the eager decode step; the generated ids of each prompt."""
    if not prompts:
        return []
    checked = [engine.checked_prompt(p) for p in prompts]
    check_generation(max_new_tokens, temperature)
    bucket = bucket_for(len(checked), buckets)
    longest = max(len(p) for p in checked)
    if longest >= engine.max_context:
        raise RequestError(f"a prompt of {longest} tokens leaves no room in the context of {engine.max_context}")
    budget = min(max_new_tokens, engine.max_context - longest)
    limit = longest + budget
    graph = engine.take_graph(bucket, limit)
    lease = engine.kv_pool.lease()
    if graph is None:
        lease.force_reserve(bucket * blocks_for(limit))
    try:
        with torch.inference_mode():
            cache = graph.cache if graph is not None else lease.hold(
                engine.new_cache(bucket, kv_capacity(longest, 0, limit)))
            logits = torch.cat([engine.prefill_into(p, cache.row(r)) for r, p in enumerate(checked)], dim=0)
            outputs: list[list[int]] = [[] for _ in checked]
            done = [False] * len(checked)
            positions = [len(p) for p in checked]
            pad = [0] * (bucket - len(checked))
            for step_index in range(budget):
                engine.check_finite(logits, f"at batch step {step_index}")
                tokens = engine.sample_tokens(logits, temperature)
                for r, token in enumerate(tokens):
                    if not done[r]:
                        outputs[r].append(token)
                        done[r] = token in engine.eos_token_ids or len(outputs[r]) >= budget
                if all(done):
                    break
                # pad rows (and finished ones) decode token 0 at position 0 of their own row:
                # harmless, their output is ignored, and shapes stay those of the bucket.
                step_tokens = [t if not d else 0 for t, d in zip(tokens, done, strict=True)] + pad
                step_pos = [p if not d else 0 for p, d in zip(positions, done, strict=True)] + pad
                if graph is not None:
                    logits = engine.replay_graph(graph, step_tokens, step_pos)[: len(checked)]
                else:
                    lease.grow(cache, max(positions) + 1, limit)
                    logits = engine.decode_static(engine.long_tensor(step_tokens), engine.long_tensor(step_pos),
                                                 cache)[: len(checked)]
                positions = [p + 1 for p in positions]
            return outputs
    finally:
        lease.release()
        if graph is not None:
            graph.lock.release()
