"""The pass queue (control/pass_queue.py): news before the backlog, first come first served within a
line, and the backlog's share so that it still finishes.  Pure: the clock and the passes are the test's."""

from __future__ import annotations

import pytest
from warmpool_operator.control.pass_queue import PassQueue, Ticket

pytestmark = pytest.mark.unit


def run_in_turn(queue: PassQueue, tickets: dict[str, Ticket], count: int) -> list[str]:
    """The names of the next ``count`` passes, each run alone (one slot) to its end."""
    order = []
    for _ in range(count):
        (running,) = {name for name, ticket in tickets.items() if ticket.admitted and not ticket.left}
        order.append(running)
        queue.leave(tickets[running])
    return order


async def test_news_overtakes_the_backlog_and_each_line_is_first_come_first_served() -> None:
    queue = PassQueue(slots=1)
    tickets = {f"listed-{i}": queue.enter(float(i), routine=True) for i in range(3)}
    assert tickets["listed-0"].admitted  # a free slot is taken at once
    # News that came long after the backlog was listed still goes first (no aging in seconds).
    tickets["new-a"] = queue.enter(500.0, routine=False)
    tickets["new-b"] = queue.enter(501.0, routine=False)
    assert run_in_turn(queue, tickets, 5) == ["listed-0", "new-a", "new-b", "listed-1", "listed-2"]
    assert queue.running == 0


async def test_the_backlog_gets_its_share_while_news_keeps_coming() -> None:
    queue = PassQueue(slots=1, news_per_routine=2)
    busy = queue.enter(0.0, routine=False)
    tickets = {f"r{i}": queue.enter(float(i), routine=True) for i in range(3)}
    tickets |= {f"n{i}": queue.enter(10.0 + i, routine=False) for i in range(5)}
    queue.leave(busy)
    assert run_in_turn(queue, tickets, 8) == ["n0", "n1", "r0", "n2", "n3", "r1", "n4", "r2"]


async def test_news_for_a_waiting_pass_moves_it_up_and_a_pass_given_up_frees_nothing_twice() -> None:
    queue = PassQueue(slots=1)
    busy = queue.enter(0.0, routine=False)
    late = queue.enter(1.0, routine=True)
    other = queue.enter(2.0, routine=False)
    queue.hurry(late)  # its pool had news while it waited: ahead of later news
    queue.leave(busy)
    assert late.admitted and not other.admitted
    gone = queue.enter(3.0, routine=False)
    queue.leave(gone)  # given up while waiting: never admitted, holds no slot
    queue.leave(gone)
    queue.leave(late)
    assert other.admitted and not gone.admitted
    assert queue.running == 1 and queue.waiting == 0


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        PassQueue(slots=0)
    with pytest.raises(ValueError, match="news_per_routine"):
        PassQueue(news_per_routine=0)
