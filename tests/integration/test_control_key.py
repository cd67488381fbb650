"""The operator's control key (io/control_key.py) over the in-memory API server and a real one,
and the tokens derived from it (rules/control_token.py)."""

from __future__ import annotations

import base64

import pytest
from warmpool_operator.io import control_key
from warmpool_operator.io.kube import SECRETS
from warmpool_operator.rules import control_token

from tests.support.control_doubles import ControlCluster


async def test_the_first_replica_makes_the_key_and_every_other_reads_it(control_cluster: ControlCluster) -> None:
    kube, ns = control_cluster.kube, control_cluster.namespace
    first = await control_key.load_or_create(kube, ns, "wp-control-key")
    assert len(first) == control_token.KEY_BYTES
    assert await control_key.load_or_create(kube, ns, "wp-control-key") == first
    stored = await kube.get(SECRETS, ns, "wp-control-key")
    assert stored is not None and base64.b64decode(stored["data"][control_key.KEY_FIELD]) == first


async def test_a_key_secret_without_a_usable_key_is_refused_by_name(control_cluster: ControlCluster) -> None:
    kube, ns = control_cluster.kube, control_cluster.namespace
    await kube.create({**control_key.key_secret(ns, "short", b"k" * 32),
                       "data": {control_key.KEY_FIELD: base64.b64encode(b"k" * 8).decode()}})
    with pytest.raises(control_key.ControlKeyError, match=rf"Secret {ns}/short holds no control key of 32 bytes"):
        await control_key.load_or_create(kube, ns, "short")


@pytest.mark.unit
def test_tokens_differ_by_namespace_name_uid_and_key() -> None:
    key = b"k" * 32
    token = control_token.derive(key, "ns", "m", "uid-1")
    assert token == control_token.derive(key, "ns", "m", "uid-1") and len(token) == 43
    others = {control_token.derive(key, "ns", "m", "uid-2"), control_token.derive(key, "other", "m", "uid-1"),
              control_token.derive(key, "ns", "n", "uid-1"), control_token.derive(b"o" * 32, "ns", "m", "uid-1"),
              # the separator keeps the fields apart: ("n", "s/m") is not ("ns", "/m")
              control_token.derive(key, "n", "sm", "uid-1")}
    assert token not in others and len(others) == 5
    with pytest.raises(ValueError, match="at least 32 bytes"):
        control_token.derive(b"short", "ns", "m", "uid-1")
