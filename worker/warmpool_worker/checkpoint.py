"""Read a Hugging Face-layout Llama-family checkpoint without trusting it.

The layout: ``config.json`` plus either ``model.safetensors`` or a sharded set named by
``model.safetensors.index.json``.  Every safetensors header is parsed and checked here,
*before* the file is handed to ``safetensors.safe_open`` (which mmaps it), so a lying
or truncated file fails with a message naming the file and the problem instead of a
segfault, a silent short read or a confusing library error deep in a forward pass.
Pickle-based checkpoints (``.bin``, ``.pt``...) are refused outright, never loaded.

Weights flow out as ``(name, tensor)`` pairs (the vLLM loader's shape); the tensors are
views of the mmap, so nothing is read from disk until a page is touched.

Only ``json``, ``struct`` and ``hashlib`` are needed to validate; torch and safetensors
are imported when a tensor is actually requested, keeping this module cheap to import.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmpool_worker.engine_api import ModelLoadError, WeightsChangedError
from warmpool_worker.weight_table import LM_HEAD, WEIGHT_TABLES, weight_table

import warmpool.contract.files as files_contract

if TYPE_CHECKING:
    import torch
    from warmpool_worker.partial_cache import PartialCache

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"

#: File suffixes of pickle-based checkpoints: never opened, let alone unpickled.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

#: safetensors dtype name -> bytes per element (the spec's full list).
DTYPE_SIZES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
#: dtypes a weight may have (the engine casts to the compute dtype).
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})

#: The safetensors library itself refuses headers above 100 MB; so do we, before reading one.
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: How much of each file's tensor data goes into the model digest (see Checkpoint.digest).
DIGEST_SAMPLE_BYTES = files_contract.DIGEST_SAMPLE_BYTES

#: The architectures with a weight table (the table decides names and shapes).
SUPPORTED_MODEL_TYPES = tuple(WEIGHT_TABLES)

#: Upper bounds for every config.json size that drives an allocation (the engine's layer
#: table, rotary tables, KV caches, the expected-tensor table).  Each is several times the
#: largest published Llama-family model (405B: 126 layers, hidden 16384, 128 heads,
#: intermediate 53248; vocabularies up to ~256k; contexts up to ~10M), so a real model
#: always passes and an absurd one (num_hidden_layers = 10**8) is refused before anything
#: is sized from it.
CONFIG_BOUNDS: dict[str, int] = {
    "num_hidden_layers": 1024,
    "hidden_size": 131_072,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "intermediate_size": 1 << 20,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 25,
}
#: The smallest bytes per weight element a checkpoint may use (F16/BF16): the floor for
#: what a config's parameter count must occupy on disk.
MIN_WEIGHT_BYTES = min(DTYPE_SIZES[d] for d in FLOAT_DTYPES)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its file's header declares it (offsets relative to the data section)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class FileIdentity:
    """Which file, at which length and modification time: what a validation was about.

    A file rewritten or truncated in place keeps its inode but changes size or mtime; one
    replaced by rename is another inode (and our open descriptor keeps the old one).
    """

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def differences(self, other: FileIdentity, mtime: bool = True) -> str:
        """What changed, in words ('' when nothing did); `mtime=False` leaves the mtime out (a file
        of a partial view is written while it fills: the same inode and size, a newer mtime)."""
        changed = [f"{name} {before} -> {after}" for name, before, after in (
            ("inode", self.inode, other.inode), ("device", self.device, other.device),
            ("size", self.size, other.size),
            ("mtime_ns", self.mtime_ns if mtime else 0, other.mtime_ns if mtime else 0),
        ) if before != after]
        return ", ".join(changed)


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    header_len: int
    data_len: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    identity: FileIdentity | None = None  # the file as it was when this header was read

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


@dataclass(frozen=True)
class LlamaConfig:
    """The parts of config.json the engine needs, validated and defaulted like transformers does."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v
    o_bias: bool  # bias on o_proj (Llama's attention_bias sets both; Qwen2 has q/k/v only)
    mlp_bias: bool
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    raw: dict[str, Any] = field(repr=False, compare=False)


