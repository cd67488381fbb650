"""Who a completion counts against for the batch's per-client share: its API key (kept only as
a digest) where the request carries one, else its peer address."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request
from warmpool_worker.builtin.completions import client_of

pytestmark = pytest.mark.unit


def test_requests_with_one_api_key_are_one_client_and_the_key_is_not_kept() -> None:
    first = client_of(make_mocked_request("POST", "/v1/completions", headers={"Authorization": "Bearer sk-one"}))
    again = client_of(make_mocked_request("POST", "/v1/completions", headers={"Authorization": "bearer  sk-one "}))
    other = client_of(make_mocked_request("POST", "/v1/completions", headers={"Authorization": "Bearer sk-two"}))
    assert first == again != other
    assert first.startswith("key:") and "sk-one" not in first


def test_without_an_api_key_the_peer_address_names_the_client() -> None:
    for headers in ({}, {"Authorization": "Basic dXNlcg=="}, {"Authorization": "Bearer "}):
        assert client_of(make_mocked_request("POST", "/v1/completions", headers=headers)).startswith("addr:")
