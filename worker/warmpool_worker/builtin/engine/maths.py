"""The Llama-family decoder's maths as pure functions of weights, inputs and a KV cache.

Follows transformers' LlamaForCausalLM op for op (RMSNorm in fp32, rotary tables in fp32
cast to the activation dtype, SDPA), so logits agree within dtype tolerance; transformers
itself is never imported (its import alone costs seconds of cold start).  Nothing here
holds state: the weights come from a `layer(index)` callable (which may load on first use),
and the only writes are into the KV cache passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from warmpool_worker.builtin.engine.kv_cache import KVCache
from warmpool_worker.builtin.engine.linear import linear
from warmpool_worker.checkpoint import LlamaConfig

Weights = Mapping[str, torch.Tensor]
LayerWeights = Callable[[int], Weights]


def rope_inv_freq(config: LlamaConfig) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling, as transformers' ROPE_INIT_FUNCTIONS compute them."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    # llama3: long wavelengths scaled down by `factor`, short ones kept, a smooth ramp between.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama), 1.0


@dataclass(frozen=True)
class Model:
    """What the maths needs besides the weights: the config, the compute dtype and device,
    and the rotary frequencies (on the device)."""

    config: LlamaConfig
    dtype: torch.dtype
    device: torch.device
    inv_freq: torch.Tensor
    attention_scaling: float

    @classmethod
    def build(cls, config: LlamaConfig, dtype: torch.dtype, device: torch.device) -> Model:
        inv_freq, scaling = rope_inv_freq(config)
        return cls(config, dtype, device, inv_freq.to(device), scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


def rope(model: Model, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, T, head_dim] for positions [B, T], computed in fp32 like transformers."""
    freqs = positions.to(torch.float32)[..., None] * model.inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * model.attention_scaling).to(model.dtype)
    sin = (emb.sin() * model.attention_scaling).to(model.dtype)
    return cos[:, None], sin[:, None]


