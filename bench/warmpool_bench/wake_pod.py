"""The ``new_pod`` variant of `warmpool bench wake`: a WarmModel scaled from zero pods to one.

The local real-node cluster with the checkout's images, the CRD and the operator as a local
subprocess (:mod:`.bench_cluster`; ``--cluster`` names a running one).  One WarmModel per model,
``replicas: 0``, with the same worker flags as the other variants.  A run:

1. the decision: the scale subresource patched to 1 (what ``kubectl scale``, an HPA or the
   operator's own scale-up writes); the clock starts just before it;
2. the pod appears, is bound and gets its IP on the node's bridge (polled through the API, 0.1 s);
3. its worker answers ``/readyz`` 200 on the pod IP (polled, 0.05 s), and the first completion
   is sent there straight away: the end is when it is answered.  This is the fastest a client
   could reach the pod; one behind a Service also waits for the kubelet's readiness probe,
   recorded as ``kubelet_ready_s``;
4. untimed: steady completions, then scaled back to 0 and waited until the pod is gone.

Only the node's pods are ever dialled (:mod:`.dialable`): any other address fails the run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmpool.contract.api import API_GROUP, API_GROUP_VERSION, API_VERSION, PLURAL
from warmpool.contract.http import DEFAULT_WORKER_PORT, PATH_METRICS, PATH_READYZ
from warmpool.contract.pods import LABEL_MODEL
from warmpool_bench.bench_cluster import BenchCluster
from warmpool_bench.coldstart import BenchModel, phase_timestamps
from warmpool_bench.dialable import check_dialable
from warmpool_bench.pod_start import PodWatch, RuntimeEvents, pod_instants, steps
from warmpool_bench.stats import median, ratio

if TYPE_CHECKING:
    from warmpool_bench.wake_settings import WakeSettings

POD_POLL_S = 0.1
READYZ_POLL_S = 0.05
#: Bounds on the untimed parts (setup, scale-down) of one run.
SETTLE_TIMEOUT_S = 180.0


def _log(message: str) -> None:
    print(f"[bench wake] {message}", file=sys.stderr, flush=True)


def warmmodel_name(model: BenchModel) -> str:
    return f"wake-{model.name}"


def warmmodel_manifest(model: BenchModel, namespace: str, settings: WakeSettings,
                       model_dir: Path | None = None) -> dict[str, Any]:
    """Zero pods of this model (mounted from ``model_dir``, where the node's pods read it), with the
    worker flags every other variant runs with."""
    args = ["--device=cpu", f"--dtype={settings.dtype}", f"--prompts-per-bucket={settings.prompts_per_bucket}",
            f"--decode-tokens={settings.decode_tokens}"]
    if settings.threads is not None:
        args.append(f"--threads={settings.threads}")
    return {
        "apiVersion": API_GROUP_VERSION,
        "kind": "WarmModel",
        "metadata": {"name": warmmodel_name(model), "namespace": namespace},
        "spec": {
            "model": {"hostPath": {"path": str(model_dir or model.model_dir)}, "revision": "r1"},
            "pool": {"replicas": 0, "minWarm": 0, "maxReplicas": 1},
            "warmup": {"buckets": list(settings.buckets), "timeoutSeconds": int(max(1, settings.timeout_s))},
            "pod": {"workerArgs": args},
        },
    }


def _http(url: str, body: object | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    """GET, or a JSON POST; status 0 when nothing answers yet.  The node's pods only."""
    check_dialable(urllib.parse.urlparse(url).hostname or "")
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def _pod_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


class NewPods:
    """The cluster, the operator and one zero-pod WarmModel per model; `measure` is one run."""

    def __init__(self, settings: WakeSettings, work: Path) -> None:
        self.settings = settings
        self.bench = BenchCluster(settings.cluster, work, f"bench-wake-{os.getpid()}")
        self.namespace = self.bench.namespace
        self.published: dict[Path, Path] = {}
        self.applied: set[str] = set()

    @property
    def core(self) -> Any:
        return self.bench.core

    def start(self, model_dirs: Sequence[Path]) -> None:
        self.published = self.bench.start(model_dirs)

    def _ensure(self, model: BenchModel) -> str:
        """The model's WarmModel at zero pods, reconciled (its Deployment exists); its name."""
        name = warmmodel_name(model)
        if name in self.applied:
            return name
        self.bench.create(warmmodel_manifest(model, self.namespace, self.settings,
                                             self.published.get(model.model_dir)))
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            self.bench.check_operator()
            found = self.bench.apps.list_namespaced_deployment(self.namespace,
                                                               label_selector=f"{LABEL_MODEL}={name}").items
            if found:
                self.applied.add(name)
                return name
            time.sleep(0.5)
        raise RuntimeError(f"WarmModel {name}: no Deployment after {SETTLE_TIMEOUT_S:g}s: {self.operator_log()}")

    def operator_log(self) -> str:
        return self.bench.operator_log()

    def _pods(self, name: str) -> list[Any]:
        items = self.core.list_namespaced_pod(self.namespace, label_selector=f"{LABEL_MODEL}={name}").items
        return [p for p in items if p.metadata.deletion_timestamp is None]

    def _scale(self, name: str, replicas: int) -> None:
        self.bench.custom.patch_namespaced_custom_object_scale(API_GROUP, API_VERSION, self.namespace, PLURAL, name,
                                                         {"spec": {"replicas": replicas}})

    def measure(self, model: BenchModel, prompt: list[int]) -> dict[str, Any]:
        name = self._ensure(model)
        self._wait_no_pods(name)
        run: dict[str, Any] = {}
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        watch, events = self._start_watchers(name)
        decision = time.time()
        t0 = time.perf_counter()
        self._scale(name, 1)
        run["scale_call_s"] = time.perf_counter() - t0
        try:
            deadline = time.monotonic() + self.settings.timeout_s
            pod: Any = None
            while time.monotonic() < deadline:
                pods = self._pods(name)
                if pods and "pod_created_s" not in run:
                    run["pod_created_s"] = time.perf_counter() - t0
                if pods and pods[0].status.pod_ip:
                    pod = pods[0]
                    run["pod_ip_s"] = time.perf_counter() - t0
                    break
                time.sleep(POD_POLL_S)
            if pod is None:
                return {**run, "error": f"no pod with an IP after {self.settings.timeout_s:g}s"}
            base = f"http://{pod.status.pod_ip}:{DEFAULT_WORKER_PORT}"
            while _http(base + PATH_READYZ, timeout=5)[0] != 200:
                if time.monotonic() > deadline:
                    return {**run, "error": f"the pod's worker not ready after {self.settings.timeout_s:g}s"}
                time.sleep(READYZ_POLL_S)
            run["readyz_s"] = time.perf_counter() - t0
            started = time.perf_counter()
            status, answer = _http(base + "/v1/completions", body, timeout=self.settings.timeout_s)
            if status != 200:
                return {**run, "error": f"completion on the new pod failed ({status}): {answer[:300]!r}"}
            run["first_ttft_s"] = time.perf_counter() - started
            run["decision_to_first_token_s"] = time.perf_counter() - t0
            run["pod"] = pod.metadata.name
            while time.monotonic() < deadline:  # what a client behind a Service would also wait for
                current = self.core.read_namespaced_pod(pod.metadata.name, self.namespace)
                if _pod_ready(current):
                    run["kubelet_ready_s"] = time.perf_counter() - t0
                    break
                time.sleep(POD_POLL_S)
            self._breakdown(run, decision, watch, events, base)
            steady = []
            for _ in range(self.settings.steady):
                started = time.perf_counter()
                if _http(base + "/v1/completions", body, timeout=self.settings.timeout_s)[0] == 200:
                    steady.append(time.perf_counter() - started)
            run["steady_ttft_s"] = median(steady)
            run["first_over_steady"] = ratio(run["first_ttft_s"], run["steady_ttft_s"])
            return run
        finally:
            watch.stop()
            if events is not None:
                events.stop()
            self._scale(name, 0)
            self._wait_no_pods(name)

    def _start_watchers(self, name: str) -> tuple[PodWatch, RuntimeEvents | None]:
        """The pod watch, and the node's containerd events where the cluster is our own real node."""
        watch = PodWatch(self.core, self.namespace, f"{LABEL_MODEL}={name}", self.settings.timeout_s)
        watch.start()
        node = self.bench.cluster.node
        events = None
        if node is not None:
            from warmpool_devcluster import node_containerd

            events = RuntimeEvents(node_containerd.CTR, node_containerd.socket_path(node.state))
            events.start()
        return watch, events

    def _breakdown(self, run: dict[str, Any], decision: float, watch: PodWatch, events: RuntimeEvents | None,
                   base: str) -> None:
        """The run's instants and steps (`pod_start`), once the pod is Ready."""
        deadline = time.monotonic() + 5  # the watch may trail the poll that saw Ready by an event
        while (seen := watch.first()) is None or seen.ready is None or seen.container_id is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        status, text = _http(base + PATH_METRICS, timeout=10)
        phases = phase_timestamps(text.decode(errors="replace")) if status == 200 else {}
        if seen is None:
            run["breakdown_error"] = "the watch saw no pod"
            return
        instants = pod_instants(decision, seen, events.stop() if events is not None else None, phases)
        run["instants"] = instants
        run["steps"] = steps(instants)

    def _wait_no_pods(self, name: str) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            items = self.core.list_namespaced_pod(self.namespace, label_selector=f"{LABEL_MODEL}={name}").items
            if not items:
                return
            time.sleep(0.5)
        raise RuntimeError(f"WarmModel {name}: pods still there {SETTLE_TIMEOUT_S:g}s after scaling to 0")

    def stop(self) -> None:
        self.bench.stop()
