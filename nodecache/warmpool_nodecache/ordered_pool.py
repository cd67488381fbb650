"""A bounded pool of worker threads whose results come back in the order the work was given.

The fill uses it to keep several block fetches in flight (socket reads, SHA-256 and file
writes all release the GIL) while it still *takes* blocks in its hot-first order: result i is
handed out only after results 0..i-1, whatever order the workers finish in.

Bounds: at most ``workers`` calls run at once, and at most ``window`` items are taken from the
input and not yet handed out (so a slow head item cannot make the pool race ahead without
limit; a caller whose results hold big buffers gets ``window`` of them at most).

On any exception (a worker's, re-raised when its result is due, or the consumer's own) leaving
the ``with`` block cancels every call not yet started and waits for the running ones to end, so
when ``__exit__`` returns nothing is still touching the caller's files.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class OrderedPool(Generic[T, R]):
    def __init__(self, fn: Callable[[T], R], *, workers: int, window: int | None = None,
                 idle_every_s: float = 0.5) -> None:
        if workers < 1:
            raise ValueError(f"an ordered pool needs at least 1 worker, got {workers}")
        window = 2 * workers if window is None else window
        if window < workers:
            raise ValueError(f"the window ({window}) must be at least the number of workers ({workers})")
        self._fn = fn
        self.workers = workers
        self.window = window
        self.idle_every_s = idle_every_s
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fill-fetch")

    def __enter__(self) -> OrderedPool[T, R]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # Waits for the running calls even on success (none are left then): threads must not
        # outlive the caller's clean-up of what they write.
        self._executor.shutdown(wait=True, cancel_futures=True)

    def results(self, items: Iterable[T], idle: Callable[[], None] | None = None) -> Iterator[tuple[T, R]]:
        """(item, fn(item)) in the order of `items`; `idle()` is called whenever the next result is not
        ready yet, and every ``idle_every_s`` while it stays so (so the caller can do its own work,
        such as renewing its lease, instead of only waiting).  Items are pulled lazily."""
        source = iter(items)
        pending: collections.deque[tuple[T, concurrent.futures.Future[R]]] = collections.deque()
        exhausted = False
        while True:
            while not exhausted and len(pending) < self.window:
                try:
                    item = next(source)
                except StopIteration:
                    exhausted = True
                    break
                pending.append((item, self._executor.submit(self._fn, item)))
            if not pending:
                return
            item, future = pending[0]
            if idle is not None:
                # Again every `idle_every_s` while the head is still on its way: a source stalled on
                # one block longer than the fill lease's TTL must not cost a live filler its lease.
                while not future.done():
                    idle()
                    concurrent.futures.wait([future], timeout=self.idle_every_s)
            result = future.result()  # re-raises the worker's exception here, in order
            pending.popleft()
            yield item, result
