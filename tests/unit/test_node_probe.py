"""Knocks between scrapes (control/node_probe.py): one TCP knock per node each interval, every pod
of a node whose knock failed knocked again at once, the outcomes judged by the scrapes' own rule
(rules/node_answers.py).  Real knocks on loopback; the dead node's knocks are a stand-in that
times out (no address outside loopback is ever dialled)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest
from warmpool_operator.control.node_probe import knock_between_scrapes, knock_round
from warmpool_operator.io.worker_client import knock
from warmpool_operator.model import Sample
from warmpool_operator.rules.node_answers import NodeAnswers, reached

from tests.support.procs import free_port

pytestmark = pytest.mark.unit

WINDOW = 23.0


@pytest.fixture()
def listening() -> Iterator[int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    try:
        yield int(server.getsockname()[1])
    finally:
        server.close()


async def test_a_knock_on_a_listening_port_reaches_it_and_a_closed_one_is_refused(listening: int) -> None:
    opened = await knock(f"http://127.0.0.1:{listening}/metrics", 2.0)
    assert opened.error is None and opened.sent_at > 0
    closed = await knock(f"http://127.0.0.1:{free_port()}/metrics", 2.0)
    assert closed.error is not None and closed.error.startswith("refused:"), closed.error
    assert reached(closed)  # the host answered: its node is up


def _answered(answers: NodeAnswers, uid: str, node: str, at: float) -> None:
    answers.record(uid, node, Sample(ready=True, sent_at=at), f"http://{uid}:8080/metrics")


def test_each_node_is_knocked_on_a_pod_that_answered_the_least_recently_heard_first() -> None:
    answers = NodeAnswers()
    _answered(answers, "a1", "node-a", 10)
    _answered(answers, "a2", "node-a", 12)
    _answered(answers, "b1", "node-b", 11)
    answers.record("c1", "node-c", Sample(error="timeout", sent_at=11), "http://c1:8080/metrics")  # never answered
    assert answers.knock_targets() == {"node-a": ("a1", "http://a1:8080/metrics"),
                                       "node-b": ("b1", "http://b1:8080/metrics")}
    answers.record("a1", "node-a", Sample(error="timeout", sent_at=13))
    # a1 failed: a2, which answered, is knocked next; the url recorded with a scrape stays known.
    assert answers.knock_targets()["node-a"] == ("a2", "http://a2:8080/metrics")
    assert answers.pods["a1"].url == "http://a1:8080/metrics"


def test_an_outcome_older_than_the_one_recorded_is_ignored() -> None:
    answers = NodeAnswers()
    _answered(answers, "a1", "node-a", 20)
    answers.record("a1", "node-a", Sample(error="timeout", sent_at=15))  # a scrape sent before, ending late
    assert answers.pods["a1"].reached and answers.pods["a1"].at == 20


class Knocks:
    """Knock outcomes by url: the pods of ``dead`` nodes time out, the others answer."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.sent: list[str] = []
        self.clock = 100.0

    async def __call__(self, url: str) -> Sample:
        self.sent.append(url)
        host = url.split("//")[1].split(":")[0]
        failed = host.startswith(tuple(self.dead))
        return Sample(error="timeout" if failed else None, sent_at=self.clock)


async def test_a_failed_knock_checks_every_pod_of_that_node_and_the_node_is_judged_at_once() -> None:
    answers = NodeAnswers()
    for uid, node in (("a1", "node-a"), ("b1", "node-b"), ("b2", "node-b"), ("b3", "node-b")):
        _answered(answers, uid, node, 99)
    knocks = Knocks()
    assert await knock_round(answers, knocks) == set()
    assert len(knocks.sent) == 2  # one per node while all answer
    knocks.dead, knocks.sent, knocks.clock = {"b"}, [], 101.0
    assert await knock_round(answers, knocks) == {"node-b"}
    # node a's pod once; node b's least recently heard pod (b1 answered the last round), then all three.
    assert knocks.sent[:2] == ["http://a1:8080/metrics", "http://b2:8080/metrics"]
    assert sorted(knocks.sent[2:]) == [f"http://b{i}:8080/metrics" for i in (1, 2, 3)]
    assert answers.unanswering(101.5, WINDOW) == {"node-b"}


async def test_one_node_is_never_knocked() -> None:
    answers = NodeAnswers()
    _answered(answers, "a1", "node-a", 99)
    knocks = Knocks()
    assert await knock_round(answers, knocks) == set() and knocks.sent == []


async def test_the_loop_wakes_the_pools_when_a_judgement_moves_and_again_when_it_clears() -> None:
    answers = NodeAnswers()
    _answered(answers, "a1", "node-a", 99)
    _answered(answers, "b1", "node-b", 99)
    knocks = Knocks()
    clock = [100.0]
    woken: list[set[str]] = []
    knocks.dead = {"b"}

    def now() -> float:
        clock[0] += 0.01
        knocks.clock = clock[0]
        return clock[0]

    task = asyncio.create_task(knock_between_scrapes(answers, knocks, woken.append, 0.01, WINDOW, now))
    try:
        for _ in range(200):
            if woken:
                break
            await asyncio.sleep(0.01)
        assert woken == [{"node-b"}]
        knocks.dead = set()
        for _ in range(200):
            if len(woken) == 2:
                break
            await asyncio.sleep(0.01)
        assert woken == [{"node-b"}, {"node-b"}]  # judged, then answering again
    finally:
        task.cancel()
