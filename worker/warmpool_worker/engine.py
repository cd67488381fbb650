"""The built-in engine: a Llama-family decoder in plain torch, loaded lazily, hottest layers first.

Covers Llama 2/3 (including llama3 rope scaling), SmolLM2, Mistral without sliding window
and Qwen2 (q/k/v biases), tied or untied heads, grouped-query attention, fp32/fp16/bf16
on CPU or CUDA.  The maths follows transformers' LlamaForCausalLM op for op (RMSNorm in
fp32, rotary tables in fp32 cast to the activation dtype, SDPA), so logits agree within
dtype tolerance -- the integration tests check that against transformers itself, which
this module never imports (its import alone costs seconds of cold start).

Loading: `load_engine` validates the checkpoint and maps it (headers only).  Embeddings,
final norm and head are materialised first, then decoder layers in the order given to
`load_layers`; a layer a request needs before the loader got to it is loaded right there,
under the same lock, so a request never sees a missing weight.  On CPU, in the checkpoint's
own dtype, a weight is the file's mapping itself (zero copy): "loading" a layer faults its pages
in, in order, so the first request pays no random faults.  Other dtypes convert in one pass.
Serving workers therefore need their weight files left intact: replace a model by rename
(what `warmpool model fetch` does), never by rewriting a file in place.

GPU path (only when ``torch.cuda.is_available()`` and the device is CUDA): host-to-device
copies go through two pinned staging buffers on a side stream, and `capture_graphs`
records the single-token decode step as a CUDA graph per batch bucket (1/2/4/8; a batch
is padded up to the nearest bucket).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from warmpool_worker.checkpoint import (
    TOKENIZER_FILE,
    Checkpoint,
    LlamaConfig,
    open_checkpoint,
    read_generation_eos,
    read_safetensors_header,
)
from warmpool_worker.engine_api import (
    GenerationStep,
    LayerProgress,
    ModelLoadError,
    NonFiniteLogitsError,
    RequestError,
    WeightsChangedError,
)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_SAFETENSORS_DTYPE: dict[torch.dtype, str] = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8)
DEFAULT_HEAT_HALF_LIFE_S = 300.0
PREFIX_KV_FORMAT = "warmpool-prefix-kv"
PREFIX_KV_VERSION = "1"
#: KV caches of live generations are allocated in whole blocks of this many positions and
#: grow as tokens are generated (never sized up front for max_tokens), by at least a quarter
#: each time so the copies stay amortised O(1) per token.
KV_BLOCK_TOKENS = 64
#: madvise(2) advice values (Linux).  POPULATE_READ (5.14+) maps every page of a range
#: in one call -- far cheaper than a fault per page -- and is what "loading" a zero-copy
#: layer means on CPU; WILLNEED starts readahead of a range without waiting for it.
_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22
_PAGE = mmap.PAGESIZE
_libc: Any = None


def _madvise(tensor: torch.Tensor, advice: int) -> bool:
    """madvise over the pages holding this (contiguous, CPU) tensor's bytes; False if refused."""
    global _libc
    ctypes.set_errno(0)  # callers read ctypes.get_errno() after a False: never a stale one
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0 or os.name != "posix" or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    start = tensor.data_ptr()
    aligned = start - start % _PAGE
    return bool(_libc.madvise(aligned, start + nbytes - aligned, advice) == 0)


def _fault_in(tensor: torch.Tensor) -> None:
    """Map every page of a view of the file now, in order, so first use pays no page faults."""
    if _madvise(tensor, _MADV_POPULATE_READ):
        return
    if ctypes.get_errno() == errno.EFAULT:
        # POPULATE_READ answers EFAULT where touching the page would raise SIGBUS: the file
        # was cut short under the mapping after our identity check.  Never touch it.
        raise WeightsChangedError("pages of a mapped weight lie beyond the end of its file "
                                  "(truncated in place)")
    # Older kernels: read one byte per page, front to back (the fault path reads ahead).
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.numel():
        _ = int(flat[::_PAGE].sum()) + int(flat[-1])


#: Pinned staging buffer size: big enough to keep the copy engine busy, small enough that
#: two of them cost nothing next to the weights (large tensors are copied in chunks).
STAGING_BYTES = 64 * 1024 * 1024

