"""Accelerator memory probes: how full is the memory this worker's warm-up competes for.

Chain, first that answers wins (each reading names its source):

1. ``nvml``: NVML (nvidia-ml-py) device-wide used/total; counts every process on the GPU,
   which is what a co-located pod's warm-up competes with.
2. ``torch_cuda``: ``torch.cuda.mem_get_info`` (free/total), only when torch is already
   imported and CUDA is available (we never import torch just to probe).
3. ``cgroup``: the container's cgroup, v2 ``memory.current`` (v1 ``memory.usage_in_bytes``)
   minus inactive file pages (the kubelet's "working set") over ``memory.max`` (v1
   ``memory.limit_in_bytes``); unlimited (v2 ``max``, v1 a page-rounded maximum) falls through.
   Without v1, a container with a memory limit on a cgroup v1 node would judge its tier by
   the whole host's memory (meminfo), not by its own limit.
4. ``meminfo``: ``/proc/meminfo`` MemTotal - MemAvailable over MemTotal.

On a CPU device the GPU probes are skipped (host memory *is* the accelerator then).

Or a configured capacity (``configured``): used = real usage of this process and its
descendants (resident anonymous memory on CPU; CUDA memory reserved by this process on a GPU) plus any
processes named as sharing the budget (e.g. an external engine beside the sidecar, or a
ballast process in tests), over the configured capacity.  Tests drive real usage across the
tier thresholds with real allocations this way.

No reading at all -> None: the tier is Unknown, never "0 % used".
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from warmpool.contract.numerals import ascii_int_or_none

log = logging.getLogger(__name__)
#: The largest device number read from ``cuda:N`` or CUDA_VISIBLE_DEVICES; anything else (a GPU
#: UUID, other scripts' digits) leaves the index as it was.
MAX_DEVICE_INDEX = 1023


@dataclass(frozen=True)
class MemoryReading:
    used_bytes: int
    capacity_bytes: int
    source: str

    @property
    def ratio(self) -> float:
        return self.used_bytes / self.capacity_bytes


class MemoryProbe(Protocol):
    def read(self) -> MemoryReading | None: ...


def _valid(used: int, capacity: int, source: str) -> MemoryReading | None:
    if capacity <= 0 or used < 0:
        return None
    return MemoryReading(used_bytes=used, capacity_bytes=capacity, source=source)


# -- NVML ---------------------------------------------------------------------------------
class NvmlProbe:
    """Device-wide memory of one GPU via NVML; disables itself after the first failure to init."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self._handle: Any = None
        self._broken = False

    def read(self) -> MemoryReading | None:
        if self._broken:
            return None
        try:
            import pynvml

            if self._handle is None:
                pynvml.nvmlInit()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            info = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
            return _valid(int(info.used), int(info.total), "nvml")
        except Exception as error:  # NVMLError has many subclasses; any failure means "not here"
            if self._handle is None:
                self._broken = True  # no driver / no device: do not pay the init every tick
                log.debug("NVML unavailable: %s", error)
            return None


# -- torch.cuda ---------------------------------------------------------------------------
def torch_cuda_reading(index: int = 0) -> MemoryReading | None:
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(index)
        return _valid(int(total) - int(free), int(total), "torch_cuda")
    except Exception as error:  # a broken CUDA runtime must not stop the chain
        log.debug("torch.cuda.mem_get_info failed: %s", error)
        return None


# -- cgroup v2 ----------------------------------------------------------------------------
def _own_cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's cgroup v2 directory (then the mount root, as seen inside a container)."""
    dirs: list[Path] = []
    try:
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                relative = line[3:].strip().lstrip("/")
                if relative:
                    dirs.append(root / relative)
    except OSError:
        pass
    dirs.append(root)
    return dirs


