"""kwok for the local cluster: the fake nodes' manifests and the command that manages them.

kwok keeps the fake nodes Ready (node-initialize stage plus lease heartbeat) and gives
bound pods a loopback IP; nothing runs on them (the scale benchmark's nodes).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

#: Fake nodes are named ``warmpool-fake-0``, ``warmpool-fake-1``, ... (the real node is
#: ``warmpool-node-0``, see node_kubelet.py).
NODE_NAME_PREFIX = "warmpool-fake-"
#: kwok manages the nodes carrying this annotation (kwok's own convention).
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_NODE_ANNOTATION_VALUE = "fake"
#: Beside a real node, fake nodes carry this taint (NoSchedule): a pod lands there only if it
#: tolerates it, as the tests that need a second node do.
FAKE_NODE_TAINT = {"key": "warmpool.dev/fake-node", "value": "true", "effect": "NoSchedule"}
#: Fake nodes' address; loopback so nothing ever dials a private-range address.
NODE_IP = "127.0.0.1"
STAGES_FILE = "kwok-stages.yaml"

#: Declared capacity of each fake node: roomy, and 8 GPUs so GPU requests schedule.
NODE_CAPACITY: dict[str, str] = {
    "cpu": "64",
    "memory": "512Gi",
    "pods": "110",
    "ephemeral-storage": "1Ti",
    "nvidia.com/gpu": "8",
}


def stages_yaml() -> str:
    """The custom kwok stages shipped as package data."""
    return resources.files(__package__).joinpath(STAGES_FILE).read_text(encoding="utf-8")


def kwok_command(kwok_bin: Path, kubeconfig: Path, pod_cidr: str, work_dir: Path) -> list[str]:
    """argv for a long-lived kwok managing our fake nodes with our custom stages.

    The stages are written to ``work_dir/kwok-stages.yaml`` so the file kwok reads is a
    plain file next to its logs (package data may live in a zip or wheel).
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    stages_path = work_dir / STAGES_FILE
    stages_path.write_text(stages_yaml(), encoding="utf-8")
    return [
        str(kwok_bin),
        f"--kubeconfig={kubeconfig}",
        f"--config={stages_path}",
        f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}={KWOK_NODE_ANNOTATION_VALUE}",
        f"--cidr={pod_cidr}",
        f"--node-ip={NODE_IP}",
    ]


def node_name(index: int) -> str:
    return f"{NODE_NAME_PREFIX}{index}"


def node_manifests(count: int, tainted: bool = False) -> list[dict[str, Any]]:
    """Fake Node objects for kwok to manage; untainted (ordinary pods schedule on them) unless
    ``tainted``, beside a real node, where pods must run for real unless they ask otherwise.

    The API server keeps ``status`` on create for nodes, and kwok's node-initialize stage
    keeps a declared capacity/allocatable, so GPU requests fit.
    """
    nodes: list[dict[str, Any]] = []
    for index in range(count):
        name = node_name(index)
        nodes.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {
                        KWOK_NODE_ANNOTATION: KWOK_NODE_ANNOTATION_VALUE,
                        "node.alpha.kubernetes.io/ttl": "0",
                    },
                    "labels": {
                        "type": "kwok",
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "node-role.kubernetes.io/agent": "",
                        "nvidia.com/gpu.present": "true",
                    },
                },
                "spec": {"taints": [dict(FAKE_NODE_TAINT)]} if tainted else {},
                "status": {
                    "capacity": dict(NODE_CAPACITY),
                    "allocatable": dict(NODE_CAPACITY),
                    # No nodeInfo: the OpenAPI schema requires all ten of its fields, and
                    # validating clients reject a partial one.
                },
            }
        )
    return nodes
