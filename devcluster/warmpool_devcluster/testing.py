"""Test-facing handle on a cluster: ours (started per test session) or one given by kubeconfig."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from warmpool_devcluster import build, cluster


@dataclass
class ClusterHandle:
    kubeconfig: Path
    #: the local kubelet's work dir (pod logs); None for an external cluster
    work_dir: Path | None
    #: our own cluster's name, or None when attached to someone else's
    name: str | None

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
        return None if self.work_dir is None else self.work_dir / "pods" / namespace / pod

    def close(self) -> None:
        if self.name is not None and not os.environ.get("WARMPOOL_KEEP_CLUSTER"):
            cluster.down(self.name, quiet=True, purge=True)


def start_or_attach(external_kubeconfig: str | None) -> ClusterHandle:
    """Use the cluster named by WARMPOOL_KUBECONFIG, or start a private one for this run."""
    if external_kubeconfig:
        path = Path(external_kubeconfig).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"WARMPOOL_KUBECONFIG={external_kubeconfig} is not a file")
        return ClusterHandle(kubeconfig=path, work_dir=None, name=None)
    name = os.environ.get("WARMPOOL_TEST_CLUSTER", f"pytest-{os.getpid()}")
    kubeconfig = cluster.up(name)
    return ClusterHandle(kubeconfig=kubeconfig, work_dir=cluster.state_dir(name) / "kubelet", name=name)
