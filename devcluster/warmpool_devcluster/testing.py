"""Test-facing handle on a cluster: ours (one real-node cluster per test session, the project's
images loaded into it) or one given by kubeconfig."""

from __future__ import annotations

import ipaddress
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from warmpool_devcluster import build, cluster, images, node, node_containerd


@dataclass(frozen=True)
class RealNode:
    """What tests need of the real node: where its containerd and pod logs are, its pod network."""

    state: Path  # the node's state directory (containerd's socket, the kubelet's pod logs)
    pod_cidr: str

    @property
    def gateway(self) -> str:
        """This machine's address on the node's bridge (where pods reach a server of the host)."""
        return str(next(ipaddress.ip_network(self.pod_cidr).hosts()))

    @property
    def pod_logs(self) -> Path:
        return self.state / "kubelet" / "pod-logs"

    def holds(self, ip: str) -> bool:
        """``ip`` is a pod address on this node's bridge (the only pod addresses tests may dial)."""
        try:
            return ipaddress.ip_address(ip) in ipaddress.ip_network(self.pod_cidr)
        except ValueError:
            return False

    def container_pid(self, container_id: str) -> int:
        """The host PID of a container's process (``containerd://<id>`` or the bare id)."""
        bare = container_id.rsplit("/", 1)[-1]
        pids = node_containerd.task_pids(self.state)
        if bare not in pids:
            raise LookupError(f"container {bare} has no running task on the node")
        return pids[bare]


@dataclass
class ClusterHandle:
    kubeconfig: Path
    #: our own cluster's name, or None when attached to someone else's
    name: str | None
    #: the real node of our cluster (None for an external cluster)
    node: RealNode | None = None
    #: the project's images on the node: name -> tag ({} for an external cluster)
    images: dict[str, str] = field(default_factory=dict)
    #: every real node's pod subnet, node 0's first (() for an external cluster)
    pod_cidrs: tuple[str, ...] = ()

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        binary = build.ensure_binaries(["kubectl"])["kubectl"]
        proc = subprocess.run([str(binary), "--kubeconfig", str(self.kubeconfig), *args],
                              input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def pod_log_dir(self, namespace: str, pod: str) -> Path | None:
        """The kubelet's log folder of a pod (``<ns>_<pod>_<uid>/<container>/N.log``), if on our node."""
        if self.node is None:
            return None
        found = sorted(self.node.pod_logs.glob(f"{namespace}_{pod}_*"))
        return found[-1] if found else None

    def close(self) -> None:
        if self.name is not None and not os.environ.get("WARMPOOL_KEEP_CLUSTER"):
            cluster.down(self.name, quiet=True, purge=True)


def start_or_attach_simulated(external_kubeconfig: str | None, name: str) -> ClusterHandle:
    """A cluster of kwok nodes only (no real node, no images), for the scale benchmark's thousands
    of objects: the cluster named by ``external_kubeconfig``, or our own cluster ``name``."""
    if external_kubeconfig:
        path = Path(external_kubeconfig).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"kubeconfig {external_kubeconfig} is not a file")
        return ClusterHandle(kubeconfig=path, name=None)
    return ClusterHandle(kubeconfig=cluster.up(name, node_runtime="kwok"), name=name)


def start_api_server() -> ClusterHandle:
    """An API server alone (no controllers, no nodes) for this run: always our own, since the tests
    on it play the controllers themselves.  Named after WARMPOOL_TEST_CLUSTER (kept likewise)."""
    name = os.environ.get("WARMPOOL_TEST_CLUSTER", f"pytest-{os.getpid()}") + "-api"
    return ClusterHandle(kubeconfig=cluster.up(name, node_runtime="none"), name=name)


#: The taint of the test session's second real node: nothing is scheduled there unless it tolerates
#: this, so the suite's pods stay on node 0, where its helpers look (pod logs, /var/lib/warmpool),
#: and the tests that need another node name it.
SPARE_NODE_TAINT = {"key": "warmpool.dev/spare-node", "value": "true", "effect": "NoSchedule"}


def start_or_attach(external_kubeconfig: str | None, repo: Path, nodes: int = 1,
                    taint_further: bool = False) -> ClusterHandle:
    """Use the cluster named by WARMPOOL_KUBECONFIG, or start (or reuse, by WARMPOOL_TEST_CLUSTER) a
    cluster of ``nodes`` real nodes (or more, when it runs more) for this run with the checkout's images
    built and loaded into each; with ``taint_further`` every node but node 0 carries SPARE_NODE_TAINT."""
    if external_kubeconfig:
        path = Path(external_kubeconfig).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"WARMPOOL_KUBECONFIG={external_kubeconfig} is not a file")
        return ClusterHandle(kubeconfig=path, name=None)
    name = os.environ.get("WARMPOOL_TEST_CLUSTER", f"pytest-{os.getpid()}")
    # A running cluster with more real nodes than asked for (the suite's two, for a benchmark's
    # smoke test that needs one) is used as it is.
    kubeconfig = cluster.up(name, node_runtime="containerd", nodes=max(nodes, cluster.running_real_nodes(name) or 0))
    report = cluster.status(name)
    if taint_further:
        taint = f"{SPARE_NODE_TAINT['key']}={SPARE_NODE_TAINT['value']}:{SPARE_NODE_TAINT['effect']}"
        for further in report["nodes"][1:]:
            cluster.kubectl(name, "taint", "node", str(further["name"]), taint, "--overwrite")
    node_state = node.node_dir(cluster.state_dir(name))
    loaded = images.load(repo, node_state)
    for further in node.runtime_dirs(cluster.state_dir(name))[1:]:
        images.load(repo, further)
    return ClusterHandle(kubeconfig=kubeconfig, name=name,
                         node=RealNode(state=node_state, pod_cidr=str(report["node"]["podCIDR"])), images=loaded,
                         pod_cidrs=tuple(str(n["podCIDR"]) for n in report["nodes"]))
