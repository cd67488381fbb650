"""`cluster up --node-runtime none`: etcd and the API server, nothing else, so the tests that play
the controllers themselves (test_control_*.py, test_operator_handlers.py) meet no real one."""

from __future__ import annotations

import json

import pytest
from warmpool_devcluster import cluster
from warmpool_devcluster.testing import ClusterHandle

pytestmark = pytest.mark.integration


def test_it_runs_the_api_server_and_etcd_only_and_registers_no_node(api_server: ClusterHandle) -> None:
    assert api_server.name is not None
    report = cluster.status(api_server.name)
    assert report["running"] and report["nodeRuntime"] == "none", report
    assert set(report["components"]) == {"etcd", "kube-apiserver"}, report["components"]
    assert all(c["alive"] for c in report["components"].values()), report["components"]
    nodes = json.loads(api_server.kubectl("get", "nodes", "-o", "json").stdout)
    assert nodes["items"] == []
    # Asked again with another runtime, the running cluster is named instead of restarted.
    with pytest.raises(cluster.ClusterError, match="is up with node runtime none, not kwok"):
        cluster.up(api_server.name, node_runtime="kwok")
