"""A worker started on a node cache's partial view: wait, bounded, for the bytes it is about to touch.

``warmpool worker serve --partial-cache``: the model directory may be a fill's partial view (the
node cache fills it hottest first; ``warmpool.fill_progress`` defines the record beside it).  The
directory is resolved (``<cache>/partial/<digest>`` is a link to the view) and its progress record
read; with no record the directory is an ordinary, complete checkpoint and nothing waits.

Before the checkpoint is opened, every file that is not a weight file (config, tokenizer, index)
is waited for whole, and each safetensors file's header (and the sample of its data the model
digest reads).  Before the engine touches a tensor's bytes (``LayerStore``, per core / layer) the
byte ranges of its tensors are waited for.  A wait ends when the record lists the range, with a
``PartialCacheError`` naming the file and what was wanted when the fill failed (the record says
why), when the record vanished before the revision was complete (its fill was abandoned), or when
``timeout_s`` passed.  Once the record says every byte is in place nothing is read any more.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from warmpool_worker.engine_api import ModelLoadError

from warmpool.fill_progress import (
    STATE_FAILED,
    FillProgress,
    FillProgressError,
    progress_path,
    read_progress,
)

log = logging.getLogger("warmpool.worker")

#: Weight files: waited for piecewise (header first, then tensor by tensor); every other file whole.
WEIGHTS_SUFFIX = ".safetensors"


class PartialCacheError(ModelLoadError):
    """Bytes of a partial view that did not arrive: the fill failed, vanished or was too slow."""


@dataclass(frozen=True)
class PartialCacheConfig:
    timeout_s: float = 600.0  # per wait: how long one range may take to arrive
    poll_s: float = 0.02


class PartialCache:
    """The progress of the fill under one model directory; ``wait`` blocks until a range is in place."""

    def __init__(self, model_dir: Path, view: Path, config: PartialCacheConfig) -> None:
        self.model_dir, self.view, self.config = model_dir, view, config
        # The view is read through a descriptor of its directory, never through its path or the link:
        # the fill publishes it by a rename and only then re-points the link, so for a moment the
        # link names nothing (a pod's bind mount follows the inode the same way).
        self._view_fd = os.open(view, os.O_RDONLY | os.O_DIRECTORY)
        #: The view's directory as this process reads it (through the descriptor): the model's files
        #: are opened under it.
        self.directory = Path(f"/proc/self/fd/{self._view_fd}")
        self.record = progress_path(self.directory)
        self._last: FillProgress | None = None
        self._complete = False
        self._lock = threading.RLock()

    @classmethod
    def open(cls, model_dir: Path, config: PartialCacheConfig) -> PartialCache | None:
        """The partial view's progress, or None when `model_dir` is a complete checkpoint (no record).

        Waits (bounded) for the directory to appear: a worker may start before its fill."""
        deadline = time.monotonic() + config.timeout_s
        while not model_dir.exists():
            if time.monotonic() >= deadline:
                raise PartialCacheError(f"{model_dir}: the model directory did not appear within "
                                        f"{config.timeout_s:g}s (is the node cache filling it?)")
            time.sleep(config.poll_s)
        view = Path(os.path.realpath(model_dir))
        gate = cls(model_dir, view, config)
        try:
            progress = read_progress(gate.record)
        except FillProgressError as error:
            raise PartialCacheError(str(error)) from None
        if progress is None:
            log.info("partial cache: %s has no fill progress record: a complete checkpoint", model_dir)
            return None
        gate._last = progress
        gate._complete = progress.complete
        log.info("partial cache: %s is %s (revision %s, %s)", model_dir, view, progress.revision,
                 "complete" if progress.complete else f"filling: state {progress.state}")
        return gate

    def complete(self) -> bool:
        """Every byte in place (reads the record again unless it already said so)."""
        if not self._complete:
            with self._lock:
                progress = self._read("the rest of the revision")
                self._complete = progress is not None and progress.complete
        return self._complete

    def _read(self, what: str) -> FillProgress | None:
        try:
            progress = read_progress(self.record)
        except FillProgressError as error:
            raise PartialCacheError(f"{what}: {error}") from None
        if progress is not None:
            self._last = progress
        return progress

    def shown(self, text: str) -> str:
        """`text` (an error) naming the model's files as the worker was given them, not by descriptor."""
        return text.replace(str(self.directory), str(self.model_dir))

    def _relative(self, path: Path) -> str:
        for base in (self.directory, self.model_dir):
            if path.is_relative_to(base):
                return path.relative_to(base).as_posix()
        return path.relative_to(self.view).as_posix()

    def wait(self, path: Path, start: int, end: int, what: str) -> None:
        """Return once bytes [start, end) of `path` (a file under the model directory) are in place."""
        if self._complete or start >= end:
            return
        relative = self._relative(path)
        path = self.model_dir / relative  # named as the worker was given it, not by its descriptor
        began = time.monotonic()
        deadline = began + self.config.timeout_s
        with self._lock:
            progress = self._last
            while True:
                if progress is None:
                    raise PartialCacheError(
                        f"{path}: {what} (bytes {start}..{end}): the fill's progress record "
                        f"{progress_path(self.view)} is gone before the revision was complete (the fill was "
                        "abandoned or restarted); restart the worker")
                try:
                    missing = progress.missing(relative, start, end)
                except FillProgressError as error:
                    raise PartialCacheError(f"{path}: {what}: {error}") from None
                if not missing:
                    self._complete = progress.complete
                    break
                if progress.state == STATE_FAILED:
                    raise PartialCacheError(
                        f"{path}: {what} (bytes {start}..{end}, {len(missing)} block(s) missing) will never arrive: "
                        f"the node cache's fill of {progress.revision} failed: {progress.error}")
                if time.monotonic() >= deadline:
                    age = time.time() - progress.updated_at
                    raise PartialCacheError(
                        f"{path}: {what} (bytes {start}..{end}): {len(missing)} block(s) still missing after "
                        f"{self.config.timeout_s:g}s (fill of {progress.revision} {progress.state}, its record "
                        f"last changed {age:.1f}s ago)")
                time.sleep(self.config.poll_s)
                progress = self._read(what)
        waited = time.monotonic() - began
        if waited > 0.05:
            log.info("partial cache: waited %.2fs for %s", waited, what)

    def wait_file(self, path: Path, what: str) -> None:
        """The whole file."""
        relative = self._relative(path)
        entry = (self._last.files.get(relative) if self._last is not None else None)
        if entry is None:
            raise PartialCacheError(f"{self.model_dir / relative}: {what}: the fill's revision has no such file")
        self.wait(path, 0, entry.size, what)

    def wait_openable(self, digest_sample_bytes: int) -> None:
        """What opening the checkpoint reads: every non-weight file whole, each weight file's header
        and the sample of its data the model digest reads (``checkpoint.DIGEST_SAMPLE_BYTES``)."""
        files = dict(self._last.files) if self._last is not None else {}
        for relative in sorted(files):
            if not relative.endswith(WEIGHTS_SUFFIX):
                self.wait_file(self.directory / relative, "a model file")
        for relative, entry in sorted(files.items()):
            if not relative.endswith(WEIGHTS_SUFFIX) or entry.size < 8:
                continue
            path = self.directory / relative
            self.wait(path, 0, 8, "the safetensors header length")
            with path.open("rb") as handle:
                (header_len,) = struct.unpack("<Q", handle.read(8))
            data_start = min(entry.size, 8 + header_len)  # a lying length is the checkpoint's error to report
            self.wait(path, 0, data_start, "the safetensors header")
            self.wait(path, data_start, min(entry.size, data_start + digest_sample_bytes), "the digest's data sample")
