"""A fill's block commits: staged blocks made durable and visible in batches, in a thread of their own.

Split from fill.py so the fill reads as its steps; see ``BlockStore.commit`` for why a committed
block is crash-safe and fill.py's docstring for where the fill calls the durability point.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable
from pathlib import Path

from warmpool_nodecache.blocks import BlockStore
from warmpool_nodecache.manifest import BlockRef


class BlockCommits:
    """Staged blocks not yet committed, the commits under way, and what this fill has stored so far.

    Commits run in one thread of their own, in the order submitted (so blocks still enter the
    store in the fill's order) while the fill goes on taking blocks: the disk writes that an
    fsync forces overlap with the fetches.  At most ``ahead`` commits are outstanding.

    ``on_commit``, when given, is called in the commit thread after each commit with the SHA-256
    of every block of the batch (all in the store by then, whether this commit or another fill
    stored them): the partial view writes them into its files there."""

    def __init__(self, store: BlockStore, limit: int, ahead: int = 2,
                 on_commit: Callable[[list[str]], None] | None = None) -> None:
        self.store, self.limit, self.ahead, self.on_commit = store, limit, ahead, on_commit
        self.staged: list[tuple[str, Path]] = []
        self.lengths: dict[str, int] = {}
        self.stored: list[str] = []
        self.bytes = 0
        self._outstanding: collections.deque[concurrent.futures.Future[tuple[list[str], BaseException | None]]] = (
            collections.deque())
        self._committer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fill-commit")

    def add(self, ref: BlockRef, path: Path) -> None:
        self.staged.append((ref.sha256, path))
        self.lengths[ref.sha256] = ref.length
        if len(self.staged) >= self.limit:
            self.submit()

    def submit(self) -> None:
        if not self.staged:
            return
        while len(self._outstanding) >= self.ahead:
            self._collect(self._outstanding.popleft())
        staged, self.staged = self.staged, []  # a failed commit is not retried with half-renamed paths
        self._outstanding.append(self._committer.submit(self._commit, staged))

    def _commit(self, staged: list[tuple[str, Path]]) -> tuple[list[str], BaseException | None]:
        stored = self.store.commit(staged)
        try:
            if self.on_commit is not None:
                self.on_commit([sha for sha, _ in staged])
        except BaseException as exc:  # the blocks are stored all the same: counted, then re-raised
            return stored, exc
        return stored, None

    def _collect(self, future: concurrent.futures.Future[tuple[list[str], BaseException | None]]) -> None:
        stored, error = future.result()
        for sha in stored:
            self.stored.append(sha)
            self.bytes += self.lengths[sha]
        if error is not None:
            raise error

    def finish(self, commit_staged: bool = True) -> None:
        """The durability point: commit what is staged (unless told not to) and wait for every commit;
        then every block this fill stored is on disk.  Re-raises the first commit's error, after all ended."""
        error: BaseException | None = None
        if commit_staged:
            try:
                self.submit()
            except BaseException as exc:  # an earlier commit's failure, met while making room
                error = exc
        while self._outstanding:
            try:
                self._collect(self._outstanding.popleft())
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        self._committer.shutdown(wait=True)
