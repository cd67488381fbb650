"""The GGUF variants llama.cpp runs in `warmpool bench serve` beside the packaged one (bench-only;
uses the `gguf` package of the dev extra): a float32 copy, so llama.cpp can also run the weights at
the precision the built-in engine computes in, and a Q4_K_M made from that copy by llama.cpp's own
``llama-quantize`` (its usual 4-bit deployment format, `make llama-server` builds the tool).

The packaged GGUF is Q4_1 (embeddings Q8_0): under a fifth of the float32 bytes a decode
step streams from memory, which on a CPU is most of a step's cost.  This copy keeps every
metadata field and dequantises every tensor to float32, so the two servers differ in their
engines, not in the bytes of their weights.  The safetensors the worker reads were converted
from the same GGUF (`warmpool model fetch`), so both hold the same dequantised values (the
worker's rounded to bfloat16, its file's dtype).
"""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

#: GGUF's general.file_type for "all float32".
FILE_TYPE_ALL_F32 = 0
#: llama-quantize's name of the 4-bit mix it makes (K-quants; Q6_K for half the attention values
#: and FFN down projections).
Q4_K_M = "Q4_K_M"
#: One small model's quantisation takes seconds; bound it anyway.
QUANTIZE_TIMEOUT_S = 600.0


def write_f32_gguf(source: Path, dest: Path) -> Path:
    """Write `dest` (atomically, once: an existing one is reused) from `source`; `dest`."""
    if dest.is_file():
        return dest
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch is None:
        raise ValueError(f"{source}: no {gguf.Keys.General.ARCHITECTURE} field")
    partial = dest.with_name(dest.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), str(arch.contents()), endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = FILE_TYPE_ALL_F32 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, weights, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(dest)
    return dest


def write_quantized_gguf(quantize: Path, source: Path, dest: Path, kind: str = Q4_K_M) -> Path:
    """`dest` (atomically, once: an existing one is reused) quantised by llama.cpp's `llama-quantize`
    to `kind` from `source` (the float32 copy: quantise from full precision, not from another quant);
    its output is kept beside `dest` as ``<dest>.log``.

    Rows whose length is not a multiple of 256 cannot hold K-quants: llama-quantize gives those
    tensors a fallback type (it says which in the log), so `tensor_types` of the result is the truth."""
    if dest.is_file():
        return dest
    partial = dest.with_name(dest.name + ".partial")
    log_path = dest.with_name(dest.name + ".log")
    with log_path.open("w") as log:
        result = subprocess.run([str(quantize), str(source), str(partial), kind], stdout=log,
                                stderr=subprocess.STDOUT, timeout=QUANTIZE_TIMEOUT_S, check=False)
    if result.returncode != 0 or not partial.is_file():
        raise RuntimeError(f"{quantize.name} {kind} of {source.name} failed (exit {result.returncode}); "
                           f"log: {log_path}")
    partial.rename(dest)
    return dest


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type the GGUF holds (F32, Q4_1, Q4_K, ...)."""
    import gguf

    counts = Counter(tensor.tensor_type.name for tensor in gguf.GGUFReader(str(path)).tensors)
    return dict(counts.most_common())
