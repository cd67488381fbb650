"""A fill's block commits: fetched blocks made durable and listed in batches, in a thread of their own.

Split from fill.py so the fill reads as its steps; see ``partial.PartialView.place`` (the commit
itself: fdatasync of the view's files, then the journal) and fill.py's docstring for where the fill
calls the durability point.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable

from warmpool_nodecache.manifest import BlockRef


class BlockCommits:
    """Fetched blocks not yet committed, the commits under way, and what this fill has fetched so far.

    Commits run in one thread of their own, in the order submitted (so blocks are listed in the
    fill's order) while the fill goes on taking blocks: the disk writes that an fdatasync forces
    overlap with the fetches.  At most ``ahead`` commits are outstanding.  ``commit`` is called in
    the commit thread with the SHA-256 of every block of a batch (the view's ``place``)."""

    def __init__(self, commit: Callable[[list[str]], None], limit: int, ahead: int = 2) -> None:
        self.commit, self.limit, self.ahead = commit, limit, ahead
        self.pending: list[BlockRef] = []
        #: the blocks committed so far (fetched by this fill, durable and listed), and their bytes
        self.stored: list[str] = []
        self.bytes = 0
        self._outstanding: collections.deque[concurrent.futures.Future[list[BlockRef]]] = collections.deque()
        self._committer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fill-commit")

    def add(self, ref: BlockRef) -> None:
        self.pending.append(ref)
        if len(self.pending) >= self.limit:
            self.submit()

    def submit(self) -> None:
        if not self.pending:
            return
        while len(self._outstanding) >= self.ahead:
            self._collect(self._outstanding.popleft())
        batch, self.pending = self.pending, []  # a failed commit is not retried
        self._outstanding.append(self._committer.submit(self._commit, batch))

    def _commit(self, batch: list[BlockRef]) -> list[BlockRef]:
        self.commit([ref.sha256 for ref in batch])
        return batch

    def _collect(self, future: concurrent.futures.Future[list[BlockRef]]) -> None:
        for ref in future.result():
            self.stored.append(ref.sha256)
            self.bytes += ref.length

    def finish(self, commit_pending: bool = True) -> None:
        """The durability point: commit what is pending (unless told not to) and wait for every commit;
        then every block this fill fetched is on disk.  Re-raises the first commit's error, after all ended."""
        error: BaseException | None = None
        if commit_pending:
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
