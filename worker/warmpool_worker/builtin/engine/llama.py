"""LlamaEngine: implements `engine_api.Engine` (plus batched decode and CUDA graphs) for the
Llama family by orchestrating its parts: the layer store (weights), the maths (pure
functions), the KV caches, the warm-prefix store, the decode graphs and the layer heat."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from warmpool_worker.builtin.engine.batch import DEFAULT_CHUNK_TOKENS, BatchRunner, SequenceState, StepOutcome
from warmpool_worker.builtin.engine.decoding import check_prompt, sample
from warmpool_worker.builtin.engine.graphed import generate_on_graph, generate_padded_batch
from warmpool_worker.builtin.engine.graphs import DEFAULT_BATCH_BUCKETS, DecodeGraph, DecodeGraphs
from warmpool_worker.builtin.engine.kv_cache import KV_BLOCK_TOKENS, KVBlockPool, KVCache
from warmpool_worker.builtin.engine.layer_store import LayerStore, Weights
from warmpool_worker.builtin.engine.maths import Model, decode_step, forward
from warmpool_worker.builtin.engine.prefix_kv import PrefixKVStore
from warmpool_worker.checkpoint import Checkpoint, read_generation_eos
from warmpool_worker.defaults import DEFAULT_KV_CACHE_BYTES, DEFAULT_STEP_TOKENS
from warmpool_worker.engine_api import (
    GenerationStep,
    KVBlockStats,
    LayerProgress,
    ModelLoadError,
    NonFiniteLogitsError,
)
from warmpool_worker.layer_heat import DEFAULT_HEAT_HALF_LIFE_S, LayerHeat

#: The wake check's prompt: short, so the check costs one small prefill.
WAKE_CHECK_PROMPT = "Hello"


class LlamaEngine:
    """`engine_api.Engine` (plus `KVCacheStats`, `GraphCapture` and batched decode) for the Llama family."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        tokenizer: Any,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        model_name: str | None = None,
        heat_half_life_s: float = DEFAULT_HEAT_HALF_LIFE_S,
        clock: Callable[[], float] = time.monotonic,
        graph_max_len: int = 2048,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        self.checkpoint = checkpoint
        self.config = cfg = checkpoint.config
        self.tokenizer = tokenizer
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype or torch.float32
        self._model_name = model_name or checkpoint.model_dir.resolve().name
        self.eos_token_ids = frozenset(read_generation_eos(checkpoint.model_dir, cfg))
        self._model = Model.build(cfg, self.dtype, self._device)
        self.weights = LayerStore(checkpoint, self._device, self.dtype)
        self.heat = LayerHeat(cfg.num_hidden_layers, heat_half_life_s, clock)
        self.prefix_kv = PrefixKVStore(cfg, self.dtype, self._device, lambda: self.model_digest)
        self.graph_max_len = min(graph_max_len, cfg.max_position_embeddings)
        self.graphs = DecodeGraphs(self._device, self.graph_max_len)
        self._sample_generator = torch.Generator(device="cpu")
        self._sample_generator.seed()
        self.kv_pool = KVBlockPool(self._kv_blocks_within(kv_cache_bytes), self._kv_block_bytes())
        self.batch = BatchRunner(self._model, self.weights.core, self._layer_in_use, self.kv_pool, self.new_cache,
                                 self.prefix_kv, self.decode, lambda: self.eos_token_ids, self._explain_non_finite,
                                 self._sample_generator, chunk_tokens)
        self._sleep_level: int | None = None
        self._graphs_before_sleep: list[int] = []

    def _kv_block_bytes(self) -> int:
        cfg = self.config
        element = torch.empty((), dtype=self.dtype).element_size()
        return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * KV_BLOCK_TOKENS * element

    def _kv_blocks_within(self, kv_cache_bytes: int) -> int:
        blocks = kv_cache_bytes // self._kv_block_bytes()
        if blocks < 1:
            raise ModelLoadError(f"--kv-cache-bytes {kv_cache_bytes} holds no KV block of this model "
                                 f"({self._kv_block_bytes()} bytes for {KV_BLOCK_TOKENS} positions)")
        return int(blocks)

    # ---- identity ------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def model_digest(self) -> str:
        return self.checkpoint.digest

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    @property
    def device(self) -> str:
        return str(self._device)

    # ---- weights -------------------------------------------------------------------------
    @property
    def bytes_loaded(self) -> int:
        return self.weights.bytes_loaded

    @property
    def load_seconds(self) -> dict[int, float]:
        return self.weights.load_seconds

    def layers_resident(self) -> int:
        return self.weights.layers_resident()

    def is_layer_resident(self, index: int) -> bool:
        return self.weights.is_layer_resident(index)

    def load_layers(self, order: Sequence[int], progress: LayerProgress | None = None) -> None:
        self.weights.load_layers(order, progress)

    def load_all(self, progress: LayerProgress | None = None) -> None:
        self.load_layers(range(self.num_layers), progress)

    def layer_heat(self) -> dict[int, float]:
        return self.heat.snapshot()

    def _layer_in_use(self, index: int) -> Weights:
        """A forward pass reaching this layer: loaded if it is not yet, and counted as heat."""
        weights = self.weights.layer(index)
        self.heat.touch(index)
        return weights

    # ---- tokenizer -----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    # ---- forward passes ------------------------------------------------------------------
    def _forward(self, token_ids: torch.Tensor, start: int, cache: KVCache, all_logits: bool = False
                 ) -> torch.Tensor:
        core = self.weights.core()
        return forward(self._model, core, self._layer_in_use, token_ids, start, cache, all_logits)

    def decode_static(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return decode_step(self._model, self.weights.core(), self._layer_in_use, tokens, positions, cache)

    def long_tensor(self, values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self._device)

    def checked_prompt(self, token_ids: Sequence[int]) -> list[int]:
        return check_prompt(token_ids, self.max_context, self.config.vocab_size)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        cfg = self.config
        return KVCache.empty(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, cfg.head_dim,
                             self.dtype, self._device)

    def forward_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, vocab] for every position of one prompt (tests and evaluation)."""
        ids = self.checked_prompt(token_ids)
        with torch.inference_mode():
            return self._forward(self.long_tensor([ids]), 0, self.new_cache(1, len(ids)), all_logits=True)[0]

    def prefill(self, token_ids: Sequence[int]) -> None:
        ids = self.checked_prompt(token_ids)
        with torch.inference_mode():
            logits = self._forward(self.long_tensor([ids]), 0, self.new_cache(1, len(ids)))
            self.check_finite(logits, f"at the prefill of a {len(ids)}-token prompt")

    def prefill_into(self, ids: list[int], cache: KVCache) -> torch.Tensor:
        start = self.prefix_kv.seed(ids, cache)  # a stored warm prefix skips its positions
        return self._forward(self.long_tensor([ids[start:]]), start, cache)

    def check_finite(self, logits: torch.Tensor, where: str) -> None:
        """Raise NonFiniteLogitsError if any logit is NaN/Inf: never sample from garbage.

        One reduction over [B, V] per step (the sampler syncs on the same values anyway).
        """
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogitsError(self._explain_non_finite(where))

    def _explain_non_finite(self, where: str) -> str:
        """The message of a NonFiniteLogitsError: the model, where, and the weight to blame."""
        culprit = self.weights.first_non_finite()
        cause = (f"weight {culprit} holds NaN/Inf" if culprit is not None
                 else f"no resident weight holds NaN/Inf: activations overflowed in {self.dtype}")
        return f"model {self.model_name!r} produced non-finite logits (NaN/Inf) {where}: {cause}"

    # ---- generation ----------------------------------------------------------------------
    def kv_cache_tokens(self) -> int:
        """Token slots allocated now for the KV caches of generations in flight (CUDA graphs'
        static caches, sized once at capture, are not counted)."""
        return self.kv_pool.used * KV_BLOCK_TOKENS

    def kv_blocks(self) -> KVBlockStats:
        pool = self.kv_pool
        return KVBlockStats(pool.total, pool.used, pool.reserved, pool.free, KV_BLOCK_TOKENS)

    def sample_tokens(self, logits: torch.Tensor, temperature: float) -> list[int]:
        return sample(logits, temperature, self._sample_generator)

    def take_graph(self, bucket: int, positions: int) -> DecodeGraph | None:
        graph = self.graphs.get(bucket)
        return graph if graph is not None and graph.try_acquire(positions) else None

    def replay_graph(self, graph: DecodeGraph, tokens: list[int], positions: list[int]) -> torch.Tensor:
        logits = self.graphs.replay(graph, tokens, positions)
        self.heat.touch_all()  # the graph skips Python, so count the heat here
        return logits

    # ---- continuous batching (`engine_api.BatchingEngine`; the scheduler drives it) ---------
    def open_sequence(self, token_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0
                      ) -> SequenceState:
        return self.batch.open(token_ids, max_new_tokens, temperature)

    def step(self, sequences: Sequence[SequenceState]) -> list[StepOutcome]:
        return self.batch.step(sequences)

    def close_sequence(self, sequence: SequenceState) -> None:
        self.batch.close(sequence)

    def next_tokens(self, sequence: SequenceState, after: int = 0) -> int:
        return self.batch.next_tokens(sequence, after)

    def blocks_wanted(self, sequence: SequenceState) -> int:
        return self.batch.blocks_wanted(sequence)

    def preempt_sequence(self, sequence: SequenceState) -> None:
        self.batch.preempt(sequence)

    def generate(self, token_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 ) -> Iterator[GenerationStep]:
        """One generation on its own: a batch of one (the same steps as served), or the
        single-row CUDA graph when one is captured."""
        sequence = self.batch.open(token_ids, max_new_tokens, temperature)
        graph = self.take_graph(1, sequence.limit)
        if graph is not None:
            return generate_on_graph(self, sequence, graph)
        return self._generate_alone(sequence)

    def _generate_alone(self, sequence: SequenceState) -> Iterator[GenerationStep]:
        try:
            while not sequence.finished:  # the steps the scheduler would take for it alone
                chunks = self.batch.chunks_within(sequence, DEFAULT_STEP_TOKENS)
                for outcome in self.batch.step([sequence] * chunks):
                    if outcome.error is not None:
                        raise outcome.error
                    if outcome.step is not None:
                        yield outcome.step
        finally:
            self.batch.close(sequence)

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                       buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> list[list[int]]:
        """Decode several prompts together, padded up to a batch bucket (CUDA graph when captured);
        the generated ids of each prompt (EOS included when one stopped it)."""
        return generate_padded_batch(self, prompts, max_new_tokens, temperature, buckets)

    # ---- CUDA graphs ---------------------------------------------------------------------
    def capture_graphs(self, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> dict[int, float]:
        """Capture the decode step as a CUDA graph per batch bucket; seconds per bucket.

        Needs every layer resident (they are loaded first).  A no-op returning {} off CUDA.
        """
        if self._device.type != "cuda" or not torch.cuda.is_available():
            return {}
        self.load_all()
        return self.graphs.capture(buckets, self.decode_static, self.new_cache)

    @property
    def graph_buckets(self) -> list[int]:
        return self.graphs.buckets

    # ---- sleep (vLLM's levels; what each frees: layer_store's docstring) -------------------
    @property
    def sleep_level(self) -> int | None:
        """The level this engine sleeps at, or None when awake."""
        return self._sleep_level

    def sleep(self, level: int) -> None:
        """Free memory until `wake`: prefix KV and CUDA graphs (with their static KV caches)
        always, then the weights as `LayerStore.release` says for `level`.  The caller holds
        the engine gate with the batch drained, so no generation (and no live KV cache) is in flight."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self._sleep_level is not None:
            return
        self._graphs_before_sleep = self.graphs.release()
        self.prefix_kv.forget()
        self.weights.release(level)
        self._sleep_level = level

    def wake(self) -> None:
        """Weights back, graphs re-captured if they were before, then a one-prompt check: a
        prefill whose logits must be finite (NonFiniteLogitsError otherwise) before awake."""
        if self._sleep_level is None:
            return
        self.weights.restore()
        if self._graphs_before_sleep:
            self.graphs.capture(self._graphs_before_sleep, self.decode_static, self.new_cache)
            self._graphs_before_sleep = []
        self.prefill(self.encode(WAKE_CHECK_PROMPT) or [0])
        self._sleep_level = None

    # ---- warm prefix KV ------------------------------------------------------------------
    def save_prefix_kv(self, token_ids: Sequence[int], path: Path) -> None:
        """Persist this prefix's KV; a filesystem failure (ENOSPC, EROFS, ...) raises OSError
        with its errno, and leaves no partial file behind."""
        ids = self.checked_prompt(token_ids)
        with torch.inference_mode():
            cache = self.new_cache(1, len(ids))
            self._forward(self.long_tensor([ids]), 0, cache)
        self.prefix_kv.save(ids, cache, path)

    def load_prefix_kv(self, token_ids: Sequence[int], path: Path) -> bool:
        return self.prefix_kv.load(self.checked_prompt(token_ids), path)
