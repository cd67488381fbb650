"""Scale to zero across two real nodes (a scene of the two-node lifecycle test): the activator on node 0
holds a request for a pool at zero whose pod can only run on node 1, and forwards it there.

The activator is the one `bench zero` and the one-node e2e test run (bench/warmpool_bench/zero_activator.py,
as the chart runs it), one replica pinned to node 0; the operator is the bench's local process, given
``--activator-service``.  The request goes to the pool's ClusterIP from this machine (the host's
kube-proxy sends it to the activator's pod, the pool's only endpoint at zero).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from warmpool_bench import zero_activator as activator

from warmpool.contract.api import API_GROUP, API_GROUP_VERSION, API_VERSION, KIND, PLURAL
from warmpool.contract.metrics import METRIC_ACTIVATOR_REQUESTS
from warmpool.contract.pods import LABEL_MODEL

NODE_0, NODE_1 = "warmpool-node-0", "warmpool-node-1"
POOL = "zero"
TIMEOUT_S = 240.0


def activator_service(namespace: str) -> str:
    """The operator's ``--activator-service`` value for the scene's activator."""
    return f"{namespace}/{activator.NAME}"


def _objects(image: str, namespace: str) -> list[dict[str, Any]]:
    objects = activator.activator_objects(image, namespace, drain_seconds=0)
    for obj in objects:
        if obj["kind"] == "Deployment":
            obj["spec"]["replicas"] = 1
            obj["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": NODE_0}
    return objects


def _manifest(model: Path) -> dict[str, Any]:
    return {"apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": POOL}, "spec": {
        "model": {"hostPath": {"path": str(model)}},
        "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": 2,
                 "scaleToZero": {"afterIdleSeconds": 3, "holdTimeoutSeconds": 180}},
        "warmup": {"buckets": [16], "timeoutSeconds": 120},
        "pod": {"workerArgs": ["--device=cpu", "--prompts-per-bucket=1", "--decode-tokens=2"],
                "nodeSelector": {"kubernetes.io/hostname": NODE_1}, "drainSeconds": 0}}}


class ActivatorScene:
    def __init__(self, bench: Any) -> None:
        self.bench, self.ns = bench, bench.namespace

    def get(self, *args: str) -> Any:
        return json.loads(self.bench.cluster.kubectl("-n", self.ns, "get", *args, "-o", "json").stdout)

    def wait(self, check: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            self.bench.check_operator()
            value = check()
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}; operator log: {self.bench.operator_log()}")

    def activator_pods(self) -> list[dict[str, Any]]:
        return list(self.get("pods", "-l", activator.SELECTOR)["items"])

    def pool_pods(self) -> list[dict[str, Any]]:
        return [p for p in self.get("pods", "-l", f"{LABEL_MODEL}={POOL}")["items"]
                if not p["metadata"].get("deletionTimestamp")]

    def at_zero(self) -> bool:
        return bool(self.get("deployment", POOL)["spec"]["replicas"] == 0 and not self.pool_pods())

    def forwarded(self, pod: dict[str, Any]) -> float:
        from tests.support.e2e import metric

        url = f"http://{pod['status']['podIP']}:{activator.METRICS_PORT}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return metric(text, METRIC_ACTIVATOR_REQUESTS, namespace=self.ns, warmmodel=POOL, outcome="forwarded") or 0.0


def _post(url: str) -> tuple[int, str]:
    body = json.dumps({"model": POOL, "prompt": "hello", "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as error:
        return 0, str(error)


def held_and_forwarded_across_nodes(bench: Any, model: Path) -> dict[str, Any]:
    """The scene; returns what it saw (asserted on by the caller)."""
    from warmpool_devcluster.node_network import guarded_service_address

    scene = ActivatorScene(bench)
    objects = _objects(bench.cluster.images["operator"], scene.ns)
    bench.cluster.kubectl("-n", scene.ns, "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                                "items": objects}))
    bench.create(_manifest(model))
    try:
        (holder,) = scene.wait(lambda: [p for p in scene.activator_pods() if p["status"].get("podIP")
                                        and all(c["ready"] for c in p["status"].get("containerStatuses") or [{}])],
                               "the activator Ready")
        scene.wait(scene.at_zero, "the pool idle at zero")
        service = scene.get("service", POOL)
        ip, port = service["spec"]["clusterIP"], service["spec"]["ports"][0]["port"]
        assert guarded_service_address(ip), ip
        status, text = _post(f"http://{ip}:{port}")
        (served_by,) = scene.pool_pods()
        return {"status": status, "answer": text[:300], "activator_node": holder["spec"]["nodeName"],
                "pool_pod_node": served_by["spec"]["nodeName"], "forwarded": scene.forwarded(holder)}
    finally:
        bench.custom.delete_namespaced_custom_object(API_GROUP, API_VERSION, scene.ns, PLURAL, POOL)
        scene.wait(lambda: not scene.pool_pods(), "the pool's pods gone")
        bench.cluster.kubectl("-n", scene.ns, "delete", "-f", "-", "--wait=false", check=False,
                              input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
