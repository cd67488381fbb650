"""The worker's bounded wait on a partial view (warmpool_worker.partial_cache), against real record
files: a range already listed, one listed while it waits, and the three ways a wait ends in an error."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path

import pytest
from warmpool_worker.partial_cache import PartialCache, PartialCacheConfig, PartialCacheError

from warmpool.fill_progress import (
    STATE_FAILED,
    FileProgress,
    FillProgress,
    progress_path,
    write_progress,
)

pytestmark = pytest.mark.unit

BS = 4096
#: The bound of the waits that must run out (each test waits it out: short).
FAST = PartialCacheConfig(timeout_s=0.1, poll_s=0.01)


def _view(tmp_path: Path, present: tuple[tuple[int, int], ...], state: str = "filling",
          error: str | None = None) -> Path:
    view = tmp_path / "staging" / "abc.1"
    view.mkdir(parents=True, exist_ok=True)
    write_progress(progress_path(view), FillProgress("sha256:abc", BS, {
        "model.safetensors": FileProgress(4 * BS, present), "config.json": FileProgress(10, ((0, 1),))},
        state, error, time.time()))
    return view


def test_a_directory_without_a_record_is_a_complete_checkpoint(tmp_path: Path) -> None:
    assert PartialCache.open(tmp_path, FAST) is None


def test_the_directory_must_appear_within_the_bound(tmp_path: Path) -> None:
    with pytest.raises(PartialCacheError, match=r"did not appear within 0\.1s"):
        PartialCache.open(tmp_path / "partial" / "abc", FAST)


def test_a_listed_range_returns_at_once_and_a_missing_one_times_out_naming_it(tmp_path: Path) -> None:
    view = _view(tmp_path, ((0, 1),))
    link = tmp_path / "partial-abc"
    link.symlink_to(view)  # as <cache>/domains/<ns>/partial/<digest>: the record is found inside the link's target
    gate = PartialCache.open(link, FAST)
    assert gate is not None and not gate.complete()
    gate.wait(link / "model.safetensors", 0, BS, "the header")
    gate.wait_file(link / "config.json", "a model file")
    with pytest.raises(PartialCacheError, match=r"model.safetensors: layer 3: tensor 'w' \(bytes 4096..8193\): "
                                               r"2 block\(s\) still missing after 0\.1s"):
        gate.wait(link / "model.safetensors", BS, 2 * BS + 1, "layer 3: tensor 'w'")


def test_a_wait_ends_when_the_fill_lists_the_range(tmp_path: Path) -> None:
    view = _view(tmp_path, ((0, 1),))
    gate = PartialCache.open(view, PartialCacheConfig(timeout_s=10, poll_s=0.01))
    assert gate is not None
    later = threading.Timer(0.2, lambda: _view(tmp_path, ((0, 4),)))
    later.start()
    try:
        started = time.monotonic()
        gate.wait(view / "model.safetensors", 3 * BS, 4 * BS, "layer 1")
        assert 0.1 < time.monotonic() - started < 5
    finally:
        later.cancel()
    assert gate.complete()


def test_a_failed_fill_or_a_vanished_record_ends_the_wait_with_why(tmp_path: Path) -> None:
    view = _view(tmp_path, ((0, 1),))
    gate = PartialCache.open(view, PartialCacheConfig(timeout_s=30, poll_s=0.01))
    assert gate is not None
    _view(tmp_path, ((0, 1),), STATE_FAILED, "SourceError: HTTP 503")
    with pytest.raises(PartialCacheError, match="will never arrive: the node cache's fill of sha256:abc failed: "
                                               "SourceError: HTTP 503"):
        gate.wait(view / "model.safetensors", BS, 2 * BS, "layer 2")
    view = _view(tmp_path, ((0, 1),))  # filling again (another fill), then abandoned: its record goes
    gate = PartialCache.open(view, PartialCacheConfig(timeout_s=30, poll_s=0.01))
    assert gate is not None
    progress_path(view).unlink()
    with pytest.raises(PartialCacheError, match="is gone before the revision was complete"):
        gate.wait(view / "model.safetensors", BS, 2 * BS, "layer 2")


def test_the_view_stays_readable_while_the_fill_publishes_it(tmp_path: Path) -> None:
    """The fill publishes by renaming the view and only then re-pointing the link: a worker reading
    through the link would find nothing in that gap (it once failed on tokenizer.json there)."""
    view = _view(tmp_path, ((0, 4),), state="published")
    (view / "config.json").write_text("{}\n\n\n\n\n\n\n\n")  # the 10 bytes the record lists
    (view / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}" + bytes(4 * BS - 10))
    link = tmp_path / "partial-abc"
    link.symlink_to(view)
    gate = PartialCache.open(link, FAST)
    assert gate is not None
    final = tmp_path / "revisions" / "abc"
    final.parent.mkdir()
    view.rename(final)  # published; the link still names the old place
    assert not link.exists()
    gate.wait_openable(64)  # reads each header through the view itself
    assert (gate.directory / "config.json").read_text() == "{}\n\n\n\n\n\n\n\n"
    gate.wait(gate.directory / "model.safetensors", 0, 4 * BS, "layer 0")
