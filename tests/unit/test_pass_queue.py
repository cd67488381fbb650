"""The pass queue (control/pass_queue.py): news before the backlog, first come first served within a
class, and aging so that the backlog still finishes.  Pure: the clock and the passes are the test's."""

from __future__ import annotations

import pytest
from warmpool_operator.control.pass_queue import PassQueue, Ticket

pytestmark = pytest.mark.unit


def admitted(tickets: dict[str, Ticket]) -> set[str]:
    return {name for name, ticket in tickets.items() if ticket.admitted and not ticket.left}


async def test_news_overtakes_the_backlog_and_each_class_is_first_come_first_served() -> None:
    queue = PassQueue(slots=1, aging_s=30.0)
    tickets = {f"listed-{i}": queue.enter(queue.key(float(i), routine=True)) for i in range(3)}
    assert admitted(tickets) == {"listed-0"}  # a free slot is taken at once
    tickets["new-a"] = queue.enter(queue.key(5.0, routine=False))
    tickets["new-b"] = queue.enter(queue.key(6.0, routine=False))
    order = []
    for _ in range(5):
        (running,) = admitted(tickets)
        order.append(running)
        queue.leave(tickets[running])
    assert order == ["listed-0", "new-a", "new-b", "listed-1", "listed-2"]
    assert queue.running == 0


async def test_a_routine_pass_waits_at_most_the_aging_behind_later_news() -> None:
    queue = PassQueue(slots=1, aging_s=10.0)
    busy = queue.enter(0.0)
    tickets = {"listed": queue.enter(queue.key(0.0, routine=True)),
               "news-before": queue.enter(queue.key(9.0, routine=False)),
               "news-after": queue.enter(queue.key(11.0, routine=False))}
    order = []
    queue.leave(busy)
    for _ in range(3):
        (running,) = admitted(tickets)
        order.append(running)
        queue.leave(tickets[running])
    # News that came within the aging goes first; news after it waits for the older backlog.
    assert order == ["news-before", "listed", "news-after"]


async def test_news_for_a_waiting_pass_moves_it_up_and_a_pass_given_up_frees_nothing_twice() -> None:
    queue = PassQueue(slots=1, aging_s=30.0)
    busy = queue.enter(0.0)
    late = queue.enter(queue.key(1.0, routine=True))
    other = queue.enter(queue.key(2.0, routine=False))
    queue.hurry(late, queue.key(1.0, routine=False))  # its pool had news while it waited
    queue.leave(busy)
    assert late.admitted and not other.admitted
    gone = queue.enter(queue.key(3.0, routine=False))
    queue.leave(gone)  # given up while waiting: never admitted, holds no slot
    queue.leave(gone)
    queue.leave(late)
    assert other.admitted and not gone.admitted
    assert queue.running == 1 and queue.waiting == 0


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        PassQueue(slots=0)
    with pytest.raises(ValueError, match="aging"):
        PassQueue(aging_s=-1)
