"""The built-in engine: a Llama-family decoder in plain torch, loaded lazily, hottest layers first.

Covers Llama 2/3 (including llama3 rope scaling), SmolLM2, Mistral without sliding window
and Qwen2 (q/k/v biases), tied or untied heads, grouped-query attention, fp32/fp16/bf16
on CPU or CUDA.  Logits agree with transformers' LlamaForCausalLM within dtype tolerance
(the integration tests check that against transformers itself, which this package never
imports: its import alone costs seconds of cold start).

The parts, one job each:

* ``loader``       -- `load_engine`: validate and map a checkpoint (headers only), read its tokenizer.
* ``llama``        -- `LlamaEngine`: the `engine_api.Engine` the worker serves; orchestrates the rest.
* ``layer_store``  -- the weights: embeddings, decoder layers in the order asked, an untied head last, or on first use;
  on CPU in the checkpoint's dtype a weight is the file's mapping itself (zero copy, pages faulted
  in by ``mapped_pages``), so weight files must be replaced by rename, never rewritten in place.
  On CUDA copies go through ``pinned_stager``.  Tensor names come from ``warmpool_worker.weight_table``,
  the same table that validated the checkpoint.
* ``maths``        -- the decoder's maths as pure functions (prefill chunk, single-token decode step).
* ``kv_cache``     -- KV caches that grow with the tokens generated, and the count of live slots.
* ``prefix_kv``    -- warm prefixes kept in memory and persisted as safetensors.
* ``graphs``       -- CUDA graphs of the decode step per batch bucket (1/2/4/8).
* ``decoding``     -- sampling and streamed-text increments.

Layer heat (decayed access counts) is ``warmpool_worker.layer_heat``, shared with other engines.
"""

from __future__ import annotations

from warmpool_worker.builtin.engine.graphs import DEFAULT_BATCH_BUCKETS, bucket_for
from warmpool_worker.builtin.engine.kv_cache import KV_BLOCK_TOKENS, KVCache, kv_capacity
from warmpool_worker.builtin.engine.llama import LlamaEngine
from warmpool_worker.builtin.engine.loader import DTYPES, load_engine, resolve_dtype
from warmpool_worker.builtin.engine.mapped_pages import fault_in
from warmpool_worker.builtin.engine.maths import rope_inv_freq
from warmpool_worker.builtin.engine.pinned_stager import STAGING_BYTES
from warmpool_worker.builtin.engine.prefix_kv import PREFIX_KV_FORMAT, PREFIX_KV_VERSION, PrefixHit, token_hash
from warmpool_worker.layer_heat import DEFAULT_HEAT_HALF_LIFE_S

__all__ = [
    "DEFAULT_BATCH_BUCKETS",
    "DEFAULT_HEAT_HALF_LIFE_S",
    "DTYPES",
    "KV_BLOCK_TOKENS",
    "PREFIX_KV_FORMAT",
    "PREFIX_KV_VERSION",
    "STAGING_BYTES",
    "KVCache",
    "LlamaEngine",
    "PrefixHit",
    "bucket_for",
    "fault_in",
    "kv_capacity",
    "load_engine",
    "resolve_dtype",
    "rope_inv_freq",
    "token_hash",
]
