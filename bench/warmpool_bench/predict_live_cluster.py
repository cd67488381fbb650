"""The live replay's cluster side: the local real-node cluster, the CRD and the operator of this checkout
as a subprocess (:mod:`.bench_cluster`, with ``--predict-step-seconds``), and one WarmModel per policy.

The predictive pool's history is seeded before prediction is switched on: the WarmModel is created
without ``spec.pool.predictive`` (no predictor runs), the ``<name>-history`` ConfigMap is written in the
operator's format, owned by the WarmModel (the operator loads only a history its WarmModel owns), and
only then is ``spec.pool.predictive`` patched in: the predictor it starts loads that history.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from warmpool_operator.io.history_store import CONFIGMAP_KEY_HISTORY, history_configmap_name, history_labels
from warmpool_operator.rules.forecast.history import History, dumps

from warmpool.contract.api import API_GROUP, API_GROUP_VERSION, API_VERSION, KIND, PLURAL
from warmpool.contract.pods import LABEL_MODEL
from warmpool_bench.bench_cluster import BenchCluster
from warmpool_bench.predict_live_pool import PoolWatch

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "warmmodels.warmpool.dev.yaml"
SETTLE_TIMEOUT_S = 120.0
#: The operator's scrape interval here: well under a step, so every step's count comes from several scrapes
#: (at the default 10 s, a 10 s step would often see one scrape, or none, and be held as missing).
SCRAPE_INTERVAL_S = 2


def _log(message: str) -> None:
    print(f"[bench predict --live] {message}", file=sys.stderr, flush=True)


class LiveCluster(BenchCluster):
    """Start with :meth:`start`, always :meth:`stop` (it deletes what this run made)."""

    def __init__(self, cluster_name: str | None, work: Path, step_s: int) -> None:
        super().__init__(cluster_name, work, f"bench-predict-live-{os.getpid()}",
                         ("--predict-step-seconds", str(step_s), "--scrape-interval", str(SCRAPE_INTERVAL_S)))

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
                         "ownerReferences": [{"apiVersion": API_GROUP_VERSION, "kind": KIND, "name": name,
                                              "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]},
            "data": {CONFIGMAP_KEY_HISTORY: dumps(history)},
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
