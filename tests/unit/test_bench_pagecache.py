"""The page-cache helpers really evict and really warm: checked with mincore, not with timings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from warmpool_bench.pagecache import evict_files, make_cold, make_warm, read_files, resident_fraction

pytestmark = pytest.mark.unit

SIZE = 8 * 1024 * 1024


@pytest.fixture()
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(SIZE))
    return path


def _mincore_or_skip(path: Path) -> float:
    fraction = resident_fraction([path])
    if fraction is None:
        pytest.skip("mincore is not available here")
    return fraction


def test_evict_drops_the_pages_and_read_brings_them_back(data_file: Path) -> None:
    read_files([data_file])
    assert _mincore_or_skip(data_file) > 0.9
    evict_files([data_file])
    after_evict = resident_fraction([data_file])
    if after_evict is not None and after_evict > 0.5:
        pytest.skip("this filesystem ignores POSIX_FADV_DONTNEED (tmpfs keeps pages in memory)")
    assert after_evict is not None and after_evict < 0.1
    nbytes, seconds = read_files([data_file])
    assert nbytes == SIZE and seconds >= 0
    assert (resident_fraction([data_file]) or 0) > 0.9


def test_make_cold_and_make_warm_report_the_residency(data_file: Path) -> None:
    _mincore_or_skip(data_file)
    cold = make_cold([data_file])
    if cold is not None and cold > 0.5:
        pytest.skip("this filesystem ignores POSIX_FADV_DONTNEED")
    assert cold is not None and cold < 0.1
    warm = make_warm([data_file])
    assert warm is not None and warm > 0.99


def test_resident_fraction_of_an_empty_set_is_full() -> None:
    assert resident_fraction([]) == 1.0
