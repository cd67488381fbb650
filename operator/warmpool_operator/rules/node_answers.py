"""Which nodes stopped answering: every worker pod of ours there fails its scrapes at the
connection while a pod on another node answers (pure).

A node that loses power, its network or its kernel takes its pods with it, and nothing tells the
API server so: its kubelet's Lease stops being renewed (rules/node_leases.py notices in 15-35 s)
and the node lifecycle controller marks it after 40-50 s.  The operator learns sooner by itself:
it scrapes each worker pod every ``--scrape-interval``, and a scrape that fails at the connection
(timed out, no route to the host) already makes that pod not warm.  When that holds of *every* pod
of ours on one node that answered before, while a pod on another node answered since shortly before
the failures began, the node is the likely cause: it is **unanswering**, treated as lost
(rules/node_health.py), and its pods are replaced elsewhere at once.

Only what points at the node counts.  A connection refused means the pod's network answered (a
worker starting or restarting): the node is alive.  A pod that never answered a scrape (still
starting, or cut off from the operator from its first day) is no evidence either way: a node
judged by such pods would have its pool grow with replacements just as unreachable.

Never without a witness, as with the Lease rule: with no other node's pod answering, a dead node
cannot be told from the operator's own network failing, or from a one-node cluster's workers
restarting, so a one-node cluster is never judged this way.  Any answer from a pod on the node
(an HTTP error too: the worker was reached) clears it.  A cost, not a failure: a node whose every
pod of ours is cut off from the operator alone (a firewall) gets its pods' replacements elsewhere
while they still serve; they scale down, coldest first, once the node answers again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from warmpool_operator.model import Sample

#: Scrape rounds over which a node's pods are judged (with a scrape's timeout: the time a round
#: needs to reach every pod).
ANSWER_WINDOW_ROUNDS = 2


def answer_window(scrape_interval: float, scrape_timeout: float) -> float:
    """Seconds of outcomes a node is judged on."""
    return ANSWER_WINDOW_ROUNDS * scrape_interval + scrape_timeout


#: A scrape that failed with one of these never reached the pod's host (io/worker_client.py's
#: errors; "refused" is not one: the host answered).
CONNECTION_ERRORS = ("timeout", "unreachable")


def reached(sample: Sample) -> bool:
    """The scrape reached the pod (an answer, even an HTTP error, a body that could not be parsed,
    or a refused connection: the pod's network answered)."""
    return sample.error is None or not sample.error.startswith(CONNECTION_ERRORS)


@dataclass
class PodAnswer:
    node: str
    #: when the latest scrape of the pod was sent (the operator's monotonic clock)
    at: float
    reached: bool
    #: when the run of failed scrapes the latest one belongs to began (None after an answer)
    failing_since: float | None
    #: whether any scrape of it ever reached it (one that never did is no evidence about its node)
    ever_reached: bool
    #: the pod's metrics url, where control/node_probe.py knocks between scrapes ("" if not known)
    url: str = ""


@dataclass
class NodeAnswers:
    """Each scraped pod's latest outcome, by node."""

    pods: dict[str, PodAnswer] = field(default_factory=dict)

    def record(self, uid: str, node: str, sample: Sample, url: str = "") -> None:
        if not node:
            return
        at, ok = sample.sent_at, reached(sample)
        previous = self.pods.get(uid)
        if previous is not None and at < previous.at:
            return  # a knock or scrape sent before the outcome already recorded
        since = None if ok else (previous.failing_since if previous and previous.failing_since is not None else at)
        ever = ok or (previous is not None and previous.ever_reached)
        url = url or (previous.url if previous is not None else "")
        self.pods[uid] = PodAnswer(node=node, at=at, reached=ok, failing_since=since, ever_reached=ever, url=url)

    def knock_targets(self) -> dict[str, tuple[str, str]]:
        """Per node, the pod to knock on (uid, url): of those that ever answered, one that answered
        last time if any, the least recently heard from first (so knocks rotate over a node's pods)."""
        chosen: dict[str, tuple[str, PodAnswer]] = {}
        for uid, answer in self.pods.items():
            if not answer.ever_reached or not answer.url:
                continue
            best = chosen.get(answer.node)
            if best is None or (answer.reached, -answer.at) > (best[1].reached, -best[1].at):
                chosen[answer.node] = (uid, answer)
        return {node: (uid, answer.url) for node, (uid, answer) in chosen.items()}

    def on_node(self, node: str) -> list[tuple[str, str]]:
        """(uid, url) of every pod on ``node`` that ever answered."""
        return [(uid, a.url) for uid, a in self.pods.items() if a.node == node and a.ever_reached and a.url]

    def forget(self, uids: set[str]) -> None:
        """Drop pods that are gone or terminating (their last answer says nothing of their node now)."""
        for uid in uids:
            self.pods.pop(uid, None)

    def forget_older_than(self, horizon: float) -> None:
        """Drop the pods not scraped since ``horizon`` (deleted, or no longer ours to scrape)."""
        self.pods = {uid: answer for uid, answer in self.pods.items() if answer.at >= horizon}

    def unanswering(self, now: float, window_s: float) -> frozenset[str]:
        """The nodes whose every pod scraped within ``window_s`` before ``now`` (of those that ever
        answered) failed at the connection, while a pod on another node answered at most
        ``window_s`` before the first of those failures (or since)."""
        recent = [a for a in self.pods.values() if a.at >= now - window_s and a.ever_reached]
        by_node: dict[str, list[PodAnswer]] = {}
        for answer in recent:
            by_node.setdefault(answer.node, []).append(answer)
        found = set()
        for node, answers in by_node.items():
            if any(a.reached or a.failing_since is None for a in answers):
                continue
            began = min(a.failing_since for a in answers if a.failing_since is not None)
            witness = any(a.node != node and a.reached and a.at >= began - window_s for a in self.pods.values())
            if witness:
                found.add(node)
        return frozenset(found)
