"""Shared fixtures: one real local control plane per test session, a fresh namespace per test.

When WARMPOOL_KUBECONFIG names an existing cluster (a kind cluster on a laptop, say),
the tests use it instead of starting one.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from warmpool_devcluster.testing import ClusterHandle, start_or_attach


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterHandle]:
    handle = start_or_attach(os.environ.get("WARMPOOL_KUBECONFIG"))
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture()
def namespace(cluster: ClusterHandle, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of its own for each test, deleted (and waited for) afterwards."""
    name = f"t-{request.node.name[:30].lower().replace('_', '-').strip('-')}-{uuid.uuid4().hex[:6]}"
    name = "".join(ch for ch in name if ch.isalnum() or ch == "-")
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