def cgroup_reading(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> MemoryReading | None:
    for directory in _own_cgroup_dirs(root, proc_cgroup):
        try:
            limit_text = (directory / "memory.max").read_text().strip()
            current = int((directory / "memory.current").read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max":
            return None  # unlimited: a ratio would be meaningless, let /proc/meminfo answer
        try:
            limit = int(limit_text)
        except ValueError:
            continue
        inactive_file = 0
        try:
            for line in (directory / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "inactive_file":
                    inactive_file = int(value)
                    break
        except (OSError, ValueError):
            pass
        # working set, as the kubelet counts it: reclaimable page cache is not pressure
        return _valid(max(0, current - inactive_file), limit, "cgroup")
    return None


# -- cgroup v1 ----------------------------------------------------------------------------
#: cgroup v1 says "no limit" with the largest page-aligned int64 (2**63 rounded down to a page);
#: anything at or above a pebibyte is taken for unlimited.
CGROUP_V1_UNLIMITED = 1 << 50


def _own_cgroup_v1_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's v1 memory cgroup (then the hierarchy's mount root: inside a container runc
    mounts the container's own cgroup there)."""
    dirs: list[Path] = []
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(",") and path.strip("/"):
                dirs.append(root / path.strip().lstrip("/"))
    except (OSError, ValueError):
        pass
    dirs.append(root)
    return dirs


def cgroup_v1_reading(
    root: Path = Path("/sys/fs/cgroup/memory"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> MemoryReading | None:
    for directory in _own_cgroup_v1_dirs(root, proc_cgroup):
        try:
            limit = int((directory / "memory.limit_in_bytes").read_text().strip())
            usage = int((directory / "memory.usage_in_bytes").read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= CGROUP_V1_UNLIMITED:
            return None  # unlimited: a ratio would be meaningless, let /proc/meminfo answer
        inactive_file = 0
        try:
            for line in (directory / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "total_inactive_file":
                    inactive_file = int(value)
                    break
        except (OSError, ValueError):
            pass
        return _valid(max(0, usage - inactive_file), limit, "cgroup")
    return None


# -- /proc/meminfo ------------------------------------------------------------------------
def meminfo_reading(path: Path = Path("/proc/meminfo")) -> MemoryReading | None:
    try:
        fields: dict[str, int] = {}
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                fields[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        total, available = fields["MemTotal"], fields["MemAvailable"]
    except (OSError, ValueError, KeyError):
        return None
    return _valid(total - available, total, "meminfo")


# -- configured capacity: real usage of a process tree -------------------------------------
def _parent_map(proc: Path) -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # the process exited while we looked
    return parents


def process_tree(roots: Iterable[int], proc: Path = Path("/proc")) -> set[int]:
    """These pids and all their descendants that are alive now."""
    parents = _parent_map(proc)
    members = {pid for pid in roots if pid in parents}
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in members and pid not in members:
                members.add(pid)
                grew = True
    return members


def rss_bytes(pid: int, proc: Path = Path("/proc")) -> int:
    """Resident anonymous + shared-memory bytes of a process (0 if it is gone).

    File-backed resident pages (libtorch's shared objects, mmap'd weight files) are left
    out: they are reclaimable page cache, come and go with the host's cache pressure, and
    would make the figure swing by hundreds of MB with no allocation behind it.
    """
    try:
        total = 0
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1]) * 1024
        return total
    except (OSError, ValueError, IndexError):
        return 0


class ConfiguredCapacityProbe:
    """Used = real usage of this process tree (+ accounted pids) against a configured capacity."""

    def __init__(
        self,
        capacity_bytes: int,
        device: str = "cpu",
        account_pids: Sequence[int] = (),
        proc: Path = Path("/proc"),
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"memory capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.device = device
        self.account_pids = tuple(account_pids)
        self.proc = proc

    def _cuda_reserved(self) -> int | None:
        torch: Any = sys.modules.get("torch")
        if torch is None or not self.device.startswith("cuda"):
            return None
        try:
            return int(torch.cuda.memory_reserved(self.device))
        except Exception:  # CUDA not initialised or gone: fall back to host RSS
            return None

    def read(self) -> MemoryReading | None:
        cuda = self._cuda_reserved()
        if cuda is not None:
            used = cuda
        else:
            members = process_tree([os.getpid(), *self.account_pids], self.proc)
            used = sum(rss_bytes(pid, self.proc) for pid in members)
        return _valid(used, self.capacity_bytes, "configured")


class ChainProbe:
    """The first probe in the chain that answers."""

    def __init__(self, probes: Sequence[Callable[[], MemoryReading | None]]) -> None:
        self.probes = list(probes)

    def read(self) -> MemoryReading | None:
        for probe in self.probes:
            reading = probe()
            if reading is not None:
                return reading
        return None


def _cuda_index(device: str) -> int:
    _, _, index = device.partition(":")
    return ascii_int_or_none(index, MAX_DEVICE_INDEX) or 0


def make_probe(
    device: str = "auto", capacity_bytes: int | None = None, account_pids: Sequence[int] = ()
) -> MemoryProbe:
    """The probe for this worker: a configured capacity if given, else the chain for the device."""
    if capacity_bytes is not None:
        return ConfiguredCapacityProbe(capacity_bytes, device=device, account_pids=account_pids)
    steps: list[Callable[[], MemoryReading | None]] = []
    if device != "cpu":
        index = _cuda_index(device)
        # NVML numbers devices physically; CUDA_VISIBLE_DEVICES may renumber them for torch
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        physical = ascii_int_or_none(visible[index].strip(), MAX_DEVICE_INDEX) if index < len(visible) else None
        nvml_index = index if physical is None else physical
        steps.append(NvmlProbe(nvml_index).read)
        steps.append(lambda: torch_cuda_reading(index))
    steps.append(cgroup_reading)
    steps.append(cgroup_v1_reading)
    steps.append(meminfo_reading)
    return ChainProbe(steps)
