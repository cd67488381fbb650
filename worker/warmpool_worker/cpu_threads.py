"""How many intra-op threads torch should use: the pod's CPU, not the node's.

torch defaults to one thread per core of the *node*.  In a pod with a CPU quota, or with
several workers on one node, those threads spin against each other and against the CFS
quota: `make demo` measured a 32-token prefill at 2.1 s with two workers on a 2-core node,
against ~0.2 s with one thread each.  So the worker sizes torch's threads from the
container's cgroup v2 ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``), capped
by the CPUs the process may run on (its affinity mask: cpusets), unless ``--threads``
or an explicit ``OMP_NUM_THREADS`` (torch's own knob, which the benchmarks set for every
variant alike) says otherwise.

A quota of 1.5 CPUs gives 1 thread, not 2: two busy threads on 1.5 CPUs of quota are
throttled for a third of every period, which costs more than the half CPU left idle.
Only the standard library is used here: the module is on the start-up path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from warmpool.contract.numerals import ascii_int_or_none, shown

log = logging.getLogger(__name__)

#: Where cgroup v2 is mounted (inside a container: the container's own cgroup).
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: This process's cgroup membership; the v2 line reads ``0::/path/inside/the/root``.
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CPU_MAX_FILE = "cpu.max"
#: The OpenMP variable torch reads at start-up: set explicitly, it is a choice we keep.
OMP_ENV = "OMP_NUM_THREADS"
#: The most threads an OMP_NUM_THREADS may ask for (far more cores than any node has).
MAX_THREADS = 4096


def threads_from_cpu_max(cpu_max: str | None, cpu_count: int) -> int:
    """Threads for a cgroup v2 ``cpu.max`` text and the CPUs available; unlimited/garbage -> cpu_count.

    ``"max 100000"`` -> cpu_count; ``"150000 100000"`` -> 1; ``"250000 100000"`` -> 2;
    ``"50000 100000"`` -> 1 (never 0); never more than cpu_count, never fewer than 1.
    """
    cpus = max(1, cpu_count)
    quota_cpus = _quota_cpus(cpu_max)
    if quota_cpus is None:
        return cpus
    return max(1, min(cpus, int(quota_cpus)))


def _quota_cpus(cpu_max: str | None) -> float | None:
    """The quota in CPUs, or None when unlimited or unreadable (we then know nothing better)."""
    if cpu_max is None:
        return None
    fields = cpu_max.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which honours cpusets), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def own_cgroup_dirs(root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> list[Path]:
    """This process's cgroup directory under `root` and each parent up to `root`, innermost first.

    A limit on any ancestor caps the process too, so every level is read.  Inside a
    container with a cgroup namespace the path is ``/`` and this is just ``[root]``.
    """
    relative = "/"
    try:
        for line in proc_self_cgroup.read_text(encoding="utf-8").splitlines():
            if line.startswith("0::"):
                relative = line[3:].strip() or "/"
                break
    except OSError:
        pass
    parts = [part for part in relative.split("/") if part]
    if ".." in parts:  # a path that would escape the root: trust only the root itself
        parts = []
    dirs = [root.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return dirs


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count and where it came from (logged at start-up)."""

    threads: int
    source: str


def cgroup_threads(cpu_count: int, root: Path = CGROUP_ROOT,
                   proc_self_cgroup: Path = PROC_SELF_CGROUP) -> ThreadChoice:
    """The strictest ``cpu.max`` on this process's cgroup path, as a thread count."""
    best = ThreadChoice(max(1, cpu_count), f"{cpu_count} available CPUs (no cgroup v2 CPU quota)")
    for directory in own_cgroup_dirs(root, proc_self_cgroup):
        path = directory / CPU_MAX_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        threads = threads_from_cpu_max(text, cpu_count)
        if _quota_cpus(text) is None and text.split()[:1] != ["max"]:
            log.warning("ignoring unreadable CPU quota in %s: %r", path, text.strip())
        if threads < best.threads:
            best = ThreadChoice(threads, f"{path} = {text.strip()!r} ({cpu_count} available CPUs)")
    return best


def choose_threads(requested: int | None, root: Path = CGROUP_ROOT,
                   proc_self_cgroup: Path = PROC_SELF_CGROUP,
                   environ: Mapping[str, str] = os.environ) -> ThreadChoice:
    """--threads when given, else an explicit OMP_NUM_THREADS, else the cgroup quota capped
    by the available CPUs."""
    if requested is not None:
        return ThreadChoice(requested, "--threads")
    omp = environ.get(OMP_ENV, "").strip()
    if omp:
        threads = ascii_int_or_none(omp, MAX_THREADS, minimum=1)
        if threads is not None:
            return ThreadChoice(threads, f"{OMP_ENV}={omp}")
        log.warning("ignoring %s=%s: not a whole number in [1, %d] in ASCII digits", OMP_ENV, shown(omp), MAX_THREADS)
    return cgroup_threads(available_cpus(), root, proc_self_cgroup)
