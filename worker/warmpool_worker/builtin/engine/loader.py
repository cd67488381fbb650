"""`load_engine`: validate and map a checkpoint, read its tokenizer; no weight is read yet."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from warmpool_worker.builtin.engine.llama import LlamaEngine
from warmpool_worker.checkpoint import DIGEST_SAMPLE_BYTES, LlamaConfig, open_checkpoint
from warmpool_worker.engine_api import ModelLoadError
from warmpool_worker.tokenizer_file import TokenizerRead, read_tokenizer

if TYPE_CHECKING:
    from warmpool_worker.partial_cache import PartialCacheConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


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
                model_name: str | None = None, partial_cache: PartialCacheConfig | None = None,
                tokenizer: TokenizerRead | None = None, **options: Any) -> LlamaEngine:
    """Validate and map a checkpoint, read its tokenizer; no weight is read yet (fast).

    `partial_cache`: the directory may be a node cache's partial view; what opening reads is
    waited for first, and each tensor's bytes before they are touched (``partial_cache.py``).
    `tokenizer`: the tokenizer's read already begun (the worker starts it before importing
    torch); without it tokenizer.json is read here, after the checkpoint is validated.
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
    fill = None
    if partial_cache is not None:
        from warmpool_worker.partial_cache import PartialCache  # only a worker started with --partial-cache

        fill = PartialCache.open(model_dir, partial_cache)
    if fill is not None:
        fill.wait_openable(DIGEST_SAMPLE_BYTES)
        model_name = model_name or model_dir.name  # the view's own name carries the fill's lease version
        try:  # through the view itself, whether or not the fill has published it meanwhile
            checkpoint = open_checkpoint(fill.directory, fill)
            parsed = read_tokenizer(fill.directory) if tokenizer is None else tokenizer.result()
        except ModelLoadError as error:
            raise type(error)(fill.shown(str(error))) from None
    else:
        checkpoint = open_checkpoint(model_dir, fill)
        parsed = read_tokenizer(model_dir) if tokenizer is None else tokenizer.result()
    return LlamaEngine(checkpoint, parsed, device=device,
                       dtype=resolve_dtype(dtype, checkpoint.config, dev), model_name=model_name, **options)
