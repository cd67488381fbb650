"""The shared API client keeps at most ``max_in_flight`` requests at the server; the rest wait
their turn before their own time bound starts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from warmpool.kube import DEFAULT_MAX_IN_FLIGHT, KubeClient

pytestmark = pytest.mark.unit


class _Response:
    status = 200

    async def read(self) -> bytes:
        return b'{"kind": "Status"}'


class _CountingApi:
    """Stands in for kubernetes_asyncio's ApiClient.call_api: records how many calls overlap."""

    def __init__(self) -> None:
        self.in_flight = self.most = self.calls = 0

    async def call_api(self, *args: Any, **kwargs: Any) -> _Response:
        self.in_flight += 1
        self.calls += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        return _Response()


async def test_no_more_than_max_in_flight_requests_reach_the_server_at_once_and_all_are_answered() -> None:
    api = _CountingApi()
    client = KubeClient(api, max_in_flight=3)
    answers = await asyncio.gather(*(client.request("GET", f"/api/v1/x/{i}") for i in range(20)))
    assert api.calls == 20 and api.most == 3
    assert all(a == {"kind": "Status"} for a in answers)


def test_the_bound_defaults_to_a_positive_number_and_refuses_zero() -> None:
    assert KubeClient(_CountingApi()).max_in_flight == DEFAULT_MAX_IN_FLIGHT >= 1
    with pytest.raises(ValueError, match="max_in_flight must be >= 1, got 0"):
        KubeClient(_CountingApi(), max_in_flight=0)
