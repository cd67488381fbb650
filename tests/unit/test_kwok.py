"""kwok's part of the local cluster: stages that never fake readiness, and the fake nodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from warmpool_devcluster.kwok import kwok_command, node_manifests, stages_yaml

pytestmark = pytest.mark.unit


def test_pod_stages_assign_addresses_and_delete_but_never_fake_readiness() -> None:
    stages = [s for s in yaml.safe_load_all(stages_yaml()) if s]
    pod_stages = {s["metadata"]["name"]: s for s in stages if s["spec"]["resourceRef"]["kind"] == "Pod"}
    assert set(pod_stages) == {"warmpool-pod-network", "warmpool-pod-delete"}, (
        "with no Pod stage kwok falls back to its stock pod-ready stage")
    template = pod_stages["warmpool-pod-network"]["spec"]["next"]["statusTemplate"]
    for owned_by_a_kubelet in ("conditions", "containerStatuses", "phase", "Ready"):
        assert owned_by_a_kubelet not in template
    assert "podIP" in template and "hostIP" in template
    deleting = pod_stages["warmpool-pod-delete"]["spec"]
    # only pods already being deleted: no kubelet will confirm their end on a fake node
    assert deleting["selector"]["matchExpressions"] == [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}]
    assert deleting["next"]["delete"] is True and "statusTemplate" not in deleting["next"]


def test_command_and_nodes(tmp_path: Path) -> None:
    argv = kwok_command(Path("/bin/kwok"), Path("/k/config"), "127.10.0.0/16", tmp_path)
    assert argv[0] == "/bin/kwok"
    assert "--cidr=127.10.0.0/16" in argv and "--node-ip=127.0.0.1" in argv
    assert f"--config={tmp_path / 'kwok-stages.yaml'}" in argv
    assert (tmp_path / "kwok-stages.yaml").read_text() == stages_yaml()
    nodes = node_manifests(3)
    assert [n["metadata"]["name"] for n in nodes] == ["warmpool-fake-0", "warmpool-fake-1", "warmpool-fake-2"]
    for node in nodes:
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert not node["spec"].get("taints")
