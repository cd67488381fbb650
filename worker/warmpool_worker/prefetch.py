"""Page-cache prefetch of an external engine's weight files, hottest layers first.

The sidecar runs beside an engine (vLLM, SGLang, TGI) that reads its own weights; what the
sidecar can do is make those reads hit the page cache.  It starts before the engine has
even imported torch, so by the time the engine maps its shards the bytes are in memory.

* **Map** (`map_weights`): every safetensors header is parsed and validated with the
  built-in engine's own reader (`checkpoint.read_safetensors_header`, sharded index
  included), and each tensor's byte range is assigned to its decoder layer (``layers.N``,
  ``h.N``, ``blocks.N``) or to the *core* (embeddings, final norm, head, the headers
  themselves: every forward pass needs them).  A file that is missing, truncated or has a
  lying header is reported and skipped; the others are still prefetched.  Weight files in
  other formats (``.gguf``) have no layer map here and are prefetched whole.
* **Plan** (`plan_prefetch`): by tier, like the warm-up plan: ``paused`` -> nothing;
  ``truncated`` -> core + the hottest ``hot_layer_percent`` of layers; ``full`` /
  ``unknown`` -> everything, core first, then layers in heat order.
* **Run** (`Prefetcher.run`): ``posix_fadvise(WILLNEED)`` on the *next* group while the
  current one is read with ``preadv`` into one reused buffer.  WILLNEED alone is a hint the
  kernel may cut short (readahead limits, memory pressure), so the read makes residency
  certain and gives honest progress; ``mode="advise"`` skips the read where a copy costs
  too much CPU.  Python has no ``os.readahead``; WILLNEED is what it maps to on Linux.
* **Measure** (`resident_bytes`): ``mincore(2)`` on a ``PROT_READ`` mapping made with
  ctypes (mapping without touching faults nothing in, so the measurement does not disturb
  what it measures).  Where mincore is unavailable the figure is None (unknown), never 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from warmpool_worker.checkpoint import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    _check_shard_name,
    read_json,
    read_safetensors_header,
)
from warmpool_worker.engine_api import ModelLoadError

from warmpool.contract.api import DEFAULT_HOT_LAYER_PERCENT, Tier
from warmpool.heatmap import hot_layers

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
#: Read chunk: large enough for the disk to stream, small enough to stop promptly on a tier change.
CHUNK_BYTES = 8 * 1024 * 1024
#: WILLNEED step: at or below the kernel's per-call cap on common block devices.
ADVISE_STEP_BYTES = 256 * 1024
#: Weight files that are not safetensors but worth prefetching whole (llama.cpp's format).
WHOLE_FILE_SUFFIXES = (".gguf",)
#: A decoder layer's index in a tensor name, for the common families (Llama `model.layers.N.`,
#: GPT-2/Falcon `transformer.h.N.`, MPT/others `blocks.N.`); N in ASCII digits, at most five (the
#: operator's bound on layers), as the node agent reads it (warmpool_nodecache.agent).
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.([0-9]{1,5})\.", re.ASCII)

CORE = "core"


@dataclass(frozen=True)
class ByteRange:
    """[start, end) in absolute file offsets."""

    path: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class PrefetchGroup:
    """Bytes fetched together: the core, one layer, or one whole unmapped file."""

    name: str
    layer: int | None
    ranges: list[ByteRange] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranges)


@dataclass
class WeightMap:
    model_dir: Path
    core: PrefetchGroup
    layers: dict[int, PrefetchGroup]
    whole_files: list[PrefetchGroup]
    num_layers: int
    files: list[Path]
    errors: list[str]

    @property
    def total_bytes(self) -> int:
        return (
            self.core.nbytes
            + sum(g.nbytes for g in self.layers.values())
            + sum(g.nbytes for g in self.whole_files)
        )


def _merge(ranges: Iterable[ByteRange]) -> list[ByteRange]:
    """Adjacent or overlapping ranges of one file joined, so reads stream instead of seeking."""
    merged: list[ByteRange] = []
    for r in sorted(ranges, key=lambda r: (str(r.path), r.start)):
        if r.nbytes <= 0:
            continue
        last = merged[-1] if merged else None
        if last is not None and last.path == r.path and r.start <= last.end:
            merged[-1] = ByteRange(r.path, last.start, max(last.end, r.end))
        else:
            merged.append(r)
    return merged


def layer_of(tensor_name: str) -> int | None:
    match = _LAYER_RE.search(tensor_name)
    return int(match.group(1)) if match else None


def _safetensors_files(model_dir: Path, errors: list[str]) -> list[Path]:
    """The shards the engine will read (sharded index first, as loaders do), missing ones reported."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        try:
            index = read_json(index_path)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelLoadError(f"{index_path}: 'weight_map' must be a non-empty object")
            names = sorted({_check_shard_name(index_path, shard) for shard in weight_map.values()})
        except ModelLoadError as error:
            errors.append(str(error))
            return []
        files = []
        for name in names:
            path = model_dir / name
            if path.is_file():
                files.append(path)
            else:
                errors.append(f"{index_path}: points at shard {name!r}, which is missing from {model_dir}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    return sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())


def _config_layers(model_dir: Path) -> int | None:
    path = model_dir / CONFIG_FILE
    if not path.exists():
        return None
    try:
        raw = read_json(path)
    except ModelLoadError:
        return None
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = raw.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def map_weights(model_dir: Path) -> WeightMap:
    """Byte ranges of every weight file, by layer; problems collected in `errors`, never raised."""
    errors: list[str] = []
    core = PrefetchGroup(CORE, None)
    by_layer: dict[int, list[ByteRange]] = {}
    core_ranges: list[ByteRange] = []
    whole: list[PrefetchGroup] = []
    files: list[Path] = []
    if not model_dir.is_dir():
        errors.append(f"{model_dir}: model directory does not exist")
        return WeightMap(model_dir, core, {}, [], 0, [], errors)
    for path in _safetensors_files(model_dir, errors):
        try:
            header = read_safetensors_header(path)
        except ModelLoadError as error:
            errors.append(str(error))
            continue
        files.append(path)
        core_ranges.append(ByteRange(path, 0, header.data_start))  # the engine parses it first
        for info in header.tensors.values():
            span = ByteRange(path, header.data_start + info.begin, header.data_start + info.end)
            layer = layer_of(info.name)
            if layer is None:
                core_ranges.append(span)
            else:
                by_layer.setdefault(layer, []).append(span)
    for path in sorted(model_dir.iterdir()):
        if path.suffix in WHOLE_FILE_SUFFIXES and path.is_file():
            size = path.stat().st_size
            if size > 0:
                files.append(path)
                whole.append(PrefetchGroup(f"file {path.name}", None, [ByteRange(path, 0, size)]))
    if not files and not errors:
        errors.append(f"{model_dir}: no weight files (*.safetensors, {', '.join(WHOLE_FILE_SUFFIXES)})")
    core.ranges = _merge(core_ranges)
    layers = {i: PrefetchGroup(f"layer {i}", i, _merge(r)) for i, r in sorted(by_layer.items())}
    num_layers = _config_layers(model_dir) or (max(layers) + 1 if layers else 0)
    return WeightMap(model_dir, core, layers, whole, num_layers, files, errors)


def plan_prefetch(
    weights: WeightMap,
    tier: Tier,
    order: Sequence[int],
    hot_layer_percent: float = DEFAULT_HOT_LAYER_PERCENT,
) -> list[PrefetchGroup]:
    """Groups to fetch at this tier, in fetch order (see the module docstring)."""
    if tier is Tier.PAUSED:
        return []
    known = [i for i in order if i in weights.layers]
    # layers the order does not name (a heat map for fewer layers) still come, after it
    known += [i for i in sorted(weights.layers) if i not in set(known)]
    groups = [weights.core] if weights.core.ranges else []
    if tier is Tier.TRUNCATED:
        groups += [weights.layers[i] for i in hot_layers(known, hot_layer_percent)]
        return groups  # whole files have no layer map: no hot share to pick from them
    groups += [weights.layers[i] for i in known]
    return groups + list(weights.whole_files)


# -- residency (mincore) -------------------------------------------------------------
class _Libc:
    """mmap/mincore/munmap through ctypes: Python's mmap object hides the address mincore needs."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self.mmap = lib.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
        ]
        self.munmap = lib.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.mincore = lib.mincore
        self.mincore.restype = ctypes.c_int
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


_libc: _Libc | None = None
_libc_lock = threading.Lock()
_MAP_FAILED = ctypes.c_void_p(-1).value


def _get_libc() -> _Libc | None:
    global _libc
    with _libc_lock:
        if _libc is None:
            try:
                _libc = _Libc()
            except (OSError, AttributeError) as error:  # not Linux/glibc-like: residency unknown
                log.debug("mincore unavailable: %s", error)
                return None
        return _libc


def page_residency(path: Path) -> bytearray | None:
    """One byte per page of `path`, bit 0 set where the page is in the page cache; None if unknown."""
    libc = _get_libc()
    if libc is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return bytearray()
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            return None
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, vec) != 0:
                return None
            return bytearray(vec)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def resident_bytes(ranges: Iterable[ByteRange]) -> tuple[int, int] | None:
    """(bytes resident, bytes in total) over `ranges`, counted in whole pages; None if unknown."""
    by_file: dict[Path, list[ByteRange]] = {}
    for r in ranges:
        by_file.setdefault(r.path, []).append(r)
    resident = total = 0
    for path, spans in by_file.items():
        vec = page_residency(path)
        if vec is None:
            return None
        for span in _merge(spans):
            first, last = span.start // PAGE, min(len(vec), math.ceil(span.end / PAGE))
            total += (last - first) * PAGE
            window = vec[first:last]
            # mincore sets bit 0 for a resident page and leaves the other bits 0 (reserved):
            # counting non-zero bytes in C keeps a 100 GB model's 25M pages cheap to measure
            resident += (len(window) - window.count(0)) * PAGE
    return resident, total


def evict(paths: Iterable[Path]) -> None:
    """Drop these files' clean pages from the page cache (POSIX_FADV_DONTNEED): for tests and benches."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- running -------------------------------------------------------------------------
class PrefetchStopped(Exception):
    """Cut short: the tier became stricter (or the sidecar is stopping)."""


@dataclass
class PrefetchReport:
    """What the prefetch has done so far; read by /readyz and the metrics."""

    tier: Tier | None = None
    target_bytes: int = 0
    read_bytes: int = 0
    groups_done: int = 0
    groups_planned: int = 0
    layers_done: int = 0
    resident_before: int | None = None  # bytes of the target resident before we started
    resident_after: int | None = None  # ... and after
    seconds: float = 0.0
    state: str = "idle"  # idle | running | done | stopped | skipped
    errors: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, object]:
        return {
            "state": self.state,
            "tier": None if self.tier is None else self.tier.value,
            "target_bytes": self.target_bytes,
            "read_bytes": self.read_bytes,
            "groups": f"{self.groups_done}/{self.groups_planned}",
            "layers_done": self.layers_done,
            "resident_bytes_before": self.resident_before,
            "resident_bytes_after": self.resident_after,
            "seconds": round(self.seconds, 3),
            "errors": list(self.errors),
        }


