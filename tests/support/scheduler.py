"""The real kube-scheduler beside an API server that runs none (the ``api_server`` fixture): for a
test of where pods land, with the Nodes the test made."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from warmpool_devcluster import build
from warmpool_devcluster.testing import ClusterHandle

from tests.support.procs import free_port, stop


@contextlib.contextmanager
def scheduler(cluster: ClusterHandle, log: Path) -> Iterator[None]:
    """kube-scheduler (its default profile) against ``cluster`` until the block ends; its output in ``log``."""
    binary = build.ensure_binaries(["kube-scheduler"])["kube-scheduler"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(binary), "--kubeconfig", str(cluster.kubeconfig), "--leader-elect=false",
             "--bind-address=127.0.0.1", f"--secure-port={free_port()}"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        stop(proc)
