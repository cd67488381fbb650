"""The live replay's cluster side: the local control plane, the CRD, the operator of this checkout as a
subprocess (``--predict-step-seconds``, scraping 127.0.0.0/8 only), and one WarmModel per policy, as
:mod:`.wake_pod` sets up `bench wake`'s new-pod variant.

The predictive pool's history is seeded before prediction is switched on: the WarmModel is created
without ``spec.pool.predictive`` (no predictor runs), the ``<name>-history`` ConfigMap is written in the
operator's format, owned by the WarmModel (the operator loads only a history its WarmModel owns), and
only then is ``spec.pool.predictive`` patched in: the predictor it starts loads that history.
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

from warmpool_operator.predict.history import History, dumps
from warmpool_operator.predict.store import history_configmap_name, history_labels

from warmpool import contract
from warmpool.contract import API_GROUP, API_VERSION, KIND, LABEL_MODEL, PLURAL
from warmpool_bench.predict_live_pool import PoolWatch

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "warmmodels.warmpool.dev.yaml"
SETTLE_TIMEOUT_S = 120.0
#: The operator's scrape interval here: well under a step, so every step's count comes from several scrapes
#: (at the default 10 s, a 10 s step would often see one scrape, or none, and be held as missing).
SCRAPE_INTERVAL_S = 2


def _log(message: str) -> None:
    print(f"[bench predict --live] {message}", file=sys.stderr, flush=True)


class LiveCluster:
    """Start with :meth:`start`, always :meth:`stop` (it deletes what this run made)."""

    def __init__(self, kubeconfig: Path | None, work: Path, step_s: int, model_dirs: Sequence[Path]) -> None:
        self.kubeconfig = kubeconfig
        self.work = work
        self.step_s = step_s
        self.model_dirs = list(model_dirs)
        self.namespace = f"bench-predict-live-{os.getpid()}"
        self.cluster: Any = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.core: Any = None
        self.custom: Any = None
        self.made: list[str] = []

    def start(self) -> None:
        from kubernetes import client, config
        from warmpool_devcluster.testing import start_or_attach

        self.work.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WARMPOOL_TEST_CLUSTER", f"bench-live-{os.getpid()}")  # our own cluster's name
        _log("starting the local control plane" if self.kubeconfig is None else f"using {self.kubeconfig}")
        self.cluster = start_or_attach(str(self.kubeconfig) if self.kubeconfig else None)
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=warmpool-bench",
                             "-f", str(CRD))
        self._wait_crd()
        self.cluster.kubectl("create", "namespace", self.namespace)
        # The client's Python package is untyped where it matters here: its objects are handled as Any.
        api: Any = config.new_client_from_config(config_file=str(self.cluster.kubeconfig))  # type: ignore[no-untyped-call]
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        log = (self.work / "operator.log").open("ab")
        self.operator = subprocess.Popen(
            [sys.executable, "-m", "warmpool", "operator", "--namespace", self.namespace,
             "--scrape-network", "127.0.0.0/8", "--metrics-port", "0", "--liveness-port", "0", "--bind", "127.0.0.1",
             "--predict-step-seconds", str(self.step_s), "--scrape-interval", str(SCRAPE_INTERVAL_S),
             *(f"--allowed-host-path={d}" for d in self.model_dirs)],
            env={**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig), "PYTHONUNBUFFERED": "1"},
            stdout=log, stderr=subprocess.STDOUT)
        log.close()

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
        name = manifest["metadata"]["name"]
        body: dict[str, Any] = self.custom.create_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace,
                                                                           PLURAL, manifest)
        self.made.append(name)
        return body

    def wait_warm(self, watch: PoolWatch, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(watch.warm_pods()) < count:
            self.check_operator()
            if time.monotonic() > deadline:
                raise RuntimeError(f"WarmModel {watch.name}: {len(watch.warm_pods())} of {count} pods warm after "
                                   f"{timeout_s:g}s (watch errors {watch.errors[-3:]}): {self.operator_log()}")
            time.sleep(0.5)

    def seed_history(self, owner: dict[str, Any], history: History) -> None:
        """Write ``<name>-history`` as the operator's store does, owned by the WarmModel."""
        meta = owner["metadata"]
        name = meta["name"]
        configmap = {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": history_configmap_name(name), "namespace": self.namespace,
                         "labels": history_labels(name),
                         "ownerReferences": [{"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": name,
                                              "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]},
            "data": {contract.CONFIGMAP_KEY_HISTORY: dumps(history)},
        }
        self.core.create_namespaced_config_map(self.namespace, configmap, _request_timeout=10)

    def enable_predictive(self, name: str, predictive: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace, PLURAL, name,
                                                   {"spec": {"pool": {"predictive": predictive}}})

    def delete(self, name: str) -> None:
        """Delete the WarmModel (while the operator runs: it holds the finalizer) and wait for its pods to go,
        so the next policy does not share the CPUs with them."""
        with contextlib.suppress(Exception):
            self.custom.delete_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace, PLURAL, name)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            items = self.core.list_namespaced_pod(self.namespace, label_selector=f"{LABEL_MODEL}={name}",
                                                  _request_timeout=10).items
            if not items:
                return
            time.sleep(0.5)
        _log(f"WarmModel {name}: pods still there {SETTLE_TIMEOUT_S:g}s after its deletion")

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
