"""kwok's part of the local cluster: stages that never fake readiness, and the fake nodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from warmpool_devcluster.kwok import kwok_command, node_manifests, stages_yaml

pytestmark = pytest.mark.unit


def test_pod_stages_only_assign_addresses() -> None:
    stages = [s for s in yaml.safe_load_all(stages_yaml()) if s]
    pod_stages = [s for s in stages if s["spec"]["resourceRef"]["kind"] == "Pod"]
    assert pod_stages, "with no Pod stage kwok falls back to its stock pod-ready stage"
    for stage in pod_stages:
        template = stage["spec"]["next"]["statusTemplate"]
        for owned_by_kubelet in ("conditions", "containerStatuses", "phase", "Ready"):
            assert owned_by_kubelet not in template
        assert "podIP" in template and "hostIP" in template
        assert "delete" not in stage["spec"]["next"]  # the kubelet deletes pods after their grace period


def test_command_and_nodes(tmp_path: Path) -> None:
    argv = kwok_command(Path("/bin/kwok"), Path("/k/config"), "127.10.0.0/16", tmp_path)
    assert argv[0] == "/bin/kwok"
    assert "--cidr=127.10.0.0/16" in argv and "--node-ip=127.0.0.1" in argv
    assert f"--config={tmp_path / 'kwok-stages.yaml'}" in argv
    assert (tmp_path / "kwok-stages.yaml").read_text() == stages_yaml()
    nodes = node_manifests(3)
    assert [n["metadata"]["name"] for n in nodes] == ["warmpool-node-0", "warmpool-node-1", "warmpool-node-2"]
    for node in nodes:
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert not node["spec"].get("taints")
