"""Some of kube-controller-manager's controllers, beside an API server that runs none (the
``api_server`` fixture): for a test that needs what one of them writes, and nothing else running."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from warmpool_devcluster import build
from warmpool_devcluster.testing import ClusterHandle

from tests.support.procs import free_port, stop


@contextlib.contextmanager
def controllers(cluster: ClusterHandle, names: Sequence[str], log: Path) -> Iterator[None]:
    """kube-controller-manager running only ``names`` (e.g. "clusterrole-aggregation-controller")
    against ``cluster`` until the block ends; its output in ``log``."""
    binary = build.ensure_binaries(["kube-controller-manager"])["kube-controller-manager"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(binary), "--kubeconfig", str(cluster.kubeconfig), "--leader-elect=false",
             f"--controllers={','.join(names)}", "--bind-address=127.0.0.1", f"--secure-port={free_port()}"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        stop(proc)
