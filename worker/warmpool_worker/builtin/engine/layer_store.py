"""The engine's weights: mapped at start, materialised on the device layer by layer.

The weight table names every tensor (the same table validated the checkpoint), so a tensor
the table needs and the checkpoint lacks fails the load naming it; nothing is skipped.
Embeddings and final norm come first, then decoder layers in whatever order they are asked
for, then an untied output head: the head is as large as the embeddings (2 x 125 MiB of a
1 GB model), and loaded first it held back the first layer, on a node cache still filling
most of all (a worker starts on the bytes as they arrive).  A tied head is the embedding
matrix, already there.  Whatever a forward pass needs before the loader got to it (a layer,
the head) is loaded right there, under the same lock, so a request never sees a missing weight.

On CPU, in the checkpoint's own dtype, a weight is the file's mapping itself (zero copy):
loading a layer faults its pages in, in order.  Other dtypes convert in one pass.  On CUDA,
copies go through the pinned stager.  Before any page of a layer is touched, the files under
it are checked to be the ones validated (WeightsChangedError otherwise, never a SIGBUS), and on
a node cache's partial view (``Checkpoint.fill``) its tensors' bytes are waited for, bounded
(``partial_cache.PartialCache.wait``: a PartialCacheError names the file and layer otherwise).

Sleep (`release` / `restore`, vLLM's levels):

* level 1 -- on CUDA every resident weight is copied to a pinned host tensor and its device
  memory freed; `restore` copies them back at bus speed.  On CPU in the checkpoint's dtype the
  weights ARE the file mapping, so there is nothing to move: the resident views are dropped
  (converted copies of another dtype are freed) and `restore` re-materialises the same layers
  from the mapping, which is still open.
* level 2 -- nothing is kept: device memory and converted copies are freed, and the
  checkpoint's mappings are closed too (`Checkpoint.unmap`), so the mapped pages leave the
  process.  `restore` re-maps the files through the descriptors held since validation, after
  checking they are still the files validated (WeightsChangedError otherwise).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Iterator, Sequence

import torch
from warmpool_worker.builtin.engine.linear import LINEAR_KEYS, can_pack, dense, pack
from warmpool_worker.builtin.engine.mapped_pages import fault_in, read_ahead
from warmpool_worker.builtin.engine.pinned_stager import PinnedStager
from warmpool_worker.checkpoint import Checkpoint
from warmpool_worker.engine_api import LayerProgress, ModelLoadError, WeightsChangedError
from warmpool_worker.weight_table import WeightTable, weight_table

#: key -> tensor for one group (core or one decoder layer); keys are the weight table's.
Weights = dict[str, torch.Tensor]


class LayerStore:
    def __init__(self, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype) -> None:
        self.checkpoint = checkpoint
        self.table: WeightTable = weight_table(checkpoint.config)
        self.device = device
        self.dtype = dtype
        self._pack = can_pack(dtype, device)
        self._inputs: Weights | None = None  # embeddings and final norm: before any layer
        self._core: Weights | None = None  # the inputs and the head: what a forward pass needs
        self._layers: list[Weights | None] = [None] * self.table.num_layers
        self._lock = threading.RLock()
        self._stager: PinnedStager | None = None
        self.load_seconds: dict[int, float] = {}
        self.bytes_loaded = 0
        #: While asleep: the layers resident when sleep began (restored in this order) and,
        #: at level 1 on CUDA, the pinned host copies of every weight (None elsewhere).
        self._slept_layers: list[int] | None = None
        self._host_core: Weights | None = None
        self._host_layers: dict[int, Weights] = {}

    @property
    def num_layers(self) -> int:
        return self.table.num_layers

    def layers_resident(self) -> int:
        return sum(layer is not None for layer in self._layers)

    def is_layer_resident(self, index: int) -> bool:
        return self._layers[index] is not None

    def materialise(self, tensor: torch.Tensor, linear: bool = False) -> torch.Tensor:
        """One checkpoint tensor (a CPU view of the mapping) as the compute tensor on the device;
        `linear`: a matrix of a linear layer, packed when converted (`engine.linear`)."""
        if self.device.type == "cuda":
            if self._stager is None:
                self._stager = PinnedStager(self.device)
            return self._stager.to_device(tensor, self.dtype)
        if tensor.dtype == self.dtype:
            # CPU, same dtype: use the weights where they lie, in the file's mapping (no
            # copy, no second resident copy).  safetensors maps the file copy-on-write
            # (MAP_PRIVATE), so the tensor is writable and a stray in-place op could never
            # reach the file -- but nothing here writes to a weight.  Loading = mapping
            # every page now, sequentially, instead of a fault per page in the first request.
            fault_in(tensor)
            return tensor
        # CPU, another dtype: convert in one pass into a preallocated tensor (a linear layer's
        # matrix then packed for oneDNN: the copy it replaces is freed).
        out = torch.empty(tensor.shape, dtype=self.dtype)
        out.copy_(tensor)
        return pack(out) if linear and self._pack else out

    def _load_named(self, parts: Sequence[tuple[str, str]], what: str) -> Weights:
        tensors = self.checkpoint.tensors
        missing = [name for _, name in parts if name not in tensors]
        if missing:  # the table needs it: loading without it would compute a different model
            raise ModelLoadError(f"{self.checkpoint.model_dir}: tensors the {self.checkpoint.config.model_type} "
                                 f"weight table needs are not in the checkpoint: {', '.join(missing)}")
        fill = self.checkpoint.fill
        if fill is not None:  # a partial view still filling: the bytes first (bounded wait)
            starts = {h.path: h.data_start for h in self.checkpoint.headers}
            for _, name in parts:
                info = tensors[name]
                fill.wait(info.file, starts[info.file] + info.begin, starts[info.file] + info.end,
                          f"{what}: tensor {name!r}")
        # The files under the mapping must still be the ones validated: a file truncated in
        # place would SIGBUS on the first page touched below, one rewritten would be garbage.
        self.checkpoint.verify_unchanged({tensors[name].file for _, name in parts})
        keys = {name: key for key, name in parts}
        out: Weights = {}
        with torch.inference_mode():
            sources = list(self.checkpoint.iter_weights(name for _, name in parts))
            if self.device.type == "cpu":
                for _, source in sources:  # start reading the whole layer ahead (cold cache)
                    read_ahead(source)
            for name, source in sources:
                try:
                    tensor = self.materialise(source, linear=keys[name] in LINEAR_KEYS)
                except WeightsChangedError as error:
                    raise WeightsChangedError(f"{tensors[name].file}: tensor {name!r}: {error}") from None
                out[keys[name]] = tensor
                self.bytes_loaded += tensor.numel() * tensor.element_size()
            if self._stager is not None:
                self._stager.finish()
        return out

    def core(self) -> Weights:
        """Embeddings, final norm and head (the embedding matrix when tied), loaded on first use."""
        core = self._core
        if core is not None:
            return core
        with self._lock:
            if self._core is None:
                inputs = self._core_inputs()
                if self.table.tied_head:
                    embed = inputs["embed"]
                    converted = not _stored_as(self.checkpoint, "model.embed_tokens.weight", self.dtype)
                    head = pack(embed) if self._pack and converted else embed
                else:
                    head = self._load_named(self._head_names(), "the output head")["head"]
                self._core = {**inputs, "head": head}
            return self._core

    def _core_inputs(self) -> Weights:
        """Embeddings and final norm, loaded on first use (what the loader takes before any layer)."""
        with self._lock:
            if self._inputs is None:
                names = [(key, name) for key, name in self.table.core_names() if key != "head"]
                self._inputs = self._load_named(names, "the embeddings and final norm")
            return self._inputs

    def _head_names(self) -> list[tuple[str, str]]:
        return [(key, name) for key, name in self.table.core_names() if key == "head"]

    def layer(self, index: int) -> Weights:
        """Decoder layer `index`, loaded on first use."""
        layer = self._layers[index]
        if layer is not None:  # fast path: no lock once resident
            return layer
        with self._lock:
            layer = self._layers[index]
            if layer is None:
                started = time.perf_counter()
                layer = self._load_named(self.table.layer_names(index), f"layer {index}")
                self.load_seconds[index] = time.perf_counter() - started
                self._layers[index] = layer  # published only once complete
            return layer

    def load_layers(self, order: Sequence[int], progress: LayerProgress | None = None) -> None:
        total = self.num_layers
        bad = [i for i in order if not isinstance(i, int) or not 0 <= i < total]
        if bad:
            raise ValueError(f"layer indices out of range 0..{total - 1}: {bad[:5]}")
        self._core_inputs()
        for index in order:
            self.layer(index)
            if progress is not None:
                progress(self.layers_resident(), total, index)
        if not order or self.layers_resident() == total:
            self.core()  # an untied head once the layers are in (or asked for alone), else on first use

    def resident(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) of every weight materialised now, core first (a tied head
        is the embedding and is not listed twice)."""
        core = self._core or self._inputs or {}
        for key, name in self.table.core_names():
            if key in core:
                yield name, core[key]
        for index, layer in enumerate(self._layers):
            if layer is not None:
                for key, name in self.table.layer_names(index):
                    yield name, layer[key]

    def first_non_finite(self) -> str | None:
        """The checkpoint name of the first resident weight holding NaN/Inf (an error path only)."""
        with torch.inference_mode():
            for name, tensor in self.resident():
                values = dense(tensor)
                if values.is_floating_point() and not bool(torch.isfinite(values).all()):
                    return name
        return None

    # ---- sleep -----------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return self._slept_layers is not None

    def release(self, level: int) -> None:
        """Free the materialised weights for sleep at `level` (1 or 2; module docstring)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        with self._lock:
            if self._slept_layers is not None:
                return
            resident = [i for i, layer in enumerate(self._layers) if layer is not None]
            if level == 1 and self.device.type == "cuda":
                self._host_core = _to_pinned_host(self._core or self._inputs or {})
                self._host_layers = {i: _to_pinned_host(self._layers[i] or {}) for i in resident}
            self._core = self._inputs = None
            self._layers = [None] * self.num_layers
            if level == 2:
                self.checkpoint.unmap()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
            else:
                _trim_heap()
            self._slept_layers = resident

    def restore(self) -> None:
        """Make resident again every layer (and the core) that was before `release`."""
        with self._lock:
            order = self._slept_layers
            if order is None:
                return
            if self._host_core is not None:
                with torch.inference_mode():
                    core = {k: t.to(self.device, non_blocking=True) for k, t in self._host_core.items()
                            if not (self.table.tied_head and k == "head")}
                    if self.table.tied_head and "embed" in core:
                        core["head"] = core["embed"]
                    layers = {i: {k: t.to(self.device, non_blocking=True) for k, t in w.items()}
                              for i, w in self._host_layers.items()}
                    torch.cuda.synchronize(self.device)
                self._inputs = {key: tensor for key, tensor in core.items() if key != "head"} or None
                self._core = core if "head" in core else None  # released before its head was loaded
                for index, weights in layers.items():
                    self._layers[index] = weights
                self._host_core = None
                self._host_layers = {}
            else:
                self.load_layers(order)
                self.core()
            self._slept_layers = None


_STORED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _stored_as(checkpoint: Checkpoint, name: str, dtype: torch.dtype) -> bool:
    """Whether the file holds this tensor in `dtype` (then on CPU it is served zero copy, and a
    packed copy would double what it holds)."""
    return _STORED_DTYPES.get(checkpoint.tensors[name].dtype) == dtype


def _trim_heap() -> None:
    """Hand freed heap back to the OS (glibc's malloc_trim).  Without it, converted copies
    allocated below glibc's (adaptive, up to 32 MiB) mmap threshold stay in the process's
    heap after they are freed, and sleep would release a fraction of what it dropped."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim with
        pass


def _to_pinned_host(weights: Weights) -> Weights:
    """Page-locked host copies (a tied head is copied once and stays one tensor)."""
    copies: dict[int, torch.Tensor] = {}
    out: Weights = {}
    with torch.inference_mode():
        for key, tensor in weights.items():
            host = copies.get(id(tensor))
            if host is None:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor)
                copies[id(tensor)] = host
            out[key] = host
    return out
