"""A node whose kubelet stops renewing its Lease is silent, and lost, once another node's renewals
show the operator's view is moving (rules/node_leases.py, rules/node_health.py); the flag that sets
the grace (app/cli.py)."""

from __future__ import annotations

from typing import Any

import pytest
from warmpool_operator.app.cli import BadFlags, build_parser, config_from_args
from warmpool_operator.rules.node_health import NodeBoard
from warmpool_operator.rules.node_leases import DEFAULT_GRACE_S, MIN_GRACE_S, NodeLeases

pytestmark = pytest.mark.unit

GRACE_S = 25.0


def lease(node: str, renew: str) -> dict[str, Any]:
    return {"metadata": {"name": node, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": renew}}


def renewals(leases: NodeLeases, node: str, times: range, grace_s: float = GRACE_S) -> list[set[str]]:
    """``node`` renews at each of ``times`` (seconds, the operator's clock); what each judgement changed."""
    news = []
    for at in times:
        leases.update("MODIFIED", lease(node, f"renewed at {at}"), float(at))
        news.append(leases.judge(grace_s))
    return news


def test_a_node_silent_for_the_grace_while_another_renews_is_silent_and_its_renewal_ends_that() -> None:
    leases = NodeLeases()
    for node in ("a", "b"):
        leases.update("ADDED", lease(node, "t0"), 0.0)
    assert renewals(leases, "b", range(10, 30, 10)) == [set(), set()]  # b renews, a seen at 0 only
    assert renewals(leases, "b", range(30, 40, 10)) == [{"a"}]  # 30 s after a's last: over the grace
    assert leases.silent == {"a"}
    assert renewals(leases, "b", range(40, 60, 10)) == [set(), set()]  # news only once
    leases.update("MODIFIED", lease("a", "back"), 61.0)
    assert leases.judge(GRACE_S) == {"a"} and leases.silent == set()


def test_the_same_renew_time_again_is_no_renewal() -> None:
    leases = NodeLeases()
    leases.update("ADDED", lease("a", "t0"), 0.0)
    leases.update("ADDED", lease("b", "t0"), 0.0)
    leases.update("MODIFIED", lease("a", "t0"), 20.0)  # an update of another field: not renewed
    renewals(leases, "b", range(26, 27))
    assert leases.silent == {"a"}


def test_no_node_is_silent_in_a_one_node_cluster_or_when_every_node_went_quiet() -> None:
    alone = NodeLeases()
    alone.update("ADDED", lease("only", "t0"), 0.0)
    assert alone.judge(GRACE_S) == set()
    # Its own renewals are the clock: nothing else can outrun them.
    assert renewals(alone, "only", range(100, 300, 100)) == [set(), set()]
    # Two nodes, and nothing renewed for minutes (a stalled watch, a held event loop): no clock moved.
    quiet = NodeLeases()
    for node in ("a", "b"):
        quiet.update("ADDED", lease(node, "t0"), 0.0)
    assert quiet.judge(GRACE_S) == set() and quiet.silent == set()


def test_a_relist_keeps_when_each_lease_was_last_renewed_and_forgets_the_deleted() -> None:
    leases = NodeLeases()
    for node in ("a", "b", "gone"):
        leases.update("ADDED", lease(node, "t0"), 0.0)
    leases.relist()  # the watch broke; the list brings a and b back, b renewed meanwhile
    leases.update("ADDED", lease("a", "t0"), 30.0)
    leases.update("ADDED", lease("b", "t1"), 30.0)
    assert leases.seen_at == {"a": 0.0, "b": 30.0}  # a not renewed: still last seen at 0
    assert leases.judge(GRACE_S) == {"a"}
    leases.update("DELETED", lease("a", "t0"), 31.0)
    assert leases.judge(GRACE_S) == {"a"} and not leases.silent  # a deleted Lease is no silent node


def test_a_silent_node_is_lost_on_the_board_and_not_counted_as_cordoned() -> None:
    board = NodeBoard(lost={"a"}, cordoned={"a", "c"}, silent={"a", "b"})
    health = board.health()
    assert health.lost == {"a", "b"} and health.cordoned == {"c"}
    assert health.pod_lost("b") and not health.pod_leaving("a")
    # What status.pods says: a node lost by its Lease alone is named as such.
    assert health.silent == {"b"}  # a is NotReady too: its Ready condition says more
    assert health.failure("b") == "node b renews no Lease while other nodes do: replaced on another node"
    assert health.failure("a") == "node a is not Ready or unreachable: replaced on another node"
    board.readable = False  # Nodes unreadable: every node healthy, as before
    assert board.health().lost == frozenset()


def test_the_grace_flag_defaults_to_25s_and_refuses_what_a_late_renewal_would_trip() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args(["-n", "x"])).node_lease_grace_seconds == DEFAULT_GRACE_S == 25.0
    assert config_from_args(parser.parse_args(["-n", "x", "--node-lease-grace-seconds", "0"])
                            ).node_lease_grace_seconds == 0
    refused = f"--node-lease-grace-seconds must be 0 \\(off\\) or at least {MIN_GRACE_S:g}"
    for bad in ("10", "-1", "nan"):
        with pytest.raises(BadFlags, match=refused):
            config_from_args(parser.parse_args(["-n", "x", "--node-lease-grace-seconds", bad]))
