"""The order in which WarmModels' passes run when more are asked for than the API server can take.

At start-up over 1,000 WarmModels (the initial list), every reconciler asks for a pass at once.
Run all together they share the API client's few requests in flight and advance in lock-step,
so each first pass ends near the end of the burst, and a WarmModel created meanwhile waits
behind all of them.  Here at most ``slots`` passes run at once, taken from two lines, each first
come, first served (so the early ones of a burst end early):

* news: a pass asked for by a WarmModel created or changed, a child or pod event, a handler waiting;
* routine: a pass only the initial list or a scrape round asked for.

News goes first, and the backlog still finishes: while both lines wait, every
``news_per_routine``-th free slot goes to the routine line (its aging is counted in passes, not
seconds, so a long initial list never turns the backlog's age against a WarmModel created after it).
A routine pass that news arrives for moves to the news line.
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
#: While both lines wait: news passes admitted for each routine one (the backlog's share: 1 in 5).
DEFAULT_NEWS_PER_ROUTINE = 4


@dataclass(eq=False)
class Ticket:
    """One reconciler's place in the queue, for one pass."""

    asked_at: float
    routine: bool
    admitted: bool = False
    left: bool = False
    turn: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def waiting(self) -> bool:
        return not (self.admitted or self.left)


Line = list[tuple[float, int, Ticket]]


class PassQueue:
    def __init__(self, slots: int = DEFAULT_SLOTS, news_per_routine: int = DEFAULT_NEWS_PER_ROUTINE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if slots < 1:
            raise ValueError(f"a pass queue needs at least one slot, got {slots}")
        if news_per_routine < 1:
            raise ValueError(f"news_per_routine must be >= 1, got {news_per_routine}")
        self.slots, self.news_per_routine, self.clock = slots, news_per_routine, clock
        self.running = 0
        self._news: Line = []
        self._routine: Line = []
        self._order = itertools.count()
        #: news passes admitted since the last routine one, while routine ones waited
        self._streak = 0

    @property
    def waiting(self) -> int:
        return sum(1 for line in (self._news, self._routine) for _, _, t in line if t.waiting)

    def enter(self, asked_at: float, routine: bool) -> Ticket:
        """A place for a pass first asked for at ``asked_at`` (this queue's clock): admitted at once
        while a slot is free and no one waits."""
        ticket = Ticket(asked_at, routine)
        heapq.heappush(self._routine if routine else self._news, (asked_at, next(self._order), ticket))
        self._admit()
        return ticket

    def hurry(self, ticket: Ticket) -> None:
        """News for a waiting routine pass: it moves to the news line, keeping its place in time."""
        if not ticket.waiting or not ticket.routine:
            return
        ticket.routine = False  # its routine entry is skipped when reached
        heapq.heappush(self._news, (ticket.asked_at, next(self._order), ticket))
        self._admit()

    def leave(self, ticket: Ticket) -> None:
        """The pass is over (or was given up while waiting): its slot goes to the next."""
        if ticket.left:
            return
        ticket.left = True
        if ticket.admitted:
            self.running -= 1
        self._admit()

    def _head(self, line: Line, routine: bool) -> Ticket | None:
        while line and not (line[0][2].waiting and line[0][2].routine == routine):
            heapq.heappop(line)  # admitted, given up, or moved to the news line
        return line[0][2] if line else None

    def _admit(self) -> None:
        while self.running < self.slots:
            news, routine = self._head(self._news, False), self._head(self._routine, True)
            if routine is not None and (news is None or self._streak >= self.news_per_routine):
                heapq.heappop(self._routine)
                self._streak, chosen = 0, routine
            elif news is not None:
                heapq.heappop(self._news)
                self._streak, chosen = (self._streak + 1 if routine is not None else 0), news
            else:
                return
            chosen.admitted = True
            self.running += 1
            chosen.turn.set()


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
                    queue.hurry(self._ticket)
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
                self._ticket = self.queue.enter(self._asked_at, self._routine)
                await self._ticket.turn.wait()
            self.wake.clear()
            self._asked_at, self._routine = None, True
            yield
        finally:
            if self.queue is not None and self._ticket is not None:
                self.queue.leave(self._ticket)
            self._ticket = None