def _fail(path: Path | str, problem: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: {problem}")


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file; any problem is a ModelLoadError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _fail(path, "file is missing") from None
    except (OSError, UnicodeDecodeError) as error:
        raise _fail(path, f"cannot read: {error}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise _fail(path, f"malformed JSON: {error}") from None
    if not isinstance(value, dict):
        raise _fail(path, f"expected a JSON object, found {type(value).__name__}")
    return value


def _check_tensor_name(path: Path, name: str) -> None:
    # Tensor names are keys, not paths, but they end up in logs, in file names of tools
    # that shard or export, and in our own digest: refuse the ones that look like paths out.
    parts = name.replace("\\", "/").split("/")
    if not name or name.startswith(("/", "\\")) or ".." in parts or "\x00" in name or (
        len(name) > 1 and name[1] == ":"
    ):
        raise _fail(path, f"tensor name {name!r} is not allowed (empty, absolute or contains '..')")


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """Parse and fully validate one safetensors file's header without mapping the file."""
    identity, header_len, raw = _read_header_bytes(path)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _fail(path, f"malformed safetensors header JSON: {error}") from None
    if not isinstance(header, dict):
        raise _fail(path, "safetensors header is not a JSON object")

    metadata_raw = header.pop("__metadata__", None) or {}
    if not isinstance(metadata_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata_raw.items()
    ):
        raise _fail(path, "__metadata__ must map strings to strings")
    data_len = identity.size - 8 - header_len
    tensors = {name: _tensor_entry(path, name, entry, data_len) for name, entry in header.items()}
    _check_tiling(path, tensors, data_len)
    return SafetensorsHeader(path, header_len, data_len, tensors, dict(metadata_raw), identity)


def _read_header_bytes(path: Path) -> tuple[FileIdentity, int, bytes]:
    """The file's identity, its header length and the header's bytes, with the length checked
    against the file's size and the limit."""
    try:
        with path.open("rb") as handle:
            identity = FileIdentity.of(os.fstat(handle.fileno()))
            size = identity.size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _fail(path, f"truncated file: {size} bytes, too short for the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise _fail(
                    path,
                    f"header length {header_len} is beyond the end of the file ({size} bytes): "
                    "truncated or not a safetensors file",
                )
            if header_len > MAX_HEADER_BYTES:
                raise _fail(path, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
            return identity, header_len, handle.read(header_len)
    except FileNotFoundError:
        raise _fail(path, "file is missing") from None
    except OSError as error:
        raise _fail(path, f"cannot read: {error}") from None


def _tensor_entry(path: Path, name: str, entry: object, data_len: int) -> TensorInfo:
    """One tensor's header entry, checked: a known dtype, a shape, offsets that span exactly
    its bytes and lie within the data section."""
    _check_tensor_name(path, name)
    if not isinstance(entry, dict):
        raise _fail(path, f"tensor {name!r}: header entry is not an object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise _fail(path, f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _fail(path, f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise _fail(path, f"tensor {name!r}: data_offsets {offsets!r} is not a pair of integers")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise _fail(path, f"tensor {name!r}: data_offsets [{begin}, {end}] are inverted or negative")
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise _fail(
            path,
            f"tensor {name!r}: dtype {dtype} shape {shape} needs {expected} bytes "
            f"but data_offsets [{begin}, {end}] span {end - begin}",
        )
    if end > data_len:
        raise _fail(
            path,
            f"truncated file: tensor {name!r} ends at data byte {end} "
            f"but the file holds only {data_len} bytes of data",
        )
    return TensorInfo(name, dtype, tuple(shape), path, begin, end)


def _check_tiling(path: Path, tensors: Mapping[str, TensorInfo], data_len: int) -> None:
    """Like the safetensors reference implementation: tensors tile the data section exactly,
    in offset order, with no gap and no overlap.  An overlap means two tensors alias the same
    bytes (a lying header); a gap or a short tail means a damaged file."""
    cursor = 0
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin < cursor:
            raise _fail(path, f"tensor {info.name!r}: data_offsets [{info.begin}, {info.end}] overlap "
                        f"the previous tensor (which ends at {cursor})")
        if info.begin > cursor:
            raise _fail(path, f"tensor {info.name!r}: gap in the data section before byte {info.begin} "
                        f"(previous tensor ends at {cursor}): offsets are lying")
        cursor = info.end
    if cursor != data_len:
        raise _fail(path, f"data section is {data_len} bytes but tensors cover {cursor}: "
                    "trailing bytes or truncated file")


def _positive_int(path: Path, raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _fail(path, f"{key!r} must be a positive integer, found {value!r}")
    bound = CONFIG_BOUNDS.get(key)
    if bound is not None and value > bound:
        raise _fail(path, f"{key!r} is {value}, above the bound of {bound}: refusing a config that "
                    "would size allocations from it")
    return value


def _eos_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def parse_config(path: Path, raw: dict[str, Any]) -> LlamaConfig:
    """Validate config.json for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2)."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _fail(path, f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise _fail(path, f"hidden_act {act!r} is not supported (only 'silu')")
    if raw.get("use_sliding_window") or (model_type == "mistral" and raw.get("sliding_window")):
        raise _fail(path, "sliding-window attention is not supported")
    hidden = _positive_int(path, raw, "hidden_size")
    heads = _positive_int(path, raw, "num_attention_heads")
    kv_heads = _positive_int(path, raw, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise _fail(path, f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim_raw = raw.get("head_dim")
    if head_dim_raw is None:
        if hidden % heads:
            raise _fail(path, f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
        if head_dim > CONFIG_BOUNDS["head_dim"]:
            raise _fail(path, f"'head_dim' (hidden_size {hidden} / num_attention_heads {heads}) is {head_dim}, "
                        f"above the bound of {CONFIG_BOUNDS['head_dim']}")
    else:
        head_dim = _positive_int(path, raw, "head_dim")
    if head_dim % 2:
        raise _fail(path, f"head_dim {head_dim} must be even for rotary embeddings")

    # transformers 5 moved rope settings into `rope_parameters`; 4.x keeps rope_theta/rope_scaling.
    rope_params = raw.get("rope_parameters")
    rope_theta = raw.get("rope_theta")
    rope_scaling = raw.get("rope_scaling")
    if isinstance(rope_params, dict):
        rope_theta = rope_params.get("rope_theta", rope_theta)
        rope_scaling = rope_params
    if rope_theta is None:
        rope_theta = 10000.0
    if not isinstance(rope_theta, int | float) or rope_theta <= 0:
        raise _fail(path, f"rope_theta {rope_theta!r} must be a positive number")
    if rope_scaling is not None:
        if not isinstance(rope_scaling, dict):
            raise _fail(path, f"rope_scaling {rope_scaling!r} must be an object")
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise _fail(path, f"rope scaling type {rope_type!r} is not supported (default, linear, llama3)")
        rope_scaling = None if rope_type == "default" else {**rope_scaling, "rope_type": rope_type}

    eps = raw.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, int | float) or eps <= 0:
        raise _fail(path, f"rms_norm_eps {eps!r} must be a positive number")
    llama_bias = bool(raw.get("attention_bias", False))
    qwen = model_type == "qwen2"
    dtype = raw.get("torch_dtype", raw.get("dtype"))
    bos = raw.get("bos_token_id")
    return LlamaConfig(
        model_type=str(model_type),
        vocab_size=_positive_int(path, raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive_int(path, raw, "intermediate_size"),
        num_hidden_layers=_positive_int(path, raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(eps),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=_positive_int(path, raw, "max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=qwen or llama_bias,
        o_bias=(not qwen) and llama_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        torch_dtype=dtype if isinstance(dtype, str) else None,
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        raw=raw,
    )


def expected_parameters(config: LlamaConfig) -> int:
    """Weight elements the config needs, by arithmetic (no table built): what `expected_tensors` sums to."""
    return weight_table(config).parameters()


def check_config_fits_files(config_path: Path, config: LlamaConfig, headers: Iterable[SafetensorsHeader]) -> None:
    """Refuse a config that needs more weight bytes than the files hold, before anything is sized from it.

    Every size may be within its bound and the product still absurd (a 1024-layer,
    131072-wide config next to a 1 MB file); the expected-tensor table and the engine's
    allocations follow the config, so the config must first agree with the bytes on disk.
    """
    held = sum(h.data_len for h in headers)
    needed = expected_parameters(config) * MIN_WEIGHT_BYTES
    if needed > held:
        raise _fail(config_path, f"the config needs {expected_parameters(config)} weight elements "
                    f"(at least {needed} bytes at {MIN_WEIGHT_BYTES} bytes each) but the safetensors "
                    f"files hold only {held} bytes of data: config.json does not describe these weights")


def expected_tensors(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the config needs, with its shape (the lm_head only when untied): the
    architecture's weight table, the one the engine loads by."""
    return weight_table(config).shapes()


def _ignorable(name: str, config: LlamaConfig) -> bool:
    # Old Llama exports carry the rotary buffer; tied checkpoints sometimes still carry a
    # copy of the head.  Both are harmless and ignored (the head is checked for shape).
    return name.endswith(".self_attn.rotary_emb.inv_freq") or (
        config.tie_word_embeddings and name == LM_HEAD
    )


def _check_shard_name(index_path: Path, name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise _fail(index_path, f"shard name {name!r} is not a file name")
    if os.path.isabs(name) or "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
        raise _fail(index_path, f"shard name {name!r} must be a plain file name in the model directory "
                    "(no '..', no absolute path, no subdirectory)")
    if not name.endswith(".safetensors"):
        raise _fail(index_path, f"shard name {name!r} is not a .safetensors file")
    return name


def _close_all(fds: dict[Path, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class Checkpoint:
    """A validated checkpoint: config, tensor table and lazily opened mmap handles.

    Each weight file stays open from validation on, and is mapped through that descriptor
    (``/proc/self/fd/N``), so the mapping is of the very file that was validated even if
    the path is renamed over meanwhile.  `verify_unchanged` compares that file's identity
    now with the one validated: the engine calls it before faulting in a layer, so a file
    truncated or rewritten in place is a WeightsChangedError, never a SIGBUS mid-request.

    ``fill``: set when the files are a node cache's partial view still filling
    (``warmpool_worker.partial_cache``): until it is complete the identity check leaves the mtime
    out (the fill writes blocks into the files); once complete, the files as they are then become
    the identities checked, mtime included.
    """

    def __init__(self, model_dir: Path, config: LlamaConfig, headers: list[SafetensorsHeader],
                 config_bytes: bytes, fill: PartialCache | None = None) -> None:
        self.model_dir = model_dir
        self.config = config
        self.headers = headers
        self.tensors: dict[str, TensorInfo] = {}
        for header in headers:
            self.tensors.update(header.tensors)
        self._config_bytes = config_bytes
        self._handles: dict[Path, Any] = {}
        self._handle_lock = threading.Lock()
        self._digest: str | None = None
        self._identities = {h.path: h.identity for h in headers if h.identity is not None}
        self._fds: dict[Path, int] = {}
        self.fill = fill
        self._finalizer = weakref.finalize(self, _close_all, self._fds)
        for header in headers:
            try:
                self._fds[header.path] = os.open(header.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as error:
                self.close()
                raise _fail(header.path, f"cannot open: {error}") from None
        try:
            self.verify_unchanged(self._fds)  # changed between the header read and the open
        except WeightsChangedError:
            self.close()
            raise

    def verify_unchanged(self, paths: Iterable[Path]) -> None:
        """Raise WeightsChangedError naming the file if any of these changed since validation."""
        paths = list(paths)
        filling = self.fill is not None and not self.fill.complete()
        if self.fill is not None and not filling:  # the fill completed: its files as they are now
            self.fill = None
            for path, open_fd in self._fds.items():
                with contextlib.suppress(OSError):
                    self._identities[path] = FileIdentity.of(os.fstat(open_fd))
        for path in paths:
            fd = self._fds.get(path)
            if fd is None:
                raise _fail(path, "weight file is not open (checkpoint closed)")
            expected = self._identities.get(path)
            if expected is None:
                continue
            try:
                now = FileIdentity.of(os.fstat(fd))
            except OSError as error:
                raise WeightsChangedError(f"{path}: cannot stat the validated weight file: {error}") from None
            changed = expected.differences(now, mtime=not filling)
            if changed:
                raise WeightsChangedError(
                    f"{path}: weight file changed in place since it was validated ({changed}); "
                    "its mapped pages can no longer be trusted: replace weights by rename, never "
                    "in place, and restart the worker")

    def descriptors(self) -> dict[Path, int]:
        """The read-only descriptor of each weight file, held open since validation (the
        worker takes its read leases on these: `weight_leases`)."""
        return dict(self._fds)

    @property
    def files(self) -> list[Path]:
        return [h.path for h in self.headers]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def digest(self) -> str:
        """sha256 over config.json, every tensor header and a small sample of each file's data.

        Headers alone cannot tell two fine-tunes of one architecture apart, so the first
        64 KiB of each file's data go in too: a few pages, read once, never the whole file.
        """
        if self._digest is None:
            h = hashlib.sha256(self._config_bytes)
            for header in self.headers:
                h.update(header.path.name.encode())
                for name in sorted(header.tensors):
                    t = header.tensors[name]
                    h.update(f"{name}|{t.dtype}|{t.shape}|{t.begin}|{t.end}\n".encode())
                fd = self._fds.get(header.path)
                if fd is None:
                    raise _fail(header.path, "weight file is not open (checkpoint closed)")
                h.update(os.pread(fd, DIGEST_SAMPLE_BYTES, header.data_start))
            self._digest = h.hexdigest()
        return self._digest

    def _handle(self, path: Path) -> Any:
        with self._handle_lock:
            handle = self._handles.get(path)
            if handle is None:
                from safetensors import safe_open  # imported on first tensor: keeps import cheap

                self.verify_unchanged([path])
                fd = self._fds[path]
                # Through our descriptor: the very inode validated, whatever the path names now.
                by_fd = Path(f"/proc/self/fd/{fd}")
                source = by_fd if by_fd.exists() else path
                try:
                    handle = safe_open(str(source), framework="pt", device="cpu")
                except Exception as error:  # the library's own errors are not one type
                    raise _fail(path, f"safetensors refused the file: {error}") from error
                self._handles[path] = handle
            return handle

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor as a CPU view of the mmap (no copy; pages are read when touched)."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.model_dir}: tensor {name!r} is not in the checkpoint")
        tensor: torch.Tensor = self._handle(info.file).get_tensor(name)
        if tuple(tensor.shape) != info.shape:  # belt and braces: the header we validated is what we got
            raise _fail(info.file, f"tensor {name!r} read back with shape {tuple(tensor.shape)}, "
                        f"header says {info.shape}")
        return tensor

    def iter_weights(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs, vLLM style, in the order asked for."""
        for name in names:
            yield name, self.get_tensor(name)

    def unmap(self) -> None:
        """Drop the safetensors mappings (sleep level 2); the descriptors stay open, so the next
        tensor re-maps the very files validated, after `verify_unchanged` checks them again."""
        with self._handle_lock:
            self._handles.clear()

    def close(self) -> None:
        with self._handle_lock:
            self._handles.clear()
            _close_all(self._fds)


def _refuse_pickle_or_missing(model_dir: Path) -> ModelLoadError:
    entries = sorted(p.name for p in model_dir.iterdir())
    pickles = [n for n in entries if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        return _fail(model_dir, f"only pickle-based weights found ({', '.join(pickles)}): refusing to load "
                     "pickle (it can run arbitrary code); convert the checkpoint to safetensors")
    others = [n for n in entries if n.endswith(".safetensors")]
    if others:
        return _fail(model_dir, f"found {', '.join(others)} but neither {SINGLE_FILE} nor {INDEX_FILE}")
    return _fail(model_dir, f"no safetensors weights: expected {SINGLE_FILE} or {INDEX_FILE}")


def open_checkpoint(model_dir: Path | str, fill: PartialCache | None = None) -> Checkpoint:
    """Validate a model directory and map its weights (headers only: fast, no full read).

    `fill`: the directory is a partial view still filling (see Checkpoint); the caller has
    waited for what this reads (``PartialCache.wait_openable``)."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise _fail(model_dir, "model directory does not exist")
    if not model_dir.is_dir():
        raise _fail(model_dir, "model path is not a directory")
    config_path = model_dir / CONFIG_FILE
    raw = read_json(config_path)
    config = parse_config(config_path, raw)
    config_bytes = config_path.read_bytes()

    index_path = model_dir / INDEX_FILE
    single_path = model_dir / SINGLE_FILE
    weight_map: dict[str, str] | None = None
    if index_path.exists():
        index = read_json(index_path)
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise _fail(index_path, "'weight_map' must be a non-empty object of tensor name -> shard file")
        weight_map = {}
        for name, shard in wm.items():
            _check_tensor_name(index_path, name)
            weight_map[name] = _check_shard_name(index_path, shard)
        shard_names = sorted(set(weight_map.values()))
        for shard in shard_names:
            if not (model_dir / shard).is_file():
                raise _fail(index_path, f"points at shard {shard!r}, which is missing from {model_dir}")
        headers = [read_safetensors_header(model_dir / shard) for shard in shard_names]
    elif single_path.exists():
        headers = [read_safetensors_header(single_path)]
    else:
        raise _refuse_pickle_or_missing(model_dir)

    seen: dict[str, Path] = {}
    for header in headers:
        for name in header.tensors:
            if name in seen:
                raise _fail(header.path, f"tensor {name!r} is also in {seen[name].name}")
            seen[name] = header.path
            if weight_map is not None and weight_map.get(name) != header.path.name:
                raise _fail(header.path, f"tensor {name!r} is not listed for this shard in {INDEX_FILE}")
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in seen:
                raise _fail(model_dir / shard, f"tensor {name!r} listed in {INDEX_FILE} is not in the shard")

    check_config_fits_files(config_path, config, headers)
    expected = expected_tensors(config)
    missing = sorted(set(expected) - set(seen))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise _fail(model_dir, f"missing tensors needed by config.json: {shown}")
    unexpected = sorted(n for n in seen if n not in expected and not _ignorable(n, config))
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        raise _fail(seen[unexpected[0]], f"unexpected tensors not used by a {config.model_type} model "
                    f"with this config: {shown}")
    tables = {name: info for h in headers for name, info in h.tensors.items()}
    h, v = config.hidden_size, config.vocab_size
    if config.tie_word_embeddings and LM_HEAD in tables:
        expected = {**expected, LM_HEAD: (v, h)}
    for name, shape in expected.items():
        info = tables[name]
        if info.shape != shape:
            raise _fail(info.file, f"tensor {name!r} has shape {list(info.shape)}, config.json needs {list(shape)}")
        if info.dtype not in FLOAT_DTYPES:
            raise _fail(info.file, f"tensor {name!r} has dtype {info.dtype}; weights must be F32, F16 or BF16")
    return Checkpoint(model_dir, config, headers, config_bytes, fill)


def read_generation_eos(model_dir: Path, config: LlamaConfig) -> tuple[int, ...]:
    """EOS ids: generation_config.json's when present (it is what HF generate uses), else config's."""
    path = model_dir / GENERATION_CONFIG_FILE
    ids: list[int] = []
    if path.exists():
        ids.extend(_eos_ids(read_json(path).get("eos_token_id")))
    for eos in config.eos_token_ids:
        if eos not in ids:
            ids.append(eos)
    return tuple(ids)
