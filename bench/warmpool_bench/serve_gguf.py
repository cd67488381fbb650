"""A float32 copy of the model's GGUF, so llama.cpp can also run the weights at the precision
the built-in engine computes in (bench-only; uses the `gguf` package of the dev extra).

The packaged GGUF is Q4_1 (embeddings Q8_0): about an eighth of the float32 bytes a decode
step streams from memory, which on a CPU is most of a step's cost.  This copy keeps every
metadata field and dequantises every tensor to float32, so the two servers differ in their
engines, not in the bytes of their weights.  The safetensors the worker reads were converted
from the same GGUF (`warmpool model fetch`), so both hold the same dequantised values.
"""

from __future__ import annotations

from pathlib import Path

#: GGUF's general.file_type for "all float32".
FILE_TYPE_ALL_F32 = 0


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