ProgressCallback = Callable[[PrefetchReport], None]


class Prefetcher:
    """Runs plans over one WeightMap; remembers what is done, so a deeper tier only tops up."""

    def __init__(self, weights: WeightMap, mode: str = "read", chunk_bytes: int = CHUNK_BYTES) -> None:
        if mode not in ("read", "advise"):
            raise ValueError(f"prefetch mode must be 'read' or 'advise', got {mode!r}")
        self.weights = weights
        self.mode = mode
        self.chunk_bytes = chunk_bytes
        self.done: set[str] = set()
        self.failed: set[str] = set()  # read errors: reported once, not retried every tick
        self.report = PrefetchReport(errors=list(weights.errors))
        self._fds: dict[Path, int] = {}

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            # No kernel readahead on *our* descriptor (it is per open file, the engine's are
            # untouched): with read_ahead_kb often in megabytes, a truncated tier would pull
            # in cold layers past each hot range.  WILLNEED and our own large reads already
            # cover exactly the ranges we want, so nothing is lost.
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._fds[path] = fd
        return fd

    def _advise(self, group: PrefetchGroup) -> None:
        for r in group.ranges:
            try:
                fd = self._fd(r.path)
                # Linux caps one WILLNEED at max(readahead window, device max request) -- with
                # our FADV_RANDOM that is the device's, often 512 KiB -- and silently drops the
                # rest (measured: one call over 1 GB left 75 MB resident).  Step below the cap.
                for start in range(r.start, r.end, ADVISE_STEP_BYTES):
                    os.posix_fadvise(fd, start, min(ADVISE_STEP_BYTES, r.end - start), os.POSIX_FADV_WILLNEED)
            except OSError as error:  # a hint failing is not a reason to stop; the read will tell
                log.debug("fadvise %s: %s", r.path, error)

    def _read(self, group: PrefetchGroup, buffer: memoryview, should_stop: Callable[[], bool],
              on_bytes: Callable[[int], None]) -> None:
        for r in group.ranges:
            fd = self._fd(r.path)
            offset = r.start
            while offset < r.end:
                if should_stop():
                    raise PrefetchStopped("stop requested")
                want = min(len(buffer), r.end - offset)
                got = os.preadv(fd, [buffer[:want]], offset)
                if got <= 0:  # the file shrank under us: the header promised more bytes
                    raise OSError(f"{r.path}: short read at byte {offset} (file truncated while reading?)")
                offset += got
                on_bytes(got)

    def run(
        self,
        groups: Sequence[PrefetchGroup],
        tier: Tier,
        should_stop: Callable[[], bool] = lambda: False,
        on_progress: ProgressCallback | None = None,
        measure: bool = True,
    ) -> PrefetchReport:
        """Fetch the groups not yet done, in order; raises PrefetchStopped when told to stop."""
        todo = [g for g in groups if g.name not in self.done and g.name not in self.failed]
        report = self.report
        report.tier = tier
        report.groups_planned = len(groups)
        report.target_bytes = sum(g.nbytes for g in groups)
        target = [r for g in groups for r in g.ranges]
        if measure and report.resident_before is None:
            before = resident_bytes(target)
            report.resident_before = None if before is None else before[0]
        if not todo:
            report.state = "done" if groups else "skipped"
            if measure:
                after = resident_bytes(target)
                report.resident_after = None if after is None else after[0]
            return report
        report.state = "running"
        started = time.monotonic()
        buffer = memoryview(bytearray(self.chunk_bytes))
        last_log = [started, 0]

        def on_bytes(count: int) -> None:
            report.read_bytes += count
            now = time.monotonic()
            if now - last_log[0] >= 1.0:  # plain log lines: nobody watches a pod's terminal
                rate = (report.read_bytes - last_log[1]) / (now - last_log[0]) / 1e6
                log.info("prefetch: %d/%d MB (%.0f MB/s)", report.read_bytes >> 20, report.target_bytes >> 20,
                         rate)
                last_log[0], last_log[1] = now, report.read_bytes
            if on_progress is not None:
                on_progress(report)

        try:
            self._fetch(todo, groups, buffer, should_stop, on_bytes, on_progress)
            report.state = "done"
        except PrefetchStopped:
            report.state = "stopped"
            raise
        finally:
            report.seconds += time.monotonic() - started
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            if measure:
                after = resident_bytes(target)
                report.resident_after = None if after is None else after[0]
            if on_progress is not None:
                on_progress(report)
        log.info(
            "prefetch (%s): %d MB in %.2fs; resident %s -> %s of %d MB",
            tier.value,
            report.read_bytes >> 20,
            report.seconds,
            "?" if report.resident_before is None else f"{report.resident_before >> 20} MB",
            "?" if report.resident_after is None else f"{report.resident_after >> 20} MB",
            report.target_bytes >> 20,
        )
        return report

    def _fetch(self, todo: Sequence[PrefetchGroup], groups: Sequence[PrefetchGroup], buffer: memoryview,
               should_stop: Callable[[], bool], on_bytes: Callable[[int], None],
               on_progress: ProgressCallback | None) -> None:
        """Fetch ``todo`` in order, advising the next group while reading this one; a group whose
        read fails is reported and skipped (not retried every tick)."""
        report = self.report
        self._advise(todo[0])
        for position, group in enumerate(todo):
            if should_stop():
                raise PrefetchStopped("stop requested")
            if position + 1 < len(todo):
                self._advise(todo[position + 1])  # the kernel reads ahead while we read this one
            if self.mode == "read":
                try:
                    self._read(group, buffer, should_stop, on_bytes)
                except OSError as error:
                    message = f"{group.name}: {error}"
                    log.warning("prefetch: %s", message)
                    report.errors.append(message)
                    self.failed.add(group.name)
                    continue
            else:
                on_bytes(group.nbytes)
            self.done.add(group.name)
            report.groups_done = len([g for g in groups if g.name in self.done])
            report.layers_done = len([g for g in self.weights.layers.values() if g.name in self.done])
            if on_progress is not None:
                on_progress(report)
