"""The one Lease implementation (warmpool.lease) that leader election and the node agent share,
attempt by attempt on the in-memory API (tests/support/fake_api.py) with an injected clock.  The
same rules run on the real API server in test_leader_lease.py and test_node_agent.py."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.fake_api import FakeKube
from warmpool.lease import Lease, LeaseLostError, Observed

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def contenders(kube: FakeKube, clock: Clock, duration_s: float = 8.0) -> tuple[Lease, Lease]:
    a = Lease(kube, "ns", "l", "a", duration_s, clock=clock)
    b = Lease(kube, "ns", "l", "b", duration_s, clock=clock)
    return a, b


def spec(kube: FakeKube) -> dict[str, object]:
    return dict(kube.store[("leases", "ns", "l")]["spec"])


def test_a_contender_waits_for_the_record_to_stand_still_for_the_duration_by_its_own_clock() -> None:
    async def scenario() -> None:
        kube, clock = FakeKube(), Clock()
        a, b = contenders(kube, clock)
        assert await a.try_acquire() and a.version == 1
        assert spec(kube)["leaseTransitions"] == 0
        assert not await b.try_acquire()  # first sight of the record: the count starts now
        clock.now += 7.9
        assert not await b.try_acquire()
        clock.now += 0.2
        assert await b.try_acquire() and b.version == 2
        assert spec(kube)["holderIdentity"] == "b" and spec(kube)["leaseTransitions"] == 1
        # A, which stopped renewing, is past its deadline by then: refused, it holds nothing afterwards.
        with pytest.raises(LeaseLostError, match="not renewed in time"):
            await a.renew()
        assert a.version is None

    asyncio.run(scenario())


def test_a_renewal_by_the_holder_starts_the_contenders_count_again() -> None:
    async def scenario() -> None:
        kube, clock = FakeKube(), Clock()
        a, b = contenders(kube, clock)
        assert await a.try_acquire()
        assert not await b.try_acquire()
        clock.now += 6.0
        await a.renew()
        clock.now += 6.0  # 12 s since b first looked, 6 s since the renewal it saw
        assert not await b.try_acquire()
        clock.now += 8.1
        assert await b.try_acquire()

    asyncio.run(scenario())


def test_a_holder_past_its_deadline_is_refused_before_anyone_may_take_over() -> None:
    async def scenario() -> None:
        kube, clock = FakeKube(), Clock()
        a, _ = contenders(kube, clock)
        assert await a.try_acquire()
        clock.now += 5.0
        await a.renew(deadline_s=6.0)
        clock.now += 6.5
        with pytest.raises(LeaseLostError, match="not renewed in time"):
            await a.renew(deadline_s=6.0)
        assert a.version is None

    asyncio.run(scenario())


def test_a_holder_whose_lease_was_written_by_another_is_refused() -> None:
    async def scenario() -> None:
        kube, clock = FakeKube(), Clock()
        a, _ = contenders(kube, clock)
        assert await a.try_acquire()
        await kube.request("PUT", a.path, body={**kube.store[("leases", "ns", "l")],
                                               "spec": {**spec(kube), "holderIdentity": "someone"}})
        with pytest.raises(LeaseLostError, match="taken over"):
            await a.renew()
        assert a.version is None

    asyncio.run(scenario())


def test_a_released_lease_goes_at_once_and_a_release_never_undoes_anothers_hold() -> None:
    async def scenario() -> None:
        kube, clock = FakeKube(), Clock()
        a, b = contenders(kube, clock)
        assert await a.try_acquire()
        assert await a.release()
        assert spec(kube)["holderIdentity"] == ""
        assert await b.try_acquire() and b.version == 2  # no wait for a released Lease
        assert not await a.release()
        assert spec(kube)["holderIdentity"] == "b"

    asyncio.run(scenario())


def test_the_holder_finding_its_own_record_renews_it_without_a_transition() -> None:
    async def scenario() -> None:
        kube, clock = FakeKube(), Clock()
        a, _ = contenders(kube, clock)
        assert await a.try_acquire()
        again = Lease(kube, "ns", "l", "a", 8.0, clock=clock)  # a new client of the same holder
        assert await again.try_acquire() and again.version == 1
        assert spec(kube)["leaseTransitions"] == 0

    asyncio.run(scenario())


def test_a_lost_race_is_a_refusal_not_a_second_holder() -> None:
    async def scenario() -> None:
        kube, clock = FakeKube(), Clock()
        a, b = contenders(kube, clock)
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
        assert not await b.try_acquire()  # its PUT carries the stale resourceVersion: 409
        assert spec(kube)["holderIdentity"] == "a"

    asyncio.run(scenario())


def test_observed_treats_a_released_record_as_free_at_once() -> None:
    assert Observed().expired({"spec": {"holderIdentity": ""}, "metadata": {"resourceVersion": "3"}}, now=0.0)
