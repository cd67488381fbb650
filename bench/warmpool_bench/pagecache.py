"""Page-cache control for the cold/warm variants: evict, warm, and measure residency.

Eviction is `posix_fadvise(POSIX_FADV_DONTNEED)` per file: it drops the file's clean,
unmapped pages, which is what "cold" means for a model whose bytes are on a local disk
(no root, no `drop_caches`, and the rest of the machine's cache is left alone).
Residency is measured with mincore(2), via the worker's own helper, so a run records
how cold or warm it really started instead of assuming the advice was taken.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path

#: Plain sequential reads in chunks this large: big enough that syscall overhead is noise.
READ_CHUNK = 16 * 1024 * 1024


def evict_files(paths: Iterable[Path]) -> None:
    """Drop these files' pages from the page cache (best effort: mapped or dirty pages stay)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            # a file just written still has dirty pages, which DONTNEED cannot drop: flush first
            with contextlib.suppress(OSError):
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(paths: Iterable[Path], chunk: int = READ_CHUNK) -> tuple[int, float]:
    """Read the files start to end with plain `readinto` calls: (bytes read, seconds).

    This is the physical floor a loader is compared with: the same bytes, the same
    cache state, no parsing, no copies beyond the one buffer.
    """
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    total = 0
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while True:
                count = handle.readinto(view)
                if not count:
                    break
                total += count
    return total, time.perf_counter() - started


def resident_fraction(paths: Iterable[Path]) -> float | None:
    """Share of the files' pages in the page cache (0..1); None where mincore is unavailable."""
    from warmpool_worker.prefetch import page_residency

    resident = pages = 0
    for path in paths:
        vec = page_residency(path)
        if vec is None:
            return None
        pages += len(vec)
        # mincore sets only bit 0 of each byte: a non-zero byte is a resident page
        resident += len(vec) - vec.count(0)
    return resident / pages if pages else 1.0


def make_warm(paths: list[Path], threshold: float = 0.999) -> float | None:
    """Read the files once unless (nearly) all their pages are already cached; the residency after."""
    before = resident_fraction(paths)
    if before is None or before < threshold:
        read_files(paths)
    return resident_fraction(paths)


def make_cold(paths: list[Path]) -> float | None:
    """Evict the files; the residency after (near 0 unless another process holds them mapped)."""
    evict_files(paths)
    return resident_fraction(paths)
