"""The fill's fetch pipeline (``OrderedPool``), its commits (``BlockCommits``) and its journal, on real
threads and files."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from warmpool_nodecache.blocks import BlockCorruptError, BlockStore
from warmpool_nodecache.commits import BlockCommits
from warmpool_nodecache.journal import FillJournal, journal_path, journaled, read_journal
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import BlockRef
from warmpool_nodecache.ordered_pool import OrderedPool

pytestmark = pytest.mark.unit

BOUND_S = 30.0  # how long a test waits for a thread before it fails (never reached when it passes)


def test_results_come_back_in_input_order_whatever_order_the_workers_finish_in() -> None:
    n = 6
    go = [threading.Event() for _ in range(n)]
    done = [threading.Event() for _ in range(n)]
    finished: list[int] = []
    started = threading.Semaphore(0)

    def work(i: int) -> int:
        started.release()
        assert go[i].wait(BOUND_S)
        finished.append(i)
        done[i].set()
        return i * i

    def release_backwards() -> None:
        for _ in range(n):
            assert started.acquire(timeout=BOUND_S)  # all n running at once
        for i in reversed(range(n)):
            go[i].set()
            assert done[i].wait(BOUND_S)

    releaser = threading.Thread(target=release_backwards)
    releaser.start()
    with OrderedPool(work, workers=n) as pool:
        got = list(pool.results(range(n)))
    releaser.join(BOUND_S)
    assert finished == list(reversed(range(n)))
    assert got == [(i, i * i) for i in range(n)]


def test_in_flight_work_is_bounded_by_workers_and_the_window() -> None:
    workers, window, n = 3, 5, 40
    lock = threading.Lock()
    running = 0
    most_running = 0
    barrier = threading.Barrier(workers)  # the first `workers` calls only pass if they run together
    pulled = 0

    def items() -> Iterator[int]:
        nonlocal pulled
        for i in range(n):
            pulled += 1
            yield i

    def work(i: int) -> int:
        nonlocal running, most_running
        with lock:
            running += 1
            most_running = max(most_running, running)
        if i < workers:
            barrier.wait(BOUND_S)
        with lock:
            running -= 1
        return i

    consumed = 0
    most_ahead = 0
    with OrderedPool(work, workers=workers, window=window) as pool:
        for i, result in pool.results(items()):
            assert result == i == consumed
            most_ahead = max(most_ahead, pulled - consumed)
            consumed += 1
    assert consumed == n
    assert most_running == workers
    assert most_ahead <= window


def test_an_error_in_one_call_cancels_the_rest_and_waits_for_the_running_ones() -> None:
    workers, n = 2, 50
    calls: list[int] = []
    finished: set[int] = set()
    lock = threading.Lock()
    failing_started = threading.Event()

    def work(i: int) -> int:
        with lock:
            calls.append(i)
        if i == 3:
            failing_started.set()
            raise OSError("the source went away")
        if i == 4:  # running when 3 fails: the pool's exit must wait for it
            assert failing_started.wait(BOUND_S)
            with lock:
                finished.add(i)
        return i

    got: list[int] = []
    with pytest.raises(OSError, match="went away"), OrderedPool(work, workers=workers) as pool:
        for _, result in pool.results(range(n)):
            got.append(result)
    assert got == [0, 1, 2]  # everything before the failure, in order, nothing after
    assert 4 in finished or 4 not in calls  # a started call ran to its end before the exit returned
    assert max(calls) < 3 + 2 * workers + 1  # nothing beyond the window was ever started
    assert len(calls) < n
    assert not any(t.name.startswith("fill-fetch") for t in threading.enumerate())


def test_bad_bounds_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="at least 1 worker"):
        OrderedPool(lambda i: i, workers=0)
    with pytest.raises(ValueError, match="window"):
        OrderedPool(lambda i: i, workers=4, window=2)


def _block(seed: int) -> tuple[str, bytes]:
    data = hashlib.sha256(str(seed).encode()).digest() * 512
    return hashlib.sha256(data).hexdigest(), data


def test_the_journal_lists_what_was_appended_and_ignores_a_torn_last_line(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path / "cache")
    layout.staging.mkdir(parents=True)
    view = layout.staging / f"{'ab' * 32}.3"
    shas = [_block(i)[0] for i in range(4)]
    journal = FillJournal(journal_path(view))
    journal.append(shas[:2])
    journal.append([])
    journal.append(shas[2:3])
    journal.close()
    with journal_path(view).open("a") as fh:
        fh.write(shas[3][:40])  # a crash mid-append
    assert read_journal(journal_path(view)) == set(shas[:3])
    assert journaled(layout, "ab" * 32) == set(shas[:3])
    assert journaled(layout, "cd" * 32) == set() and read_journal(tmp_path / "absent") == set()


def test_commits_run_in_order_in_their_thread_and_count_what_was_committed() -> None:
    blocks = [_block(i) for i in range(7)]
    refs = [BlockRef("f", i, i * 16384, 16384, sha) for i, (sha, _) in enumerate(blocks)]
    seen: list[tuple[list[str], str]] = []
    commits = BlockCommits(lambda shas: seen.append((shas, threading.current_thread().name)), limit=3)
    try:
        for ref in refs:
            commits.add(ref)
        commits.finish()
    finally:
        commits.close()
    assert [shas for shas, _ in seen] == [[r.sha256 for r in refs[:3]], [r.sha256 for r in refs[3:6]], [refs[6].sha256]]
    assert all(name.startswith("fill-commit") for _, name in seen)
    assert commits.stored == [r.sha256 for r in refs] and commits.bytes == 7 * 16384


def test_a_failed_commit_is_raised_at_the_durability_point_and_its_blocks_are_not_counted() -> None:
    refs = [BlockRef("f", i, i * 16384, 16384, _block(i)[0]) for i in range(4)]

    def commit(shas: list[str]) -> None:
        if refs[2].sha256 in shas:
            raise OSError("disk full")

    commits = BlockCommits(commit, limit=2)
    try:
        for ref in refs:
            commits.add(ref)
        with pytest.raises(OSError, match="disk full"):
            commits.finish()
    finally:
        commits.close()
    assert commits.stored == [refs[0].sha256, refs[1].sha256]


def test_a_put_block_that_does_not_hash_to_its_name_is_never_stored(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path / "cache")
    store = BlockStore(layout)
    sha, data = _block(1)
    with pytest.raises(BlockCorruptError, match=sha):
        store.put(sha, data[:-1] + b"x")
    assert store.all_blocks() == set() and not store.has(sha)
    assert store.put(sha, data) and store.read(sha) == data
    assert layout.block(sha).stat().st_mode & 0o777 == 0o444
