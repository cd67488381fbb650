"""The built-in worker's first step, before its server binds: torch imported, sized and pointed at a device.

Three things, in this order, for every ``--device``:

1. the tokenizer's read begins in a thread (`TokenizerRead`: parsed in Rust with the GIL released,
   so it runs on another core while torch imports; not on a node cache's partial view, whose
   tokenizer.json may still be filling: the engine's loader waits for that file first);
2. torch is imported and its intra-op pool sized to the pod's CPU (`set_torch_threads`);
3. ``--device auto`` is resolved (that needs torch: ``cuda`` when it sees a GPU).

Why before the bind.  ``--device auto`` (what the operator's pods run) always imported torch
before binding, to resolve the device.  ``--device cpu`` imported it after, with the server up;
then every request the event loop answered while torch imported (a probe, a scrape) took the GIL
from the import: measured here, polling /readyz every 20 ms made torch's 1.2 s import 0.1 s
slower.  Nothing is served before weights are mapped anyway (``/readyz`` says loading), and the
kubelet's startup probe tolerates a port that is not open yet.  With the tokenizer's read begun
first, the pods' path (auto) now overlaps the parse with the import too: before, it began after.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from warmpool_worker.config import ServeConfig
from warmpool_worker.cpu_threads import choose_threads
from warmpool_worker.device import import_torch, resolve_device
from warmpool_worker.tokenizer_file import TokenizerRead

log = logging.getLogger("warmpool.worker")


@dataclass(frozen=True)
class TorchStart:
    """What the first step leaves for the rest of the start."""

    device: str  # resolved: never ``auto``
    tokenizer: TokenizerRead | None  # the read begun, or None on a partial view (the loader reads it)
    threads: int  # torch's intra-op threads, as torch reports them


def start_torch(config: ServeConfig) -> TorchStart:
    """Blocking (about torch's import time): the module docstring's three steps."""
    tokenizer = TokenizerRead(config.model) if config.partial_cache is None else None
    threads = set_torch_threads(config.threads, config.cgroup_root)
    return TorchStart(resolve_device(config.device), tokenizer, threads)


def set_torch_threads(requested: int | None, cgroup_root: Path) -> int:
    """Size torch's intra-op pool to the pod's CPU (see cpu_threads), before any engine work.

    Logged with torch's own reading back, so the log shows what torch will actually use.
    """
    choice = choose_threads(requested, cgroup_root)
    torch = import_torch()  # the sizing must come before torch's first op

    torch.set_num_threads(choice.threads)
    actual = int(torch.get_num_threads())
    log.info("torch intra-op threads: %d (from %s)", actual, choice.source)
    return actual
