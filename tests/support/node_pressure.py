"""Memory tiers and sleep decided per node, on two real nodes (the scene the two-node lifecycle test
runs between `bench nodes`' cache scene and its pool).

Two sleep-capable WarmModels of the tiny model (``minAwake`` 0, no idle timeout, so only memory
pressure can put a pod to sleep), each pinned to a node:

- ``pressed-1`` on node 1 measures its memory against a 1 MiB capacity (``--memory-capacity-bytes``,
  as the one-node sleep tests press a pod): node 1 is far past the paused threshold;
- ``calm-0`` on node 0 measures the machine's memory as it is.

Expected, from the operator's rules alone: node 1's pod at the paused tier and node 0's at full;
the idlest sleepable pod on the paused node put to sleep for memory pressure; node 0's pod awake
and serving.  A pool's node tier is taken from its own pods there, and the machine has one kernel,
so the pressure is the pod's stated capacity, not the node's memory (the README's "Several real
nodes").
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from warmpool.contract.api import API_GROUP, API_GROUP_VERSION, API_VERSION, KIND, PLURAL
from warmpool.contract.http import DEFAULT_WORKER_PORT, PATH_METRICS
from warmpool.contract.metrics import METRIC_SLEEP_LEVEL
from warmpool.contract.pods import ANNOTATION_TIER, AWAKE_TRUE, LABEL_AWAKE, LABEL_MODEL

NODE_0, NODE_1 = "warmpool-node-0", "warmpool-node-1"
PRESSED_CAPACITY = f"--memory-capacity-bytes={1 << 20}"
TIMEOUT_S = 240.0


def _manifest(name: str, model: Path, node: str, extra_args: list[str], sleep: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"hostPath": {"path": str(model)}},
        "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": 2},
        "warmup": {"buckets": [16], "timeoutSeconds": 120},
        "pod": {"workerArgs": ["--device=cpu", "--prompts-per-bucket=1", "--decode-tokens=2", *extra_args],
                "nodeSelector": {"kubernetes.io/hostname": node}, "drainSeconds": 0},
    }
    if sleep:
        spec["pool"]["sleep"] = {"minAwake": 0}
    return {"apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec}


class PressureScene:
    def __init__(self, bench: Any, model: Path) -> None:
        self.bench, self.model = bench, model

    def pod(self, name: str) -> dict[str, Any] | None:
        out = self.bench.cluster.kubectl("-n", self.bench.namespace, "get", "pods", "-l", f"{LABEL_MODEL}={name}",
                                         "-o", "json").stdout
        pods = [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]
        return pods[0] if len(pods) == 1 else None

    def wait(self, check: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            self.bench.check_operator()
            value = check()
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}; operator log: {self.bench.operator_log()}")

    def annotation(self, name: str) -> str | None:
        pod = self.pod(name)
        return None if pod is None else (pod["metadata"].get("annotations") or {}).get(ANNOTATION_TIER)

    def label(self, name: str) -> str | None:
        pod = self.pod(name)
        return None if pod is None else (pod["metadata"].get("labels") or {}).get(LABEL_AWAKE)

    def fetch(self, name: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
        pod = self.pod(name)
        assert pod is not None and pod["status"].get("podIP"), pod
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://{pod['status']['podIP']}:{DEFAULT_WORKER_PORT}{path}", data=data,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status), response.read().decode()

    def sleep_level(self, name: str) -> float | None:
        from tests.support.e2e import metric

        return metric(self.fetch(name, PATH_METRICS)[1], METRIC_SLEEP_LEVEL)

    def events(self, reason: str) -> list[str]:
        out = self.bench.cluster.kubectl("-n", self.bench.namespace, "get", "events", "--field-selector",
                                         f"reason={reason}", "-o", "json").stdout
        return [str(e.get("message", "")) for e in json.loads(out)["items"]]

    def remove(self, names: list[str]) -> None:
        for name in names:
            self.bench.custom.delete_namespaced_custom_object(API_GROUP, API_VERSION, self.bench.namespace,
                                                              PLURAL, name)
        self.wait(lambda: all(self.pod(n) is None for n in names), "the scene's pods gone")


def tiers_and_sleep_per_node(bench: Any, model: Path) -> dict[str, Any]:
    """The scene; returns what it saw (asserted on by the caller)."""
    scene = PressureScene(bench, model)
    names = ["pressed-1", "calm-0"]
    bench.create(_manifest("pressed-1", model, NODE_1, [PRESSED_CAPACITY], sleep=True))
    bench.create(_manifest("calm-0", model, NODE_0, [], sleep=True))
    try:
        scene.wait(lambda: scene.annotation("pressed-1") == "paused" and scene.annotation("calm-0") == "full",
                   "node 1's pod at the paused tier and node 0's at full")
        # (the label stays true on a pool's last pod, asleep or not, so requests reach it and wake it)
        scene.wait(lambda: (scene.sleep_level("pressed-1") or 0) > 0, "node 1's idle pod asleep")
        seen = {
            "tiers": {name: scene.annotation(name) for name in names},
            "nodes": {name: (scene.pod(name) or {}).get("spec", {}).get("nodeName") for name in names},
            "sleep_level": {name: scene.sleep_level(name) for name in names},
            "asleep_events": scene.events("PodAsleep"),
            "calm_0_answers": scene.fetch("calm-0", "/v1/completions", {
                "model": "calm-0", "prompt": "hello", "max_tokens": 2, "temperature": 0})[0],
            "calm_0_still_awake": scene.label("calm-0") == AWAKE_TRUE,
        }
    finally:
        scene.remove(names)
    return seen
