"""Tiny random-weight Llama-family checkpoints in the Hugging Face layout, for fast tests.

A few layers and a small hidden size, any dtype, tied or untied head, with or without
attention biases (Llama's `attention_bias` or Qwen2's q/k/v biases), one file or sharded
with an index -- everything written the way real exports are: `safetensors.torch.save_file`,
config.json (loadable by transformers too), generation_config.json and a real byte-level
BPE tokenizer.json built with `tokenizers` (the 256 byte symbols plus special tokens, no
merges: every string encodes, and it costs nothing to build).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_tokenizer_json(path: Path) -> int:
    """Write a byte-level BPE tokenizer.json; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path))
    return len(vocab)


def make_tiny_llama(
    dest: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int = 272,
    tie: bool = False,
    qkv_bias: bool = False,
    model_type: str = "llama",
    dtype: str = "float32",
    shards: int = 1,
    seed: int = 0,
    max_position_embeddings: int = 256,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    std: float = 0.15,
    poison_layers: tuple[int, ...] = (),
    poison_value: float = float("nan"),
    poison_tokens: tuple[int, ...] = (),
    with_eos: bool = True,
) -> Path:
    """Write a tiny checkpoint to `dest` (created) and return it.

    `std` is large on purpose: with the usual 0.02 a random model's logits are almost
    flat, so greedy decoding would hinge on rounding noise and dtype comparisons flake.
    `poison_layers`: these layers' ``mlp.down_proj.weight`` gets one element set to
    `poison_value` (NaN by default, or an infinity), as a corrupt export would carry.
    `poison_tokens`: these tokens' embedding rows get one element set to `poison_value`, so
    only a prompt holding one of them meets non-finite logits.
    `with_eos=False` declares no EOS token (as some base models do): a completion then always
    runs to max_tokens, so a test decides how long a generation lasts.
    """
    import torch

    dest.mkdir(parents=True, exist_ok=True)
    tokenizer_vocab = build_tokenizer_json(dest / "tokenizer.json")
    if vocab_size < tokenizer_vocab:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {tokenizer_vocab}")
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = std) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch_dtype)

    def norm(size: int) -> torch.Tensor:
        return (1.0 + torch.randn(size, generator=gen) * 0.1).to(torch_dtype)

    llama_bias = qkv_bias and model_type != "qwen2"
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab_size, hidden, scale=1.0)}
    for i in range(layers):
        tensors |= _layer_weights(f"model.layers.{i}.", rand, norm, (hidden, heads, kv_heads, intermediate),
                                  qkv_bias or model_type == "qwen2", llama_bias)
    for i in poison_layers:
        tensors[f"model.layers.{i}.mlp.down_proj.weight"][0, 0] = poison_value
    for token in poison_tokens:
        tensors["model.embed_tokens.weight"][token, 0] = poison_value
    tensors["model.norm.weight"] = norm(hidden)
    if not tie:
        tensors["lm_head.weight"] = rand(vocab_size, hidden)

    eos: int | None = SPECIAL_TOKENS.index("<|im_end|>") if with_eos else None
    bos = SPECIAL_TOKENS.index("<|im_start|>")
    config = _config(model_type, (vocab_size, hidden, intermediate, layers, heads, kv_heads),
                     max_position_embeddings, rope_theta, rope_scaling, tie, dtype, (bos, eos), llama_bias)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dest / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2) + "\n"
    )

    _save_shards(dest, tensors, shards)
    return dest



def _config(model_type: str, sizes: tuple[int, int, int, int, int, int], max_position_embeddings: int,
            rope_theta: float, rope_scaling: dict[str, Any] | None, tie: bool, dtype: str,
            special: tuple[int, int | None], llama_bias: bool) -> dict[str, Any]:
    """The checkpoint's config.json; ``sizes``: vocab, hidden, intermediate, layers, heads, kv heads."""
    vocab_size, hidden, intermediate, layers, heads, kv_heads = sizes
    bos, eos = special
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    else:
        config["attention_bias"] = llama_bias
        config["mlp_bias"] = False
    return config


def _layer_weights(prefix: str, rand: Callable[..., Any], norm: Callable[[int], Any],
                   sizes: tuple[int, int, int, int], qkv_bias: bool, o_bias: bool) -> dict[str, Any]:
    """One decoder layer's random tensors; ``sizes``: hidden, heads, kv heads, intermediate."""
    hidden, heads, kv_heads, intermediate = sizes
    head_dim = hidden // heads
    tensors = {
        prefix + "input_layernorm.weight": norm(hidden),
        prefix + "post_attention_layernorm.weight": norm(hidden),
        prefix + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        prefix + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        prefix + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        prefix + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
    }
    if qkv_bias:
        tensors[prefix + "self_attn.q_proj.bias"] = rand(heads * head_dim)
        tensors[prefix + "self_attn.k_proj.bias"] = rand(kv_heads * head_dim)
        tensors[prefix + "self_attn.v_proj.bias"] = rand(kv_heads * head_dim)
    if o_bias:
        tensors[prefix + "self_attn.o_proj.bias"] = rand(hidden)
    tensors[prefix + "mlp.gate_proj.weight"] = rand(intermediate, hidden)
    tensors[prefix + "mlp.up_proj.weight"] = rand(intermediate, hidden)
    tensors[prefix + "mlp.down_proj.weight"] = rand(hidden, intermediate)
    return tensors


def _save_shards(dest: Path, tensors: dict[str, Any], shards: int) -> None:
    """The tensors as one safetensors file, or as ``shards`` files with the HF index beside them."""
    from safetensors.torch import save_file

    names = list(tensors)
    if shards <= 1:
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    per = -(-len(names) // shards)
    for s in range(shards):
        shard_name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per : (s + 1) * per]}
        save_file(part, str(dest / shard_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
