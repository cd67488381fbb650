"""The order in which WarmModels' passes run when more are asked for than the API server can take.

At start-up over 1,000 WarmModels (the initial list), every reconciler asks for a pass at once.
Run all together they share the API client's few requests in flight and advance in lock-step,
so each first pass ends near the end of the burst, and a WarmModel created meanwhile waits
behind all of them.  Here at most ``slots`` passes run at once, admitted by a key:

* a pass asked for by news (a WarmModel created or changed, a child or pod event, a handler
  waiting) is keyed by when it was first asked for;
* a *routine* pass (the initial list, a scrape round) by that time plus ``aging_s``.

So news overtakes the backlog, and the backlog still finishes: a routine pass waits at most
``aging_s`` behind news that came after it (its key is then the older).  Passes of one key class
run first come, first served, so the early ones of a burst end early.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

#: Passes at once: enough to keep the API client's requests in flight full (a first pass has
#: about two writes in flight at a time), few enough that the order above holds.
DEFAULT_SLOTS = 32
#: How long a routine pass (the initial list, a scrape round) lets newer news go first.
DEFAULT_AGING_S = 30.0


@dataclass(eq=False)
class Ticket:
    """One reconciler's place in the queue, for one pass."""

    key: float
    admitted: bool = False
    left: bool = False
    turn: asyncio.Event = field(default_factory=asyncio.Event)


class PassQueue:
    def __init__(self, slots: int = DEFAULT_SLOTS, aging_s: float = DEFAULT_AGING_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if slots < 1:
            raise ValueError(f"a pass queue needs at least one slot, got {slots}")
        if aging_s < 0:
            raise ValueError(f"aging must be >= 0 s, got {aging_s:g}")
        self.slots, self.aging_s, self.clock = slots, aging_s, clock
        self.running = 0
        self._heap: list[tuple[float, int, Ticket]] = []
        self._order = itertools.count()

    def key(self, asked_at: float, routine: bool) -> float:
        """The admission key of a pass first asked for at ``asked_at`` (this queue's clock)."""
        return asked_at + (self.aging_s if routine else 0.0)

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, ticket in self._heap if not (ticket.admitted or ticket.left))

    def enter(self, key: float) -> Ticket:
        """A place for a pass keyed ``key``: admitted at once while a slot is free and no one waits."""
        ticket = Ticket(key)
        heapq.heappush(self._heap, (key, next(self._order), ticket))
        self._admit()
        return ticket

    def hurry(self, ticket: Ticket, key: float) -> None:
        """News for a waiting pass: it moves up to ``key`` (never down)."""
        if ticket.admitted or ticket.left or key >= ticket.key:
            return
        ticket.key = key  # its older heap entry no longer matches its key: skipped when reached
        heapq.heappush(self._heap, (key, next(self._order), ticket))
        self._admit()

    def leave(self, ticket: Ticket) -> None:
        """The pass is over (or was given up while waiting): its slot goes to the next."""
        if ticket.left:
            return
        ticket.left = True
        if ticket.admitted:
            self.running -= 1
        self._admit()

    def _admit(self) -> None:
        while self.running < self.slots and self._heap:
            key, _, ticket = heapq.heappop(self._heap)
            if ticket.admitted or ticket.left or key != ticket.key:
                continue
            ticket.admitted = True
            self.running += 1
            ticket.turn.set()


class Asks:
    """One reconciler's asks for its next pass: the event that wakes its loop, when the pass was
    first asked for and whether only routine asks wanted it, and its place in the queue while it
    waits (no queue: every pass runs as soon as asked)."""

    def __init__(self, queue: PassQueue | None) -> None:
        self.queue = queue
        self.wake = asyncio.Event()
        self._asked_at: float | None = None
        self._routine = True
        self._ticket: Ticket | None = None

    def ask(self, routine: bool) -> None:
        queue = self.queue
        if queue is not None:
            if self._asked_at is None:
                self._asked_at, self._routine = queue.clock(), routine
            elif not routine and self._routine:
                self._routine = False
                if self._ticket is not None:
                    queue.hurry(self._ticket, queue.key(self._asked_at, routine=False))
        self.wake.set()

    @property
    def routine_pending(self) -> bool:
        """Whether a pass is pending and only routine asks wanted it."""
        return self._asked_at is not None and self._routine

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Wait until the queue admits the pending pass, and hold its slot while the pass runs; the
        asks start over when it is admitted (an ask from then on is for the pass after it)."""
        try:
            if self.queue is not None and self._asked_at is not None:
                self._ticket = self.queue.enter(self.queue.key(self._asked_at, self._routine))
                await self._ticket.turn.wait()
            self.wake.clear()
            self._asked_at, self._routine = None, True
            yield
        finally:
            if self.queue is not None and self._ticket is not None:
                self.queue.leave(self._ticket)
            self._ticket = None
