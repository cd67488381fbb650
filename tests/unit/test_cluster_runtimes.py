"""`cluster up`'s node runtimes: a wrong one, or fake nodes beside an API server alone, is refused
by name before anything starts."""

from __future__ import annotations

import pytest
from warmpool_devcluster import cluster

pytestmark = pytest.mark.unit


def test_an_unknown_runtime_is_refused_naming_the_ones_there_are() -> None:
    with pytest.raises(cluster.ClusterError, match="must be one of kwok, containerd, none, not 'docker'"):
        cluster.up("t-unknown-runtime", node_runtime="docker")


def test_an_api_server_alone_runs_no_fake_nodes() -> None:
    with pytest.raises(cluster.ClusterError, match="runs no nodes: drop --fake-nodes"):
        cluster.up("t-api-alone", node_runtime="none", fake_nodes=1)


def test_several_nodes_need_real_ones() -> None:
    with pytest.raises(cluster.ClusterError, match="--nodes 2 needs real nodes: add --node-runtime containerd"):
        cluster.up("t-nodes-kwok", node_runtime="kwok", nodes=2)
