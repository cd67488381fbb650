"""Which nodes stopped answering (rules/node_answers.py): every pod of ours on a node fails its
scrapes at the connection while a pod on another node answers.  Never without that witness, never
for a node where one pod still answers, and any answer clears it."""

from __future__ import annotations

import aiohttp
import pytest
from warmpool_operator.io.worker_client import scrape_one
from warmpool_operator.model import Sample
from warmpool_operator.rules.node_answers import NodeAnswers, reached
from warmpool_operator.rules.node_health import NodeBoard

from tests.support.procs import free_port

pytestmark = pytest.mark.unit

WINDOW = 23.0  # two 10 s rounds and a 3 s scrape


def answer(at: float) -> Sample:
    return Sample(ready=True, sent_at=at)


def failure(at: float, error: str = "unreachable: ClientConnectorError") -> Sample:
    return Sample(error=error, sent_at=at)


def test_only_failures_at_the_connection_count_as_not_reached() -> None:
    assert not reached(failure(0, "timeout")) and not reached(failure(0))
    # The worker was reached: it answered, if badly; or its pod's network refused (the host is up).
    assert reached(answer(0)) and reached(failure(0, "http 503")) and reached(failure(0, "garbage: 9 MiB"))
    assert reached(failure(0, "refused: ClientConnectorError"))


async def test_a_scrape_of_a_port_nothing_listens_on_is_refused_not_unreachable() -> None:
    """A worker still starting: its pod's network sends a reset, which says the node is alive."""
    async with aiohttp.ClientSession() as session:
        sample = await scrape_one(session, f"http://127.0.0.1:{free_port()}/metrics", 2.0)
    assert sample.error is not None and sample.error.startswith("refused:"), sample.error
    assert reached(sample)


def test_pods_that_never_answered_are_no_evidence_about_their_node() -> None:
    """Pods still starting (or cut off from the operator from the start) on one node, while another
    node's pod answers: no judgement, or the pool would grow with replacements just as unreachable."""
    answers = NodeAnswers()
    answers.record("a1", "node-a", answer(100))
    answers.record("b1", "node-b", failure(101, "timeout"))
    answers.record("b2", "node-b", failure(101))
    answers.record("a1", "node-a", answer(102))
    assert answers.unanswering(103, WINDOW) == frozenset()
    answers.record("b1", "node-b", answer(110))  # warm at last, then its node goes
    answers.record("b1", "node-b", failure(120))
    answers.record("a1", "node-a", answer(121))
    assert answers.unanswering(122, WINDOW) == {"node-b"}


def test_a_node_whose_every_pod_fails_while_another_nodes_answers_is_unanswering() -> None:
    answers = NodeAnswers()
    answers.record("a1", "node-a", answer(100))
    answers.record("b1", "node-b", answer(101))
    answers.record("b2", "node-b", answer(102))
    assert answers.unanswering(103, WINDOW) == frozenset()
    answers.record("b1", "node-b", failure(110))
    assert answers.unanswering(111, WINDOW) == frozenset()  # b2 has not failed yet: it still answers
    answers.record("b2", "node-b", failure(111))
    answers.record("a1", "node-a", answer(112))
    assert answers.unanswering(112, WINDOW) == {"node-b"}
    # a pod there answers again (an HTTP error too): the node is back
    answers.record("b1", "node-b", failure(120, "http 500"))
    assert answers.unanswering(121, WINDOW) == frozenset()


def test_no_witness_no_judgement() -> None:
    """A one-node cluster, and a cluster whose every node fails at once (the operator's own
    network), are never judged by scrapes."""
    alone = NodeAnswers()
    alone.record("b1", "node-b", answer(100))
    alone.record("b1", "node-b", failure(110))
    assert alone.unanswering(111, WINDOW) == frozenset()
    everyone = NodeAnswers()
    everyone.record("a1", "node-a", answer(100))
    everyone.record("b1", "node-b", answer(100))
    everyone.record("a1", "node-a", failure(110))
    everyone.record("b1", "node-b", failure(110))
    assert everyone.unanswering(111, WINDOW) == frozenset()


def test_a_witness_from_long_before_the_failures_is_no_witness_and_gone_pods_are_forgotten() -> None:
    answers = NodeAnswers()
    answers.record("a1", "node-a", answer(0))
    answers.record("b1", "node-b", failure(100))
    assert answers.unanswering(101, WINDOW) == frozenset()
    answers.forget_older_than(50)
    assert set(answers.pods) == {"b1"}
    answers.record("b2", "node-b", answer(60))  # a pod since deleted: its answer no longer counts
    answers.forget({"b2"})
    assert set(answers.pods) == {"b1"}
    answers.record("b1", "node-b", failure(200))  # only pods scraped within the window are judged
    answers.record("a1", "node-a", answer(201))
    assert answers.pods["b1"].failing_since == 100  # the run of failures began at its first
    assert answers.unanswering(300, WINDOW) == frozenset()  # nothing scraped within the window


def test_an_unanswering_node_is_lost_and_says_why() -> None:
    board = NodeBoard()
    board.unanswering = {"node-b"}
    health = board.health()
    assert health.pod_lost("node-b") and not health.pod_lost("node-a")
    assert health.failure("node-b") == ("node node-b: no worker pod there answers its scrapes while pods on other "
                                        "nodes do: replaced on another node")
    board.cordoned = {"node-b"}
    assert not board.health().pod_leaving("node-b")  # lost, not leaving
