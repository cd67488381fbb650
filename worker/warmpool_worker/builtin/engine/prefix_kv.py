"""Warm prefixes: the KV of a prompt prefix kept in memory and persisted as safetensors.

A stored prefix lets a prompt that starts with it skip that part of the prefill.  A file is
keyed by model digest, token hash, dtype and format version; one that names another model,
prompt or dtype is stale (ignored), one that claims this model but holds the wrong tensors
is corrupt (ModelLoadError naming the file).  Files are serialised in memory and written by
Python, so a full or read-only disk is a plain OSError with its errno, and a write then
rename leaves no partial file.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from warmpool_worker.builtin.engine.kv_cache import KVCache
from warmpool_worker.checkpoint import LlamaConfig, read_safetensors_header
from warmpool_worker.engine_api import ModelLoadError

PREFIX_KV_FORMAT = "warmpool-prefix-kv"
PREFIX_KV_VERSION = "1"
SAFETENSORS_DTYPE: dict[torch.dtype, str] = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def token_hash(token_ids: Sequence[int]) -> str:
    """sha256 of the token ids as little-endian int64: keys persisted prefix KV files."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


@dataclass(frozen=True)
class PrefixHit:
    """The longest stored prefix of a prompt: its per-layer K/V [kv_heads, T, head_dim] and
    how many of the prompt's tokens it covers."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int


class PrefixKVStore:
    def __init__(self, config: LlamaConfig, dtype: torch.dtype, device: torch.device,
                 model_digest: Callable[[], str]) -> None:
        self._config = config
        self._dtype = dtype
        self._device = device
        self._model_digest = model_digest  # read lazily: the digest reads a sample of each file
        self._prefixes: dict[str, tuple[tuple[int, ...], list[torch.Tensor], list[torch.Tensor]]] = {}
        self._lock = threading.Lock()

    @property
    def num_layers(self) -> int:
        return self._config.num_hidden_layers

    def metadata(self, ids: Sequence[int]) -> dict[str, str]:
        return {
            "format": PREFIX_KV_FORMAT,
            "format_version": PREFIX_KV_VERSION,
            "model_digest": self._model_digest(),
            "token_hash": token_hash(ids),
            "num_tokens": str(len(ids)),
            "dtype": SAFETENSORS_DTYPE[self._dtype],
        }

    def remember(self, ids: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        keys = [k.to(self._device) for k in keys]
        values = [v.to(self._device) for v in values]
        with self._lock:
            self._prefixes[token_hash(ids)] = (tuple(ids), keys, values)

    def lookup(self, ids: Sequence[int]) -> PrefixHit | None:
        """The longest stored prefix of this prompt (at most len-1 tokens: the last is always run)."""
        best: PrefixHit | None = None
        with self._lock:
            entries = list(self._prefixes.values())
        for tokens, keys, values in entries:
            n = min(len(tokens), len(ids) - 1)
            if n > 0 and tuple(ids[:n]) == tokens[:n] and (best is None or n > best.length):
                best = PrefixHit(keys, values, n)
        return best

    def seed(self, ids: Sequence[int], cache: KVCache) -> int:
        """Copy the longest stored prefix of `ids` into row 0 of `cache`; positions covered."""
        hit = self.lookup(ids)
        if hit is None:
            return 0
        for index in range(self.num_layers):
            cache.keys[index][0, :, : hit.length] = hit.keys[index][:, : hit.length]
            cache.values[index][0, :, : hit.length] = hit.values[index][:, : hit.length]
        return hit.length

    def forget(self) -> None:
        with self._lock:
            self._prefixes.clear()

    def save(self, ids: Sequence[int], cache: KVCache, path: Path) -> None:
        """Remember row 0 of this prefix's cache and persist it; a filesystem failure (ENOSPC,
        EROFS, ...) raises OSError with its errno, and leaves no partial file behind."""
        from safetensors.torch import save

        tensors: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            for index in range(self.num_layers):
                tensors[f"layers.{index}.k"] = cache.keys[index][0].contiguous().cpu()
                tensors[f"layers.{index}.v"] = cache.values[index][0].contiguous().cpu()
        self.remember(ids, [tensors[f"layers.{i}.k"] for i in range(self.num_layers)],
                      [tensors[f"layers.{i}.v"] for i in range(self.num_layers)])
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        # Serialised in memory, written by Python: an I/O failure is then a plain OSError
        # with its errno (safetensors' save_file wraps it in an opaque SafetensorError).
        payload = save(tensors, metadata=self.metadata(ids))
        try:  # write then rename: a reader never sees half a file
            with open(tmp, "wb") as handle:
                handle.write(payload)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def load(self, ids: Sequence[int], path: Path) -> bool:
        """mmap a persisted prefix back; False if stale (another model, prompt, dtype, format)."""
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            return False
        header = read_safetensors_header(path)  # corrupt -> ModelLoadError naming the file
        expected_meta = self.metadata(ids)
        if any(header.metadata.get(key) != value for key, value in expected_meta.items()):
            return False  # another model, prompt, dtype or format: stale, not corrupt
        cfg = self._config
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
        self.remember(ids, keys, values)
        return True
