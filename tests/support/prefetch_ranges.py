"""Whole files as prefetch byte ranges: what the tests measure page-cache residency over (the
product plans ranges in heat order, never whole files)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from warmpool_worker.prefetch import ByteRange


def file_ranges(paths: Iterable[Path]) -> list[ByteRange]:
    """One range per readable file, from its first byte to its last (unreadable files left out)."""
    out = []
    for path in paths:
        try:
            out.append(ByteRange(path, 0, path.stat().st_size))
        except OSError:
            continue
    return out
