"""The progress record of a fill's partial view: which bytes of a revision's files are in place.

The one definition of the format: the node cache's fill writes it (``warmpool_nodecache.partial``),
the worker reads it before it touches a tensor's bytes (``warmpool_worker.partial_cache``).

A fill asked for a partial view lays the revision's files out in its staging directory (the
*view*) and writes each block into them once it is verified and committed, hottest first, so a
worker can start on the view and fault in the rest.  Inside the view, ``contract.FILL_PROGRESS_NAME``
says which blocks are in place (inside, not beside: a worker pod mounts only its view)::

    {
      "format": "warmpool.fill-progress/v1",      # contract.FILL_PROGRESS_FORMAT
      "revision": "sha256:<hex>",
      "block_size": 4194304,
      "state": "filling",                         # "filling" | "failed" | "published"
      "error": null,                              # why, when "failed"
      "updated_at": 1718000000.0,                 # unix seconds of this version of the record
      "files": {"model.safetensors": {"size": 9000000, "present": [[0, 1], [5, 9]]}}
    }

``present``: sorted, disjoint half-open intervals of block indices; block i covers the bytes
[i * block_size, min((i + 1) * block_size, size)).  A block is listed only after its bytes were
SHA-256-verified, made durable in the block store and written into the view's file, so a reader
that touches only listed bytes never sees a hole or an unverified block (blocks are page-aligned:
a page is never half present).  The record is replaced whole (temporary file + rename), never
edited in place.  The fill writes it before anything can find the view (the link a worker is
pointed at is made after it), ``failed`` before it removes the view, and ``published`` after the
view was renamed to the published revision (the same inodes: open files and mappings stay valid;
the record stays in the revision, saying ``published``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from warmpool.contract.nodecache import FILL_PROGRESS_FORMAT, FILL_PROGRESS_NAME

STATE_FILLING = "filling"
STATE_FAILED = "failed"
STATE_PUBLISHED = "published"
STATES = (STATE_FILLING, STATE_FAILED, STATE_PUBLISHED)

#: Half-open intervals of block indices, sorted and disjoint.
Intervals = tuple[tuple[int, int], ...]


class FillProgressError(ValueError):
    """A progress record that cannot be used; the message names it and what is wrong."""


def progress_path(view: Path) -> Path:
    """Where the progress record of the view directory `view` lives (inside it)."""
    return view / FILL_PROGRESS_NAME


def merge_intervals(intervals: Iterable[tuple[int, int]]) -> Intervals:
    """Sorted, disjoint, with touching intervals joined; empty ones dropped."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(i for i in intervals if i[0] < i[1]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return tuple(merged)


@dataclass(frozen=True)
class FileProgress:
    size: int
    present: Intervals = ()

    def blocks(self, block_size: int) -> int:
        return -(-self.size // block_size)

    def complete(self, block_size: int) -> bool:
        n = self.blocks(block_size)
        return n == 0 or self.present == ((0, n),)


@dataclass(frozen=True)
class FillProgress:
    revision: str
    block_size: int
    files: Mapping[str, FileProgress]
    state: str = STATE_FILLING
    error: str | None = None
    updated_at: float = field(default=0.0, compare=False)

    @property
    def complete(self) -> bool:
        """Every byte of every file is in place."""
        return all(f.complete(self.block_size) for f in self.files.values())

    def missing(self, path: str, start: int, end: int) -> list[int]:
        """Block indices of `path` overlapping bytes [start, end) that are not in place yet.

        FillProgressError when the record has no such file or the range runs past its end."""
        entry = self.files.get(path)
        if entry is None:
            raise FillProgressError(f"fill progress of {self.revision}: no file {path!r} in the revision")
        if not 0 <= start <= end <= entry.size:
            raise FillProgressError(f"fill progress of {self.revision}: bytes [{start}, {end}) of {path!r} "
                                    f"lie outside its {entry.size} bytes")
        if start == end:
            return []
        first, last = start // self.block_size, (end - 1) // self.block_size
        wanted = set(range(first, last + 1))
        for a, b in entry.present:
            wanted.difference_update(range(max(a, first), min(b, last + 1)))
        return sorted(wanted)

    def covers(self, path: str, start: int, end: int) -> bool:
        return not self.missing(path, start, end)

    def to_text(self) -> str:
        body = {
            "format": FILL_PROGRESS_FORMAT, "revision": self.revision, "block_size": self.block_size,
            "state": self.state, "error": self.error, "updated_at": self.updated_at,
            "files": {p: {"size": f.size, "present": [list(i) for i in f.present]} for p, f in self.files.items()},
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _int(value: object, where: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise FillProgressError(f"{where} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_progress(text: str | bytes, source: str = "<fill progress>") -> FillProgress:
    """Load and validate a record; every inconsistency is a FillProgressError naming `source`."""
    try:
        body = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FillProgressError(f"{source}: not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FILL_PROGRESS_FORMAT:
        raise FillProgressError(f"{source}: not a {FILL_PROGRESS_FORMAT} object")
    state, error, revision = body.get("state"), body.get("error"), body.get("revision")
    if state not in STATES:
        raise FillProgressError(f"{source}: state {state!r} is not one of {STATES}")
    if error is not None and not isinstance(error, str):
        raise FillProgressError(f"{source}: error must be a string or null")
    if not isinstance(revision, str):
        raise FillProgressError(f"{source}: revision must be a string")
    block_size = _int(body.get("block_size"), f"{source}: block_size", 1)
    updated = body.get("updated_at", 0.0)
    if not isinstance(updated, int | float) or isinstance(updated, bool):
        raise FillProgressError(f"{source}: updated_at must be a number")
    raw_files = body.get("files")
    if not isinstance(raw_files, dict):
        raise FillProgressError(f"{source}: files must be an object")
    files: dict[str, FileProgress] = {}
    for path, entry in raw_files.items():
        where = f"{source}: file {path!r}"
        if not isinstance(entry, dict) or not isinstance(entry.get("present"), list):
            raise FillProgressError(f"{where}: must be an object with size and present")
        size = _int(entry.get("size"), f"{where}: size")
        blocks = -(-size // block_size)
        intervals: list[tuple[int, int]] = []
        for item in entry["present"]:
            if not isinstance(item, list) or len(item) != 2:
                raise FillProgressError(f"{where}: present holds {item!r}, not a [start, end) pair")
            a, b = _int(item[0], f"{where}: interval start"), _int(item[1], f"{where}: interval end")
            if not a < b <= blocks:
                raise FillProgressError(f"{where}: interval [{a}, {b}) is empty or past its {blocks} blocks")
            intervals.append((a, b))
        files[path] = FileProgress(size, merge_intervals(intervals))
    return FillProgress(revision, block_size, files, state, error, float(updated))


def read_progress(path: Path) -> FillProgress | None:
    """The record at `path`, or None when there is none (FillProgressError when it is unusable)."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FillProgressError(f"{path}: cannot read: {exc}") from None
    return parse_progress(text, str(path))


def write_progress(path: Path, progress: FillProgress) -> None:
    """Replace the record at `path` whole (a reader sees the old version or the new, never a mix)."""
    import tempfile  # the writer's side only (the node cache): off the worker's start path

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(progress.to_text())
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
