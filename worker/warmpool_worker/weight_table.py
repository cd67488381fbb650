"""Which tensors a Llama-family checkpoint holds, under which names, with which shapes.

One table per architecture drives both sides: `checkpoint.open_checkpoint` validates a
checkpoint against it (every tensor present, none unexpected, every shape right) and the
engine's layer store loads exactly its tensors, by the same names.  Torch-free and cheap.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from warmpool.contract.files import OUTPUT_HEAD_TENSOR

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = OUTPUT_HEAD_TENSOR


class ModelLayout(Protocol):
    """The config.json sizes and switches that decide the table (`checkpoint.LlamaConfig` has them)."""

    @property
    def model_type(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def attention_bias(self) -> bool: ...
    @property
    def o_bias(self) -> bool: ...
    @property
    def mlp_bias(self) -> bool: ...


@dataclass(frozen=True)
class WeightSpec:
    """One tensor: the engine's short key for it, its checkpoint name (for a decoder layer,
    the part after ``model.layers.N.``) and its shape."""

    key: str
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WeightTable:
    """The non-layer tensors (embeddings, final norm, untied head) and one decoder layer's."""

    core: tuple[WeightSpec, ...]
    layer: tuple[WeightSpec, ...]
    num_layers: int
    tied_head: bool  # the head is the embedding matrix: no lm_head.weight needed

    @staticmethod
    def layer_prefix(index: int) -> str:
        return f"model.layers.{index}."

    def core_names(self) -> list[tuple[str, str]]:
        """(key, checkpoint name) of every non-layer tensor, in load order."""
        return [(spec.key, spec.name) for spec in self.core]

    def layer_names(self, index: int) -> list[tuple[str, str]]:
        """(key, checkpoint name) of every tensor of decoder layer `index`, in load order."""
        prefix = self.layer_prefix(index)
        return [(spec.key, prefix + spec.name) for spec in self.layer]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model needs, by checkpoint name, with its shape."""
        out = {spec.name: spec.shape for spec in self.core}
        for index in range(self.num_layers):
            prefix = self.layer_prefix(index)
            out.update({prefix + spec.name: spec.shape for spec in self.layer})
        return out

    def parameters(self) -> int:
        """Weight elements the model needs, by arithmetic (no per-layer table built)."""
        def count(specs: tuple[WeightSpec, ...]) -> int:
            return sum(math.prod(spec.shape) for spec in specs)

        return count(self.core) + self.num_layers * count(self.layer)


def llama_weight_table(config: ModelLayout) -> WeightTable:
    """Llama 2/3, SmolLM2, Mistral and Qwen2 share this layout; biases follow the config
    (Llama's ``attention_bias`` covers q/k/v/o, Qwen2 has q/k/v biases only, ``mlp_bias``)."""
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    core = [WeightSpec("embed", EMBED, (v, h)), WeightSpec("norm", FINAL_NORM, (h,))]
    if not config.tie_word_embeddings:
        core.append(WeightSpec("head", LM_HEAD, (v, h)))
    layer = [
        WeightSpec("ln1", "input_layernorm.weight", (h,)),
        WeightSpec("ln2", "post_attention_layernorm.weight", (h,)),
        WeightSpec("wq", "self_attn.q_proj.weight", (q_out, h)),
        WeightSpec("wk", "self_attn.k_proj.weight", (kv_out, h)),
        WeightSpec("wv", "self_attn.v_proj.weight", (kv_out, h)),
        WeightSpec("wo", "self_attn.o_proj.weight", (h, q_out)),
    ]
    if config.attention_bias:
        layer += [WeightSpec("bq", "self_attn.q_proj.bias", (q_out,)),
                  WeightSpec("bk", "self_attn.k_proj.bias", (kv_out,)),
                  WeightSpec("bv", "self_attn.v_proj.bias", (kv_out,))]
    if config.o_bias:
        layer.append(WeightSpec("bo", "self_attn.o_proj.bias", (h,)))
    layer += [
        WeightSpec("w_gate", "mlp.gate_proj.weight", (i, h)),
        WeightSpec("w_up", "mlp.up_proj.weight", (i, h)),
        WeightSpec("w_down", "mlp.down_proj.weight", (h, i)),
    ]
    if config.mlp_bias:
        layer += [WeightSpec("b_gate", "mlp.gate_proj.bias", (i,)),
                  WeightSpec("b_up", "mlp.up_proj.bias", (i,)),
                  WeightSpec("b_down", "mlp.down_proj.bias", (h,))]
    return WeightTable(tuple(core), tuple(layer), config.num_hidden_layers, config.tie_word_embeddings)


#: model_type -> its table.  The three supported types share the Llama layout today; a new
#: architecture adds its own builder here and both validation and loading follow it.
WEIGHT_TABLES: dict[str, Callable[[ModelLayout], WeightTable]] = {
    "llama": llama_weight_table,
    "mistral": llama_weight_table,
    "qwen2": llama_weight_table,
}


def weight_table(config: ModelLayout) -> WeightTable:
    builder = WEIGHT_TABLES.get(config.model_type)
    if builder is None:
        raise ValueError(f"no weight table for model_type {config.model_type!r} "
                         f"(known: {sorted(WEIGHT_TABLES)})")
    return builder(config)
