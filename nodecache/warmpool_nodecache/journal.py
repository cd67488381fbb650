"""A fill's journal: the blocks already durable in its view's files, so a later fill resumes from them.

The fill writes each block it fetches into the revision's files only (``partial.PartialView``),
never into a block file of its own as well, so the view's files are what a fill killed midway
leaves behind.  The journal says which of their bytes can be trusted: after each commit, once the
files' data is fdatasynced, the SHA-256 of every block placed by then is appended and the journal
fsynced.  A line therefore never names a block whose bytes were not verified and on disk first;
a block written but not yet journaled (a crash before its commit) is fetched again.

It lives beside the view, ``staging/<digest hex>.<lease version>.done`` (never inside it: the view is
renamed whole into ``revisions/`` at publish, and a worker's pod mounts it).  A torn last line (a
crash mid-append) is not a SHA-256 of the revision and is ignored.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from warmpool_nodecache.layout import CacheLayout

SUFFIX = ".done"
_SHA_RE = re.compile(r"[0-9a-f]{64}")


def journal_path(view: Path) -> Path:
    return view.with_name(view.name + SUFFIX)


class FillJournal:
    """The journal of one view, open for appending (one writer: the fill's commit thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, shas: Iterable[str]) -> None:
        """Record these blocks as durable (call only after their bytes were fdatasynced), durably."""
        text = "".join(f"{sha}\n" for sha in shas)
        if not text:
            return
        data = memoryview(text.encode())
        while data:
            data = data[os.write(self._fd, data):]
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_journal(path: Path) -> set[str]:
    """The blocks a journal lists (nothing when it is absent)."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return set()
    return {line for line in text.split("\n") if _SHA_RE.fullmatch(line)}


def journaled(layout: CacheLayout, digest_hex: str) -> set[str]:
    """Every block the fills of this revision in progress (or killed) have made durable in their views."""
    found: set[str] = set()
    if layout.staging.is_dir():
        for path in layout.staging.glob(f"{digest_hex}.*{SUFFIX}"):
            found |= read_journal(path)
    return found
