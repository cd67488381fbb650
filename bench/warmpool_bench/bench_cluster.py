"""The cluster side shared by the benchmarks that run real worker pods (`bench wake`'s new-pod
variant, `bench predict --live`): the local real-node cluster (one of this run's own, or a running
one named by ``--cluster``) with the checkout's images, the WarmModel CRD, a namespace of the run's
own, the models published where the pods' UID can read them, and the operator of this checkout as
a local subprocess scraping only the real nodes' pod subnets.

``stop`` always deletes what the run made (WarmModels while the operator still holds their
finalizers, then the namespace) and stops the cluster if the run started it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from warmpool.contract.api import API_GROUP, API_VERSION, PLURAL

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "warmmodels.warmpool.dev.yaml"


class BenchCluster:
    """Start with :meth:`start`, always :meth:`stop`."""

    def __init__(self, cluster_name: str | None, work: Path, namespace: str, operator_args: Sequence[str] = (),
                 nodes: int = 1) -> None:
        self.cluster_name = cluster_name
        self.nodes = nodes
        self.work = work
        self.namespace = namespace
        self.operator_args = list(operator_args)
        self.cluster: Any = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.core: Any = None
        self.apps: Any = None
        self.custom: Any = None
        self.made: list[str] = []

    def start(self, model_dirs: Sequence[Path]) -> dict[Path, Path]:
        """Up (or attach), CRD, namespace, operator; each model dir -> where the pods mount it."""
        from kubernetes import client, config
        from warmpool_devcluster.node_files import publish
        from warmpool_devcluster.testing import start_or_attach

        self.work.mkdir(parents=True, exist_ok=True)
        if self.cluster_name:
            os.environ["WARMPOOL_TEST_CLUSTER"] = self.cluster_name
            os.environ["WARMPOOL_KEEP_CLUSTER"] = "1"  # someone else's: never stopped here
        else:
            os.environ.setdefault("WARMPOOL_TEST_CLUSTER", f"bench-{os.getpid()}")
        self.cluster = start_or_attach(None, REPO, self.nodes)
        published = {model: publish(model, f"bench-{model.name}") for model in model_dirs}
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=warmpool-bench",
                             "-f", str(CRD))
        self._wait_crd()
        self.cluster.kubectl("create", "namespace", self.namespace)
        # The client's Python package is untyped where it matters here: its objects are handled as Any.
        api: Any = config.new_client_from_config(config_file=str(self.cluster.kubeconfig))  # type: ignore[no-untyped-call]
        self.core, self.apps, self.custom = client.CoreV1Api(api), client.AppsV1Api(api), client.CustomObjectsApi(api)
        log = (self.work / "operator.log").open("ab")
        self.operator = subprocess.Popen(
            [sys.executable, "-m", "warmpool", "operator", "--namespace", self.namespace,
             *(f"--scrape-network={cidr}" for cidr in self.cluster.pod_cidrs), "--metrics-port", "0",
             "--health-port", "0",
             "--bind", "127.0.0.1", f"--worker-image={self.cluster.images['worker']}",
             *(f"--allowed-host-path={path}" for path in published.values()), *self.operator_args],
            env={**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig), "PYTHONUNBUFFERED": "1"},
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return published

    def _wait_crd(self) -> None:
        """Established, then served: a CRD created a moment ago has no status yet, and `kubectl wait` fails
        on that at once (seen on a fresh cluster) instead of waiting, so both are retried, bounded."""
        deadline = time.monotonic() + 60
        for args in (("wait", "--for=condition=Established", "crd/warmmodels.warmpool.dev", "--timeout=10s"),
                     ("get", PLURAL, "-A")):
            while self.cluster.kubectl(*args, check=False).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the WarmModel CRD not served 60s after it was applied (kubectl {args[0]})")
                time.sleep(0.5)

    def operator_log(self) -> str:
        path = self.work / "operator.log"
        return path.read_text(errors="replace")[-1500:] if path.exists() else ""

    def check_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is not None:
            raise RuntimeError(f"the operator exited {self.operator.returncode}: {self.operator_log()}")

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = self.custom.create_namespaced_custom_object(
            API_GROUP, API_VERSION, self.namespace, PLURAL, manifest)
        self.made.append(manifest["metadata"]["name"])
        return body

    def stop(self) -> None:
        """Delete the WarmModels while the operator runs (it holds their finalizers), then the rest."""
        try:
            if self.custom is not None:
                for name in self.made:
                    with contextlib.suppress(Exception):
                        self.custom.delete_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace,
                                                                    PLURAL, name)
                deadline = time.monotonic() + 60
                while self.made and time.monotonic() < deadline:
                    left = self.custom.list_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace,
                                                                     PLURAL)["items"]
                    if not left:
                        break
                    time.sleep(0.5)
        finally:
            if self.operator is not None and self.operator.poll() is None:
                self.operator.terminate()
                try:
                    self.operator.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.operator.kill()
                    self.operator.wait(timeout=30)
            if self.cluster is not None:
                self.cluster.kubectl("delete", "namespace", self.namespace, "--wait=false", check=False)
                self.cluster.close()
