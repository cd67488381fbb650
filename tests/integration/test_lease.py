"""The one Lease implementation (warmpool.lease) that leader election and the node agent share,
attempt by attempt with an injected clock: each test twice, on the in-memory API
(tests/support/fake_api.py, a unit test) and on the real API server (integration), so the
fake's answers (409 on a stale write, the record's fields) are held to the real server's."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.control_doubles import ControlCluster, TestKube
from warmpool.lease import Lease, LeaseLostError, Observed


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def contenders(world: ControlCluster, clock: Clock, duration_s: float = 8.0) -> tuple[Lease, Lease]:
    a = Lease(world.kube, world.namespace, "l", "a", duration_s, clock=clock)
    b = Lease(world.kube, world.namespace, "l", "b", duration_s, clock=clock)
    return a, b


async def record(kube: TestKube, lease: Lease) -> dict[str, Any]:
    """The Lease as the API server holds it now."""
    got: dict[str, Any] = await kube.request("GET", lease.path)
    return got


async def spec(kube: TestKube, lease: Lease) -> dict[str, Any]:
    return dict((await record(kube, lease))["spec"])


async def test_a_contender_waits_for_the_record_to_stand_still_for_the_duration_by_its_own_clock(
        control_cluster: ControlCluster) -> None:
    kube, clock = control_cluster.kube, Clock()
    a, b = contenders(control_cluster, clock)
    assert await a.try_acquire() and a.version == 1
    assert (await spec(kube, a))["leaseTransitions"] == 0
    assert not await b.try_acquire()  # first sight of the record: the count starts now
    clock.now += 7.9
    assert not await b.try_acquire()
    clock.now += 0.2
    assert await b.try_acquire() and b.version == 2
    held = await spec(kube, a)
    assert held["holderIdentity"] == "b" and held["leaseTransitions"] == 1
    # A, which stopped renewing, is past its deadline by then: refused, it holds nothing afterwards.
    with pytest.raises(LeaseLostError, match="not renewed in time"):
        await a.renew()
    assert a.version is None


async def test_a_renewal_by_the_holder_starts_the_contenders_count_again(control_cluster: ControlCluster) -> None:
    clock = Clock()
    a, b = contenders(control_cluster, clock)
    assert await a.try_acquire()
    assert not await b.try_acquire()
    clock.now += 6.0
    await a.renew()
    clock.now += 6.0  # 12 s since b first looked, 6 s since the renewal it saw
    assert not await b.try_acquire()
    clock.now += 8.1
    assert await b.try_acquire()


async def test_a_holder_past_its_deadline_is_refused_before_anyone_may_take_over(
        control_cluster: ControlCluster) -> None:
    clock = Clock()
    a, _ = contenders(control_cluster, clock)
    assert await a.try_acquire()
    clock.now += 5.0
    await a.renew(deadline_s=6.0)
    clock.now += 6.5
    with pytest.raises(LeaseLostError, match="not renewed in time"):
        await a.renew(deadline_s=6.0)
    assert a.version is None


async def test_a_holder_whose_lease_was_written_by_another_is_refused(control_cluster: ControlCluster) -> None:
    kube, clock = control_cluster.kube, Clock()
    a, _ = contenders(control_cluster, clock)
    assert await a.try_acquire()
    held = await record(kube, a)
    await kube.request("PUT", a.path, body={**held, "spec": {**held["spec"], "holderIdentity": "someone"}})
    with pytest.raises(LeaseLostError, match="taken over"):
        await a.renew()
    assert a.version is None


async def test_a_released_lease_goes_at_once_and_a_release_never_undoes_anothers_hold(
        control_cluster: ControlCluster) -> None:
    kube, clock = control_cluster.kube, Clock()
    a, b = contenders(control_cluster, clock)
    assert await a.try_acquire()
    assert await a.release()
    assert (await spec(kube, a))["holderIdentity"] == ""
    assert await b.try_acquire() and b.version == 2  # no wait for a released Lease
    assert not await a.release()
    assert (await spec(kube, a))["holderIdentity"] == "b"


async def test_the_holder_finding_its_own_record_renews_it_without_a_transition(
        control_cluster: ControlCluster) -> None:
    kube, clock = control_cluster.kube, Clock()
    a, _ = contenders(control_cluster, clock)
    assert await a.try_acquire()
    again = Lease(kube, control_cluster.namespace, "l", "a", 8.0, clock=clock)  # a new client of the same holder
    assert await again.try_acquire() and again.version == 1
    assert (await spec(kube, a))["leaseTransitions"] == 0


async def test_a_lost_race_is_a_refusal_not_a_second_holder(control_cluster: ControlCluster) -> None:
    kube, clock = control_cluster.kube, Clock()
    a, b = contenders(control_cluster, clock)
    assert await a.try_acquire()
    assert await a.release()
    stale = await b.read()
    assert stale is not None
    assert await a.try_acquire()  # a takes it back between b's read and b's write
    original = kube.request

    async def answer_stale(method: str, path: str, *args: object, **kwargs: object) -> dict[str, object]:
        if method == "GET":
            return dict(stale)
        return await original(method, path, *args, **kwargs)  # type: ignore[arg-type]

    kube.request = answer_stale  # type: ignore[method-assign]
    try:
        assert not await b.try_acquire()  # its PUT carries the stale resourceVersion: 409
    finally:
        kube.request = original  # type: ignore[method-assign]
    assert (await spec(kube, a))["holderIdentity"] == "a"


@pytest.mark.unit
def test_observed_treats_a_released_record_as_free_at_once() -> None:
    assert Observed().expired({"spec": {"holderIdentity": ""}, "metadata": {"resourceVersion": "3"}}, now=0.0)