_LAYER_PARTS = (
    ("ln1", "input_layernorm.weight"),
    ("ln2", "post_attention_layernorm.weight"),
    ("wq", "self_attn.q_proj.weight"),
    ("wk", "self_attn.k_proj.weight"),
    ("wv", "self_attn.v_proj.weight"),
    ("wo", "self_attn.o_proj.weight"),
    ("bq", "self_attn.q_proj.bias"),
    ("bk", "self_attn.k_proj.bias"),
    ("bv", "self_attn.v_proj.bias"),
    ("bo", "self_attn.o_proj.bias"),
    ("w_gate", "mlp.gate_proj.weight"),
    ("w_up", "mlp.up_proj.weight"),
    ("w_down", "mlp.down_proj.weight"),
    ("b_gate", "mlp.gate_proj.bias"),
    ("b_up", "mlp.up_proj.bias"),
    ("b_down", "mlp.down_proj.bias"),
)


def token_hash(token_ids: Sequence[int]) -> str:
    """sha256 of the token ids as little-endian int64: keys persisted prefix KV files."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


def bucket_for(batch: int, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> int:
    """The smallest bucket that holds this batch (a batch is padded up to it)."""
    for b in sorted(buckets):
        if batch <= b:
            return b
    raise RequestError(f"batch of {batch} exceeds the largest bucket {max(buckets)}")


def order_from_heat(heat: Mapping[int, float], num_layers: int) -> list[int]:
    """Hottest layers first (ties by index); layers the heat map does not mention follow in order."""
    known = [i for i in heat if 0 <= i < num_layers]
    ranked = sorted(known, key=lambda i: (-heat[i], i))
    return ranked + [i for i in range(num_layers) if i not in heat]


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


def kv_capacity(needed: int, current: int, limit: int) -> int:
    """Positions to allocate for `needed`: whole blocks, at least a quarter more than `current`
    (amortised growth), never past `limit` (prompt + the completion's budget)."""
    target = max(needed, current + current // 4)
    return min(limit, -(-target // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _KVCache:
    """Per-layer K and V, shape [batch, kv_heads, capacity, head_dim]."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys = keys
        self.values = values

    @classmethod
    def empty(cls, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
              dtype: torch.dtype, device: torch.device) -> _KVCache:
        shape = (batch, kv_heads, capacity, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)])

    def row(self, index: int) -> _KVCache:
        return _KVCache([k[index : index + 1] for k in self.keys], [v[index : index + 1] for v in self.values])

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


class _PinnedStager:
    """Host-to-device copies through two pinned buffers on a side stream.

    Pageable memory (the mmap) cannot be DMA'd directly: the driver would stage it
    through its own small bounce buffer synchronously.  Copying into our own pinned
    buffers and issuing async copies lets the CPU memcpy of chunk n+1 (page faults
    included: that is where the disk read happens) overlap the DMA of chunk n.
    """

    def __init__(self, device: torch.device, nbytes: int = STAGING_BYTES) -> None:
        self.device = device
        self.nbytes = nbytes
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self.turn = 0
        self.bytes_copied = 0

    def to_device(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        src = src.contiguous()
        flat = src.reshape(-1).view(torch.uint8)
        total = flat.numel()
        with torch.cuda.stream(self.stream):
            dst = torch.empty(total, dtype=torch.uint8, device=self.device)
        for start in range(0, total, self.nbytes):
            stop = min(start + self.nbytes, total)
            turn = self.turn
            self.turn ^= 1
            event = self.events[turn]
            if event is not None:
                event.synchronize()  # the DMA that last read this buffer is done: safe to overwrite
            staging = self.buffers[turn][: stop - start]
            staging.copy_(flat[start:stop])
            with torch.cuda.stream(self.stream):
                dst[start:stop].copy_(staging, non_blocking=True)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(self.stream)
            self.events[turn] = done
        self.bytes_copied += total
        with torch.cuda.stream(self.stream):
            out = dst.view(src.dtype).view(src.shape)
            return out.to(dtype) if dtype != src.dtype else out

    def finish(self) -> None:
        """Wait for every copy: called before a layer is published to other streams/threads."""
        self.stream.synchronize()


@dataclass
class _DecodeGraph:
    bucket: int
    graph: Any  # torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor
    cache: _KVCache
    lock: threading.Lock


class LlamaEngine:
    """Implements `engine_api.Engine` (plus batched decode and CUDA graphs) for the Llama family."""

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
    ) -> None:
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.tokenizer = tokenizer
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype or torch.float32
        self._model_name = model_name or checkpoint.model_dir.resolve().name
        self.eos_token_ids = frozenset(read_generation_eos(checkpoint.model_dir, self.config))
        cfg = self.config
        self._n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
        inv_freq, self._attention_scaling = rope_inv_freq(cfg)
        self._inv_freq = inv_freq.to(self._device)
        self._core: dict[str, torch.Tensor] | None = None
        self._layers: list[dict[str, torch.Tensor] | None] = [None] * cfg.num_hidden_layers
        self._load_lock = threading.RLock()
        self._stager: _PinnedStager | None = None
        self.load_seconds: dict[int, float] = {}
        self.bytes_loaded = 0
        # heat: per layer (decayed value, time of the last update)
        self._heat_half_life = heat_half_life_s
        self._clock = clock
        self._heat: list[tuple[float, float]] = [(0.0, clock()) for _ in range(cfg.num_hidden_layers)]
        self._heat_lock = threading.Lock()
        self._prefixes: dict[str, tuple[tuple[int, ...], list[torch.Tensor], list[torch.Tensor]]] = {}
        self._prefix_lock = threading.Lock()
        self._graphs: dict[int, _DecodeGraph] = {}
        self._replay_lock = threading.Lock()
        self._kv_slots_live = 0  # token slots of the KV caches of generations in flight
        self._kv_slots_lock = threading.Lock()
        self.graph_max_len = min(graph_max_len, cfg.max_position_embeddings)
        self._sample_generator = torch.Generator(device="cpu")
        self._sample_generator.seed()

    # ---- Engine protocol: identity -------------------------------------------------------
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

    # ---- loading ---------------------------------------------------------------------------
    def layers_resident(self) -> int:
        return sum(layer is not None for layer in self._layers)

    def is_layer_resident(self, index: int) -> bool:
        return self._layers[index] is not None

    def _materialise(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._device.type == "cuda":
            if self._stager is None:
                self._stager = _PinnedStager(self._device)
            return self._stager.to_device(tensor, self.dtype)
        if tensor.dtype == self.dtype:
            # CPU, same dtype: use the weights where they lie, in the file's mapping (no
            # copy, no second resident copy).  safetensors maps the file copy-on-write
            # (MAP_PRIVATE), so the tensor is writable and a stray in-place op could never
            # reach the file -- but nothing here writes to a weight.  Loading = mapping
            # every page now, sequentially, instead of a fault per page in the first request.
            _fault_in(tensor)
            return tensor
        # CPU, another dtype: convert in one pass into a preallocated tensor.
        out = torch.empty(tensor.shape, dtype=self.dtype)
        out.copy_(tensor)
        return out

    def _load_named(self, parts: Sequence[tuple[str, str]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        present = [(key, name) for key, name in parts if name in self.checkpoint.tensors]
        # The files under the mapping must still be the ones validated: a file truncated in
        # place would SIGBUS on the first page touched below, one rewritten would be garbage.
        self.checkpoint.verify_unchanged({self.checkpoint.tensors[name].file for _, name in present})
        with torch.inference_mode():
            sources = [(key, name, self.checkpoint.get_tensor(name)) for key, name in present]
            if self._device.type == "cpu":
                for _, _, source in sources:  # start reading the whole layer ahead (cold cache)
                    _madvise(source, _MADV_WILLNEED)
            for key, name, source in sources:
                try:
                    tensor = self._materialise(source)
                except WeightsChangedError as error:
                    raise WeightsChangedError(f"{self.checkpoint.tensors[name].file}: tensor {name!r}: "
                                              f"{error}") from None
                out[key] = tensor
                self.bytes_loaded += tensor.numel() * tensor.element_size()
            if self._stager is not None:
                self._stager.finish()
        return out

    def _ensure_core(self) -> dict[str, torch.Tensor]:
        core = self._core
        if core is not None:
            return core
        with self._load_lock:
            if self._core is None:
                parts = [("embed", "model.embed_tokens.weight"), ("norm", "model.norm.weight")]
                if not self.config.tie_word_embeddings:
                    parts.append(("head", "lm_head.weight"))
                loaded = self._load_named(parts)
                if self.config.tie_word_embeddings:
                    loaded["head"] = loaded["embed"]
                self._core = loaded
            return self._core

    def _ensure_layer(self, index: int) -> dict[str, torch.Tensor]:
        layer = self._layers[index]
        if layer is not None:  # fast path: no lock once resident
            return layer
        with self._load_lock:
            layer = self._layers[index]
            if layer is None:
                started = time.perf_counter()
                prefix = f"model.layers.{index}."
                layer = self._load_named([(key, prefix + suffix) for key, suffix in _LAYER_PARTS])
                self.load_seconds[index] = time.perf_counter() - started
                self._layers[index] = layer  # published only once complete
            return layer

    def load_layers(self, order: Sequence[int], progress: LayerProgress | None = None) -> None:
        total = self.num_layers
        bad = [i for i in order if not isinstance(i, int) or not 0 <= i < total]
        if bad:
            raise ValueError(f"layer indices out of range 0..{total - 1}: {bad[:5]}")
        self._ensure_core()
        for index in order:
            self._ensure_layer(index)
            if progress is not None:
                progress(self.layers_resident(), total, index)

    def load_all(self, progress: LayerProgress | None = None) -> None:
        self.load_layers(range(self.num_layers), progress)

    # ---- heat ------------------------------------------------------------------------------
    def _decay(self, value: float, since: float, now: float) -> float:
        if self._heat_half_life <= 0:
            return value
        return value * math.pow(0.5, max(0.0, now - since) / self._heat_half_life)

    def _touch(self, index: int) -> None:
        now = self._clock()
        with self._heat_lock:
            value, since = self._heat[index]
            self._heat[index] = (self._decay(value, since, now) + 1.0, now)

    def layer_heat(self) -> dict[int, float]:
        now = self._clock()
        with self._heat_lock:
            return {i: self._decay(v, s, now) for i, (v, s) in enumerate(self._heat)}

    # ---- tokenizer -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    # ---- maths -----------------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * h.to(input_dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, T, head_dim] for positions [B, T], computed in fp32 like transformers."""
        freqs = positions.to(torch.float32)[..., None] * self._inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self._attention_scaling).to(self.dtype)
        sin = (emb.sin() * self._attention_scaling).to(self.dtype)
        return cos[:, None], sin[:, None]

    def _qkv(self, w: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        b, t, _ = x.shape
        q = F.linear(x, w["wq"], w.get("bq")).view(b, t, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = F.linear(x, w["wk"], w.get("bk")).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = F.linear(x, w["wv"], w.get("bv")).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _attend(self, w: dict[str, torch.Tensor], q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        b, _, t, _ = q.shape
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal, scale=self.config.head_dim**-0.5,
            enable_gqa=self._n_rep > 1,
        )
        out = out.transpose(1, 2).reshape(b, t, self.config.num_attention_heads * self.config.head_dim)
        return F.linear(out, w["wo"], w.get("bo"))

    def _mlp(self, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        gate = F.linear(x, w["w_gate"], w.get("b_gate"))
        up = F.linear(x, w["w_up"], w.get("b_up"))
        return F.linear(F.silu(gate) * up, w["w_down"], w.get("b_down"))

    def _forward(self, token_ids: torch.Tensor, start: int, cache: _KVCache, all_logits: bool = False
                 ) -> torch.Tensor:
        """Contiguous positions start..start+T for every row; writes K/V into the cache.

        Returns logits [B, T, V] when all_logits else [B, V] for the last position.
        """
        core = self._ensure_core()
        b, t = token_ids.shape
        positions = torch.arange(start, start + t, device=self._device).expand(b, t)
        cos, sin = self._rope(positions)
        x = F.embedding(token_ids, core["embed"])
        mask: torch.Tensor | None = None
        causal = t > 1 and start == 0
        if t > 1 and start > 0:  # a chunk after a cached prefix: causal, shifted by `start`
            mask = (torch.arange(start + t, device=self._device)[None, :]
                    <= torch.arange(start, start + t, device=self._device)[:, None])
        for index in range(self.num_layers):
            w = self._ensure_layer(index)
            self._touch(index)
            h = self._rms_norm(x, w["ln1"])
            q, k, v = self._qkv(w, h, cos, sin)
            cache.keys[index][:, :, start : start + t] = k
            cache.values[index][:, :, start : start + t] = v
            keys = cache.keys[index][:, :, : start + t]
            values = cache.values[index][:, :, : start + t]
            x = x + self._attend(w, q, keys, values, mask, causal)
            x = x + self._mlp(w, self._rms_norm(x, w["ln2"]))
        x = self._rms_norm(x if all_logits else x[:, -1:], core["norm"])
        logits = F.linear(x, core["head"])
        return logits if all_logits else logits[:, -1]

    def _decode_static(self, tokens: torch.Tensor, positions: torch.Tensor, cache: _KVCache) -> torch.Tensor:
        """One token per row at per-row positions into a fixed-size cache: the CUDA-graph body.

        Only tensor ops with shapes fixed by the bucket, so the same code replays as a graph.
        """
        core = self._ensure_core()
        b = tokens.shape[0]
        capacity = cache.capacity
        cos, sin = self._rope(positions[:, None])
        x = F.embedding(tokens[:, None], core["embed"])
        mask = (torch.arange(capacity, device=self._device)[None, :] <= positions[:, None]).view(b, 1, 1, capacity)
        scatter_index = positions.view(b, 1, 1, 1).expand(b, self.config.num_key_value_heads, 1,
                                                          self.config.head_dim)
        for index in range(self.num_layers):
            w = self._ensure_layer(index)
            self._touch(index)
            h = self._rms_norm(x, w["ln1"])
            q, k, v = self._qkv(w, h, cos, sin)
            cache.keys[index].scatter_(2, scatter_index, k)
            cache.values[index].scatter_(2, scatter_index, v)
            x = x + self._attend(w, q, cache.keys[index], cache.values[index], mask, False)
            x = x + self._mlp(w, self._rms_norm(x, w["ln2"]))
        return F.linear(self._rms_norm(x[:, -1], core["norm"]), core["head"])

    # ---- public compute ----------------------------------------------------------------------
    def _check_prompt(self, token_ids: Sequence[int]) -> list[int]:
        ids = list(token_ids)
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) > self.max_context:
            raise RequestError(f"the prompt is {len(ids)} tokens, longer than the context of {self.max_context}")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids out of the vocabulary (0..{vocab - 1}): {bad[:5]}")
        return ids

    def _new_cache(self, batch: int, capacity: int) -> _KVCache:
        cfg = self.config
        return _KVCache.empty(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, cfg.head_dim,
                              self.dtype, self._device)

    def forward_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, vocab] for every position of one prompt (tests and evaluation)."""
        ids = self._check_prompt(token_ids)
        with torch.inference_mode():
            cache = self._new_cache(1, len(ids))
            ids_t = torch.tensor([ids], dtype=torch.long, device=self._device)
            return self._forward(ids_t, 0, cache, all_logits=True)[0]

    def prefill(self, token_ids: Sequence[int]) -> None:
        ids = self._check_prompt(token_ids)
        with torch.inference_mode():
            cache = self._new_cache(1, len(ids))
            logits = self._forward(torch.tensor([ids], dtype=torch.long, device=self._device), 0, cache)
            self._check_finite(logits, f"at the prefill of a {len(ids)}-token prompt")

    # ---- non-finite values -------------------------------------------------------------------
    def _check_finite(self, logits: torch.Tensor, where: str) -> None:
        """Raise NonFiniteLogitsError if any logit is NaN/Inf: never sample from garbage.

        One reduction over [B, V] per step (the sampler syncs on the same values anyway).
        """
        if bool(torch.isfinite(logits).all()):
            return
        culprit = self._non_finite_weight()
        cause = (f"weight {culprit} holds NaN/Inf" if culprit is not None
                 else f"no resident weight holds NaN/Inf: activations overflowed in {self.dtype}")
        raise NonFiniteLogitsError(f"model {self.model_name!r} produced non-finite logits (NaN/Inf) {where}: {cause}")

    def _non_finite_weight(self) -> str | None:
        """The checkpoint name of the first resident weight holding NaN/Inf (error path only)."""
        core_names = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}
        named: list[tuple[str, torch.Tensor]] = [
            (core_names[key], tensor) for key, tensor in (self._core or {}).items()
        ]
        parts = dict(_LAYER_PARTS)
        for index, layer in enumerate(self._layers):
            named += [(f"model.layers.{index}.{parts[key]}", tensor) for key, tensor in (layer or {}).items()]
        with torch.inference_mode():
            for name, tensor in named:
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    return name
        return None

    # ---- KV memory of live generations --------------------------------------------------------
    def kv_cache_tokens(self) -> int:
        """Token slots allocated now for the KV caches of generations in flight (CUDA graphs'
        static caches, sized once at capture, are not counted)."""
        return self._kv_slots_live

    def _account_kv(self, slots: int) -> None:
        with self._kv_slots_lock:
            self._kv_slots_live += slots

    def _sample(self, logits: torch.Tensor, temperature: float) -> list[int]:
        """logits [B, V] -> one token per row: argmax, or a draw from softmax(logits / T)."""
        if temperature <= 0:
            return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
        probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
        return [int(t) for t in torch.multinomial(probs, 1, generator=self._sample_generator)[:, 0].tolist()]

    def _check_generation(self, max_new_tokens: int, temperature: float) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not math.isfinite(temperature) or temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {temperature!r}")

    def _lookup_prefix(self, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], int] | None:
        """The longest stored prefix of this prompt (at most len-1 tokens: the last is always run)."""
        best: tuple[list[torch.Tensor], list[torch.Tensor], int] | None = None
        with self._prefix_lock:
            entries = list(self._prefixes.values())
        for tokens, keys, values in entries:
            n = min(len(tokens), len(ids) - 1)
            if n > 0 and tuple(ids[:n]) == tokens[:n] and (best is None or n > best[2]):
                best = (keys, values, n)
        return best

    def _prefill_into(self, ids: list[int], cache: _KVCache) -> torch.Tensor:
        start = 0
        hit = self._lookup_prefix(ids)
        if hit is not None:
            keys, values, start = hit
            for index in range(self.num_layers):
                cache.keys[index][0, :, :start] = keys[index][:, :start]
                cache.values[index][0, :, :start] = values[index][:, :start]
        rest = torch.tensor([ids[start:]], dtype=torch.long, device=self._device)
        return self._forward(rest, start, cache)

    def _step_text(self, generated: list[int], emitted: str, final: bool = False) -> tuple[str, str]:
        text = self.decode(generated)
        if text.endswith("\ufffd") and not final:  # mid-codepoint: wait for the rest of the bytes
            return "", emitted
        if not text.startswith(emitted):  # the tokenizer re-merged earlier text: send only what is new
            common = 0
            for a, b in zip(text, emitted, strict=False):
                if a != b:
                    break
                common += 1
            return text[common:], text
        return text[len(emitted):], text

    def generate(self, token_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 ) -> Iterator[GenerationStep]:
        ids = self._check_prompt(token_ids)
        self._check_generation(max_new_tokens, temperature)
        if len(ids) >= self.max_context:
            raise RequestError(f"the prompt is {len(ids)} tokens: no room left in the context of "
                               f"{self.max_context} for a completion")
        budget = min(max_new_tokens, self.max_context - len(ids))
        return self._generate(ids, budget, temperature)

    def _generate(self, ids: list[int], budget: int, temperature: float) -> Iterator[GenerationStep]:
        graph = self._graphs.get(1)
        limit = len(ids) + budget
        use_graph = (graph is not None and limit <= graph.cache.capacity
                     and graph.lock.acquire(blocking=False))
        accounted = 0
        try:
            with torch.inference_mode():
                if use_graph and graph is not None:
                    cache = graph.cache
                else:  # sized for the prompt; grows as tokens are generated
                    cache = self._new_cache(1, kv_capacity(len(ids), 0, limit))
                    accounted = cache.slots
                    self._account_kv(accounted)
                logits = self._prefill_into(ids, cache)
            self._check_finite(logits, f"at the prefill of a {len(ids)}-token prompt")
            generated: list[int] = []
            emitted = ""
            position = len(ids)
            while True:
                token = self._sample(logits, temperature)[0]
                generated.append(token)
                if token in self.eos_token_ids:
                    yield GenerationStep(token, "", True, "stop")
                    return
                final = len(generated) >= budget
                text, emitted = self._step_text(generated, emitted, final)
                if final:
                    yield GenerationStep(token, text, True, "length")
                    return
                yield GenerationStep(token, text, False)
                with torch.inference_mode():
                    if use_graph and graph is not None:
                        logits = self._replay(graph, [token], [position])
                    else:
                        added = cache.ensure(position + 1, limit)
                        accounted += added
                        self._account_kv(added)
                        step = torch.tensor([[token]], dtype=torch.long, device=self._device)
                        logits = self._forward(step, position, cache)
                self._check_finite(logits, f"at decode step {len(generated)}")
                position += 1
        finally:
            self._account_kv(-accounted)
            if use_graph and graph is not None:
                graph.lock.release()

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                       buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> list[list[int]]:
        """Decode several prompts together, padded up to a batch bucket (CUDA graph when captured).

        Returns the generated ids of each prompt (EOS included when one stopped it).
        """
        if not prompts:
            return []
        checked = [self._check_prompt(p) for p in prompts]
        self._check_generation(max_new_tokens, temperature)
        bucket = bucket_for(len(checked), buckets)
        longest = max(len(p) for p in checked)
        if longest >= self.max_context:
            raise RequestError(f"a prompt of {longest} tokens leaves no room in the context of {self.max_context}")
        budget = min(max_new_tokens, self.max_context - longest)
        graph = self._graphs.get(bucket)
        use_graph = (graph is not None and longest + budget <= graph.cache.capacity
                     and graph.lock.acquire(blocking=False))
        limit = longest + budget
        accounted = 0
        try:
            with torch.inference_mode():
                fresh = not (use_graph and graph is not None)
                if fresh or graph is None:  # sized for the prompts; grows as tokens are generated
                    cache = self._new_cache(bucket, kv_capacity(longest, 0, limit))
                    accounted = cache.slots
                    self._account_kv(accounted)
                else:
                    cache = graph.cache
                last = [self._prefill_into(p, cache.row(r)) for r, p in enumerate(checked)]
                logits = torch.cat(last, dim=0)
                outputs: list[list[int]] = [[] for _ in checked]
                done = [False] * len(checked)
                positions = [len(p) for p in checked]
                for step_index in range(budget):
                    self._check_finite(logits, f"at batch step {step_index}")
                    tokens = self._sample(logits, temperature)
                    for r, token in enumerate(tokens):
                        if not done[r]:
                            outputs[r].append(token)
                            done[r] = token in self.eos_token_ids or len(outputs[r]) >= budget
                    if all(done):
                        break
                    # pad rows (and finished ones) decode token 0 at position 0 of their own row:
                    # harmless, their output is ignored, and shapes stay those of the bucket.
                    step_tokens = [t if not d else 0 for t, d in zip(tokens, done, strict=True)] + \
                        [0] * (bucket - len(checked))
                    step_pos = [p if not d else 0 for p, d in zip(positions, done, strict=True)] + \
                        [0] * (bucket - len(checked))
                    if use_graph and graph is not None:
                        logits = self._replay(graph, step_tokens, step_pos)[: len(checked)]
                    else:
                        added = cache.ensure(max(positions) + 1, limit)
                        accounted += added
                        self._account_kv(added)
                        logits = self._decode_static(
                            torch.tensor(step_tokens, dtype=torch.long, device=self._device),
                            torch.tensor(step_pos, dtype=torch.long, device=self._device), cache,
                        )[: len(checked)]
                    positions = [p + 1 for p in positions]
                return outputs
        finally:
            self._account_kv(-accounted)
            if use_graph and graph is not None:
                graph.lock.release()

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def _replay(self, graph: _DecodeGraph, tokens: list[int], positions: list[int]) -> torch.Tensor:
        # One replay at a time across buckets: the graphs share one memory pool, whose
        # temporaries are only safe when replays do not interleave.
        with self._replay_lock:
            graph.tokens.copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=False)
            graph.positions.copy_(torch.tensor(positions, dtype=torch.long), non_blocking=False)
            graph.graph.replay()
            logits = graph.logits.clone()
        for index in range(self.num_layers):  # the graph skips Python, so count the heat here
            self._touch(index)
        return logits

    def capture_graphs(self, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> dict[int, float]:
        """Capture the decode step as a CUDA graph per batch bucket; seconds per bucket.

        Needs every layer resident (they are loaded first).  A no-op returning {} off CUDA.
        """
        if self._device.type != "cuda" or not torch.cuda.is_available():
            return {}
        self.load_all()
        timings: dict[int, float] = {}
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the shared memory pool is then sized once and reused by the smaller ones.
        for bucket in sorted(set(buckets), reverse=True):
            if bucket in self._graphs:
                continue
            started = time.perf_counter()
            with torch.inference_mode():
                tokens = torch.zeros(bucket, dtype=torch.long, device=self._device)
                positions = torch.zeros(bucket, dtype=torch.long, device=self._device)
                cache = self._new_cache(bucket, self.graph_max_len)
                side = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
                side.wait_stream(torch.cuda.current_stream(self._device))
                with torch.cuda.stream(side):  # warm-up runs (lazy kernel init) must precede capture
                    for _ in range(2):
                        self._decode_static(tokens, positions, cache)
                torch.cuda.current_stream(self._device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._decode_static(tokens, positions, cache)
                torch.cuda.synchronize(self._device)
            self._graphs[bucket] = _DecodeGraph(bucket, graph, tokens, positions, logits, cache, threading.Lock())
            timings[bucket] = time.perf_counter() - started
        return timings

    @property
    def graph_buckets(self) -> list[int]:
        return sorted(self._graphs)

    # ---- warm prefix KV persistence --------------------------------------------------------------
    def _prefix_metadata(self, ids: Sequence[int]) -> dict[str, str]:
        return {
            "format": PREFIX_KV_FORMAT,
            "format_version": PREFIX_KV_VERSION,
            "model_digest": self.model_digest,
            "token_hash": token_hash(ids),
            "num_tokens": str(len(ids)),
            "dtype": _SAFETENSORS_DTYPE[self.dtype],
        }

    def save_prefix_kv(self, token_ids: Sequence[int], path: Path) -> None:
        """Persist this prefix's KV; a filesystem failure (ENOSPC, EROFS, ...) raises OSError
        with its errno, and leaves no partial file behind."""
        from safetensors.torch import save

        ids = self._check_prompt(token_ids)
        with torch.inference_mode():
            cache = self._new_cache(1, len(ids))
            self._forward(torch.tensor([ids], dtype=torch.long, device=self._device), 0, cache)
            tensors: dict[str, torch.Tensor] = {}
            for index in range(self.num_layers):
                tensors[f"layers.{index}.k"] = cache.keys[index][0].contiguous().cpu()
                tensors[f"layers.{index}.v"] = cache.values[index][0].contiguous().cpu()
        self._remember_prefix(ids, [tensors[f"layers.{i}.k"] for i in range(self.num_layers)],
                              [tensors[f"layers.{i}.v"] for i in range(self.num_layers)])
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        # Serialised in memory, written by Python: an I/O failure is then a plain OSError
        # with its errno (safetensors' save_file wraps it in an opaque SafetensorError).
        payload = save(tensors, metadata=self._prefix_metadata(ids))
        try:  # write then rename: a reader never sees half a file
            with open(tmp, "wb") as handle:
                handle.write(payload)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _remember_prefix(self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        keys = [k.to(self._device) for k in keys]
        values = [v.to(self._device) for v in values]
        with self._prefix_lock:
            self._prefixes[token_hash(ids)] = (tuple(ids), keys, values)

    def load_prefix_kv(self, token_ids: Sequence[int], path: Path) -> bool:
        from safetensors import safe_open

        ids = self._check_prompt(token_ids)
        path = Path(path)
        if not path.exists():
            return False
        header = read_safetensors_header(path)  # corrupt -> ModelLoadError naming the file
        expected_meta = self._prefix_metadata(ids)
        if any(header.metadata.get(key) != value for key, value in expected_meta.items()):
            return False  # another model, prompt, dtype or format: stale, not corrupt
        cfg = self.config
        shape = (cfg.num_key_value_heads, len(ids), cfg.head_dim)
        names = {f"layers.{i}.{kind}" for i in range(self.num_layers) for kind in ("k", "v")}
        if set(header.tensors) != names or any(
            t.shape != shape or t.dtype != expected_meta["dtype"] for t in header.tensors.values()
        ):
            raise ModelLoadError(f"{path}: prefix KV file claims this model and prompt but its tensors "
                                 f"do not match (expected {len(names)} tensors of shape {list(shape)})")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:  # mmap
                keys = [handle.get_tensor(f"layers.{i}.k") for i in range(self.num_layers)]
                values = [handle.get_tensor(f"layers.{i}.v") for i in range(self.num_layers)]
        except Exception as error:
            raise ModelLoadError(f"{path}: cannot read prefix KV: {error}") from error
        self._remember_prefix(ids, keys, values)
        return True

    def forget_prefixes(self) -> None:
        with self._prefix_lock:
            self._prefixes.clear()


def resolve_dtype(name: str | None, config: LlamaConfig, device: torch.device) -> torch.dtype:
    """The compute dtype: as asked; else the checkpoint's on CUDA and fp32 on CPU.

    CPU default is fp32 because half-precision matmuls are slow on most CPUs without AMX.
    """
    if name is not None:
        key = name.lower().removeprefix("torch.")
        if key == "auto":
            name = None
        elif key not in DTYPES:
            raise ModelLoadError(f"dtype {name!r} is not supported (float32, float16, bfloat16, auto)")
        else:
            return DTYPES[key]
    if device.type == "cuda":
        return DTYPES.get((config.torch_dtype or "bfloat16").lower(), torch.bfloat16)
    return torch.float32


def load_engine(model_dir: Path, device: str = "cpu", dtype: str | None = None,
                model_name: str | None = None, **options: Any) -> LlamaEngine:
    """Validate and map a checkpoint, read its tokenizer; no weight is read yet (fast).

    `options` go to LlamaEngine (heat_half_life_s, clock, graph_max_len).
    """
    model_dir = Path(model_dir)
    try:
        dev = torch.device(device)
    except RuntimeError as error:
        raise ModelLoadError(f"device {device!r} is not valid: {error}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {device!r} is not supported (cpu or cuda)")
    checkpoint = open_checkpoint(model_dir)
    tokenizer_path = model_dir / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise ModelLoadError(f"{tokenizer_path}: file is missing (the engine reads tokenizer.json)")
    from tokenizers import Tokenizer  # on the load path only

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as error:  # tokenizers raises a bare Exception on bad files
        raise ModelLoadError(f"{tokenizer_path}: cannot parse tokenizer: {error}") from None
    return LlamaEngine(checkpoint, tokenizer, device=device,
                       dtype=resolve_dtype(dtype, checkpoint.config, dev), model_name=model_name, **options)
