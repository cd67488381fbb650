"""Knocks between scrapes: a dead machine noticed within seconds, not within a scrape round.

The scrapes alone judge a node unanswering (rules/node_answers.py) a round or more after it died:
up to ``--scrape-interval`` before the next scrape of its pods is sent, plus the scrape's timeout.
So every ``--node-probe-interval`` (1 s by default) this loop opens, and closes at once, a TCP
connection to one worker pod of ours on each node that has one that answered before: the
kernel's answer, cheap for the pod and for the operator (one connection per node per interval,
however many pools).  A knock that fails at the connection is checked at once against every pod
of ours on that node, each knocked once more; their outcomes go into the same record the scrapes
feed, so the rule, its witness (another node's pod answering) and its window are unchanged.
When the judgement changes, the pools with pods on those nodes are woken, and their pass replaces
the pods of an unanswering node as it does a lost one's.

A one-node cluster is never knocked: there is no witness to judge by.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from warmpool_operator.model import Sample
from warmpool_operator.rules.node_answers import NodeAnswers, reached

log = logging.getLogger("warmpool.operator")

#: Knocks in flight at once when a failing node's every pod is checked.
CONFIRM_CONCURRENCY = 32


async def knock_round(answers: NodeAnswers, knock: Callable[[str], Awaitable[Sample]]) -> set[str]:
    """One round: a knock per node, then every pod of a node whose knock failed; the nodes whose
    knock failed (their outcomes are in ``answers``)."""
    targets = answers.knock_targets()
    if len(targets) < 2:
        return set()
    items = sorted(targets.items())
    samples = await asyncio.gather(*(knock(url) for _, (_, url) in items))
    failing = set()
    for (node, (uid, url)), sample in zip(items, samples, strict=True):
        answers.record(uid, node, sample, url)
        if not reached(sample):
            failing.add(node)
    gate = asyncio.Semaphore(CONFIRM_CONCURRENCY)

    async def confirm(node: str, uid: str, url: str) -> None:
        async with gate:
            answers.record(uid, node, await knock(url), url)

    await asyncio.gather(*(confirm(node, uid, url) for node in sorted(failing) for uid, url in answers.on_node(node)))
    return failing


async def knock_between_scrapes(answers: NodeAnswers, knock: Callable[[str], Awaitable[Sample]],
                                changed: Callable[[set[str]], None], interval: float, window: float,
                                clock: Callable[[], float] = time.monotonic) -> None:
    """Forever: a knock round every ``interval``; ``changed`` with the nodes whose judgement
    (unanswering within ``window``, as the passes judge) moved since the last round."""
    judged: frozenset[str] = frozenset()
    while True:
        started = clock()
        try:
            await knock_round(answers, knock)
        except Exception:  # a knock is never worth the loop: the scrapes still judge
            log.exception("knocking on the nodes' worker pods failed; the next round tries again")
        now_judged = answers.unanswering(clock(), window)
        if now_judged != judged:
            changed(set(now_judged ^ judged))
            judged = now_judged
        await asyncio.sleep(max(0.0, interval - (clock() - started)))