def qkv(config: LlamaConfig, w: Weights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, t, _ = x.shape
    q = linear(x, w["wq"], w.get("bq")).view(b, t, config.num_attention_heads, config.head_dim).transpose(1, 2)
    k = linear(x, w["wk"], w.get("bk")).view(b, t, config.num_key_value_heads, config.head_dim).transpose(1, 2)
    v = linear(x, w["wv"], w.get("bv")).view(b, t, config.num_key_value_heads, config.head_dim).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    return q, k, v


def attention(config: LlamaConfig, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """SDPA of q [B, H, T, D] over keys/values [B, KVH, S, D]: [B, H, T, D]."""
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, is_causal=causal, scale=config.head_dim**-0.5,
        enable_gqa=config.num_attention_heads > config.num_key_value_heads,
    )


def attend(config: LlamaConfig, w: Weights, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    b, _, t, _ = q.shape
    out = attention(config, q, keys, values, mask, causal)
    out = out.transpose(1, 2).reshape(b, t, config.num_attention_heads * config.head_dim)
    return linear(out, w["wo"], w.get("bo"))


def chunk_mask(start: int, length: int, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for `length` new positions after `start` cached ones: causal from the
    first position (SDPA's own flag), shifted by `start` after a cached prefix, none for one token."""
    if length > 1 and start == 0:
        return None, True
    if length > 1:
        mask = (torch.arange(start + length, device=device)[None, :]
                <= torch.arange(start, start + length, device=device)[:, None])
        return mask, False
    return None, False


def mlp(w: Weights, x: torch.Tensor) -> torch.Tensor:
    gate = linear(x, w["w_gate"], w.get("b_gate"))
    up = linear(x, w["w_up"], w.get("b_up"))
    return linear(F.silu(gate) * up, w["w_down"], w.get("b_down"))


def forward(model: Model, core: Weights, layer: LayerWeights, token_ids: torch.Tensor, start: int,
            cache: KVCache, all_logits: bool = False) -> torch.Tensor:
    """Contiguous positions start..start+T for every row; writes K/V into the cache.

    Returns logits [B, T, V] when all_logits else [B, V] for the last position.
    """
    cfg, device = model.config, model.device
    b, t = token_ids.shape
    positions = torch.arange(start, start + t, device=device).expand(b, t)
    cos, sin = rope(model, positions)
    x = F.embedding(token_ids, core["embed"])
    mask, causal = chunk_mask(start, t, device)
    for index in range(cfg.num_hidden_layers):
        w = layer(index)
        h = rms_norm(x, w["ln1"], cfg.rms_norm_eps)
        q, k, v = qkv(cfg, w, h, cos, sin)
        cache.keys[index][:, :, start : start + t] = k
        cache.values[index][:, :, start : start + t] = v
        keys = cache.keys[index][:, :, : start + t]
        values = cache.values[index][:, :, : start + t]
        x = x + attend(cfg, w, q, keys, values, mask, causal)
        x = x + mlp(w, rms_norm(x, w["ln2"], cfg.rms_norm_eps))
    x = rms_norm(x if all_logits else x[:, -1:], core["norm"], cfg.rms_norm_eps)
    logits = linear(x, core["head"])
    return logits if all_logits else logits[:, -1]


def decode_step(model: Model, core: Weights, layer: LayerWeights, tokens: torch.Tensor, positions: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
    """One token per row at per-row positions into a fixed-size cache: the CUDA-graph body.

    Only tensor ops with shapes fixed by the bucket, so the same code replays as a graph.
    """
    cfg, device = model.config, model.device
    b = tokens.shape[0]
    capacity = cache.capacity
    cos, sin = rope(model, positions[:, None])
    x = F.embedding(tokens[:, None], core["embed"])
    mask = (torch.arange(capacity, device=device)[None, :] <= positions[:, None]).view(b, 1, 1, capacity)
    scatter_index = positions.view(b, 1, 1, 1).expand(b, cfg.num_key_value_heads, 1, cfg.head_dim)
    for index in range(cfg.num_hidden_layers):
        w = layer(index)
        h = rms_norm(x, w["ln1"], cfg.rms_norm_eps)
        q, k, v = qkv(cfg, w, h, cos, sin)
        cache.keys[index].scatter_(2, scatter_index, k)
        cache.values[index].scatter_(2, scatter_index, v)
        x = x + attend(cfg, w, q, cache.keys[index], cache.values[index], mask, False)
        x = x + mlp(w, rms_norm(x, w["ln2"], cfg.rms_norm_eps))
    return linear(rms_norm(x[:, -1], core["norm"], cfg.rms_norm_eps), core["head"])


@dataclass(frozen=True)
class Segment:
    """Positions start..start+len(tokens) of one sequence, its K/V written into its own cache
    (batch dim 1); `logits`: whether the step needs the logits of its last position."""

    tokens: Sequence[int]
    start: int
    cache: KVCache
    logits: bool


def forward_segments(model: Model, core: Weights, layer: LayerWeights, segments: Sequence[Segment]) -> torch.Tensor:
    """One step of a batch whose sequences stand at different positions (prefill chunks and
    single decode tokens mixed): logits [S, V] for the segments that ask for them, in order.

    Every token of every segment goes through the projections and the MLP as one matrix (the
    weights are read once per step, whatever the batch), attention runs per segment over its
    own cache.  A single segment computes exactly what `forward` does for it.
    """
    cfg, device = model.config, model.device
    lengths = [len(s.tokens) for s in segments]
    flat = torch.tensor([t for s in segments for t in s.tokens], dtype=torch.long, device=device)[None]
    positions = torch.cat([torch.arange(s.start, s.start + n, device=device)
                           for s, n in zip(segments, lengths, strict=True)])[None]
    cos, sin = rope(model, positions)
    x = F.embedding(flat, core["embed"])
    masks = [chunk_mask(s.start, n, device) for s, n in zip(segments, lengths, strict=True)]
    total = flat.shape[1]
    for index in range(cfg.num_hidden_layers):
        w = layer(index)
        h = rms_norm(x, w["ln1"], cfg.rms_norm_eps)
        q, k, v = qkv(cfg, w, h, cos, sin)
        outs: list[torch.Tensor] = []
        offset = 0
        for segment, n, (mask, causal) in zip(segments, lengths, masks, strict=True):
            start, end = segment.start, segment.start + n
            keys, values = segment.cache.keys[index], segment.cache.values[index]
            keys[:, :, start:end] = k[:, :, offset : offset + n]
            values[:, :, start:end] = v[:, :, offset : offset + n]
            outs.append(attention(cfg, q[:, :, offset : offset + n], keys[:, :, :end], values[:, :, :end],
                                  mask, causal))
            offset += n
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        out = out.transpose(1, 2).reshape(1, total, cfg.num_attention_heads * cfg.head_dim)
        x = x + linear(out, w["wo"], w.get("bo"))
        x = x + mlp(w, rms_norm(x, w["ln2"], cfg.rms_norm_eps))
    ends = [sum(lengths[: i + 1]) - 1 for i, s in enumerate(segments) if s.logits]
    if not ends:
        return torch.empty((0, cfg.vocab_size), dtype=x.dtype, device=device)
    last = x[0, ends] if len(ends) > 1 else x[0, ends[0] :][:1]
    return linear(rms_norm(last, core["norm"], cfg.rms_norm_eps), core["head"])
