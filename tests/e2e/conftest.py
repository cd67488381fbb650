"""Fixtures of the end-to-end suite: the CRD, and per test a World (namespace, operator,
pod HTTP) that prints the operator's log, the workers' logs and the objects' status when
the test failed.

Runs against the local cluster, or the one named by WARMPOOL_KUBECONFIG (with
WARMPOOL_E2E_OPERATOR=installed when the chart's operator already runs there).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import Operator, World, install_crd, operator_installed
from warmpool.contract.api import PLURAL


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                                           pytest.TestReport]:
    """Keep each phase's report on the item (item.rep_setup / rep_call) for the fixtures."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def crd(cluster: ClusterHandle) -> str:
    # the chart owns the CRD when it installed the operator
    return install_crd(cluster, field_manager="warmpool-e2e", apply=not operator_installed())


@pytest.fixture()
def world(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path,
          request: pytest.FixtureRequest) -> Iterator[World]:
    if cluster.node is None and not operator_installed():
        pytest.skip("against WARMPOOL_KUBECONFIG the e2e suite needs the operator installed in the cluster "
                    "(helm install ... then WARMPOOL_E2E_OPERATOR=installed): a local operator cannot reach "
                    "pod IPs there, and must not dial private-range addresses")
    operator = Operator(cluster, namespace, tmp_path / "operator.log")
    operator.start()
    w = World(cluster, namespace, operator)
    try:
        yield w
    finally:
        report = getattr(request.node, "rep_call", None)
        if report is None or report.failed:
            print(f"\n########## diagnostics of {request.node.nodeid} (namespace {namespace}) ##########")
            print(w.dump())
        # Delete WarmModels while an operator runs: it removes its finalizer, and the garbage
        # collector then takes every child and pod.
        if not operator.running():
            operator.start()
        cluster.kubectl("-n", namespace, "delete", PLURAL, "--all", "--timeout=60s", check=False)
        leftovers = cluster.kubectl("-n", namespace, "get", PLURAL, "-o", "name", check=False).stdout
        for ref in leftovers.split():
            cluster.kubectl("-n", namespace, "patch", ref, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                            check=False)
        operator.stop()
        w.close()
