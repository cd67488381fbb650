"""Shared fixtures: one real local cluster per test session (control plane and a real node, the
checkout's images built and loaded into it), a fresh namespace per test.

When WARMPOOL_KUBECONFIG names an existing cluster (a kind cluster on a laptop, say),
the tests use it instead of starting one.  WARMPOOL_TEST_CLUSTER names a local cluster to start
or reuse, and WARMPOOL_KEEP_CLUSTER leaves it running afterwards (a quicker next run).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from warmpool_devcluster.testing import ClusterHandle, start_api_server, start_or_attach

if TYPE_CHECKING:
    from tests.support.control_doubles import ControlCluster


#: Every test is exactly one of these kinds (pyproject.toml's markers), so `make unit` (-m unit) and the
#: suite's own selections never skip one by accident.
TEST_KINDS = ("unit", "integration", "e2e", "node_lifecycle")


#: Fixtures that start a server or a cluster: no test under tests/unit/ may use one.
SERVER_FIXTURES = frozenset({"cluster", "namespace", "api_server"})
UNIT_FOLDER = Path(__file__).resolve().parent / "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items
                if sum(1 for kind in TEST_KINDS if item.get_closest_marker(kind) is not None) != 1]
    if unmarked:
        raise pytest.UsageError("each test needs exactly one of the markers " + ", ".join(TEST_KINDS)
                                + " (pytestmark = pytest.mark.<kind>); these have none or several:\n  "
                                + "\n  ".join(unmarked[:20]))
    # tests/unit/ is what `make unit` runs in about a minute: no server, no cluster.  A test with a
    # real API server twin (the control_cluster fixture's "api" run) lives in tests/integration/.
    def starts_a_server(item: pytest.Item) -> bool:
        return item.get_closest_marker("unit") is None or bool(SERVER_FIXTURES & set(getattr(item, "fixturenames", ())))

    misplaced = sorted({str(item.path.relative_to(UNIT_FOLDER.parent)) for item in items
                        if UNIT_FOLDER in item.path.parents and starts_a_server(item)})
    if misplaced:
        raise pytest.UsageError("tests under tests/unit/ start no server or cluster; these files have tests "
                                "that do (move them to tests/integration/):\n  " + "\n  ".join(misplaced))


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterHandle]:
    # Two real nodes; the second is tainted (SPARE_NODE_TAINT), for the tests that need another node.
    handle = start_or_attach(os.environ.get("WARMPOOL_KUBECONFIG"), Path(__file__).resolve().parent.parent,
                             nodes=2, taint_further=True)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture(scope="session")
def api_server() -> Iterator[ClusterHandle]:
    """A real API server that runs no controllers, with the WarmModel CRD: for tests of the
    operator's control layer that play the controllers, the watches and the pods themselves."""
    from tests.support.e2e import install_crd

    handle = start_api_server()
    try:
        install_crd(handle, field_manager="warmpool-tests")
        yield handle
    finally:
        handle.close()


@pytest.fixture(params=[pytest.param("fake", marks=pytest.mark.unit),
                        pytest.param("api", marks=pytest.mark.integration)])
async def control_cluster(request: pytest.FixtureRequest) -> AsyncIterator[ControlCluster]:
    """For the operator's control-layer tests, each run twice: over the in-memory API server
    (unit: milliseconds) and against a real one with no controllers (integration), so the fake
    is held to the real server's answers."""
    from tests.support.api_world import ApiCluster
    from tests.support.fake_api import FakeCluster

    opened: ControlCluster
    if request.param == "fake":
        opened = FakeCluster()
    else:
        opened = await ApiCluster.open(Path(request.getfixturevalue("api_server").kubeconfig))
    try:
        yield opened
    finally:
        await opened.close()


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


@pytest.fixture(scope="session")
def pod_dir() -> Iterator[Callable[[str], Path]]:
    """A fresh directory the node's pods can read (``pod_dir("name")``), for models their workers
    mount: under the node's data directory, not a 0700 temp dir; removed at the session's end."""
    from tests.support.e2e import model_root

    made: list[Path] = []

    def make(name: str) -> Path:
        directory = model_root() / f"{name}-{uuid.uuid4().hex[:8]}"
        directory.mkdir(mode=0o755)
        made.append(directory)
        return directory

    yield make
    for directory in made:
        shutil.rmtree(directory, ignore_errors=True)
