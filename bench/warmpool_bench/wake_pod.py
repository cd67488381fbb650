"""The ``new_pod`` variant of `warmpool bench wake`: a WarmModel scaled from zero pods to one.

The local control plane (started here, or ``--kubeconfig`` an existing one whose pods get
loopback IPs), the WarmModel CRD from ``crds/``, and the operator from this checkout as a
local subprocess (``warmpool operator -n NS``, scraping only 127.0.0.0/8).  One WarmModel per
model, ``replicas: 0``, with the same worker flags as the other variants.  A run:

1. the decision: the scale subresource patched to 1 (what ``kubectl scale``, an HPA or the
   operator's own scale-up writes); the clock starts just before it;
2. the pod appears, is bound and gets its loopback IP (polled through the API, 0.1 s);
3. its worker answers ``/readyz`` 200 on the pod IP (polled, 0.05 s), and the first completion
   is sent there straight away: the end is when it is answered.  This is the fastest a client
   could reach the pod; one behind a Service also waits for the kubelet's readiness probe,
   recorded as ``kubelet_ready_s``;
4. untimed: steady completions, then scaled back to 0 and waited until the pod is gone.

Only loopback is ever dialled: a pod IP outside 127.0.0.0/8 fails the run.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmpool.contract import API_GROUP, API_VERSION, DEFAULT_WORKER_PORT, LABEL_MODEL, PATH_READYZ, PLURAL
from warmpool_bench.coldstart import BenchModel
from warmpool_bench.stats import median, ratio

if TYPE_CHECKING:
    from warmpool_bench.wake_settings import WakeSettings

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "warmmodels.warmpool.dev.yaml"
POD_POLL_S = 0.1
READYZ_POLL_S = 0.05
#: Bounds on the untimed parts (setup, scale-down) of one run.
SETTLE_TIMEOUT_S = 180.0
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def _log(message: str) -> None:
    print(f"[bench wake] {message}", file=sys.stderr, flush=True)


def warmmodel_name(model: BenchModel) -> str:
    return f"wake-{model.name}"


def warmmodel_manifest(model: BenchModel, namespace: str, settings: WakeSettings) -> dict[str, Any]:
    """Zero pods of this model, with the worker flags every other variant runs with."""
    args = ["--device=cpu", f"--dtype={settings.dtype}", f"--prompts-per-bucket={settings.prompts_per_bucket}",
            f"--decode-tokens={settings.decode_tokens}"]
    if settings.threads is not None:
        args.append(f"--threads={settings.threads}")
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "WarmModel",
        "metadata": {"name": warmmodel_name(model), "namespace": namespace},
        "spec": {
            "model": {"hostPath": {"path": str(model.model_dir)}, "revision": "r1"},
            "pool": {"replicas": 0, "minWarm": 0, "maxReplicas": 1},
            "warmup": {"buckets": list(settings.buckets), "timeoutSeconds": int(max(1, settings.timeout_s))},
            "pod": {"workerArgs": args},
        },
    }


def _http(url: str, body: object | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    """GET, or a JSON POST; status 0 when nothing answers yet.  Loopback only."""
    host = urllib.parse.urlparse(url).hostname or ""
    if ipaddress.ip_address(host) not in LOOPBACK:
        raise RuntimeError(f"refusing to dial {host}: the bench talks to loopback only")
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
        self.work = work
        self.namespace = f"bench-wake-{os.getpid()}"
        self.cluster: Any = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.core: Any = None
        self.custom: Any = None
        self.applied: set[str] = set()

    def start(self, model_dirs: Sequence[Path]) -> None:
        from kubernetes import client, config
        from warmpool_devcluster.testing import start_or_attach

        self.work.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WARMPOOL_TEST_CLUSTER", f"bench-wake-{os.getpid()}")  # our own cluster's name
        kubeconfig = self.settings.kubeconfig
        self.cluster = start_or_attach(str(kubeconfig) if kubeconfig else None)
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=warmpool-bench",
                             "-f", str(CRD))
        self.cluster.kubectl("wait", "--for=condition=Established", "crd/warmmodels.warmpool.dev", "--timeout=60s")
        self.cluster.kubectl("create", "namespace", self.namespace)
        # The client's Python package is untyped where it matters here: its objects are handled as Any.
        api: Any = config.new_client_from_config(config_file=str(self.cluster.kubeconfig))  # type: ignore[no-untyped-call]
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        log = (self.work / "operator.log").open("ab")
        self.operator = subprocess.Popen(
            [sys.executable, "-m", "warmpool", "operator", "--namespace", self.namespace,
             "--scrape-network", "127.0.0.0/8", "--metrics-port", "0", "--liveness-port", "0", "--bind", "127.0.0.1",
             *(f"--allowed-host-path={d}" for d in model_dirs)],
            env={**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig), "PYTHONUNBUFFERED": "1"},
            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def _ensure(self, model: BenchModel) -> str:
        """The model's WarmModel at zero pods, reconciled (its Deployment exists); its name."""
        name = warmmodel_name(model)
        if name in self.applied:
            return name
        self.custom.create_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace, PLURAL,
                                                    warmmodel_manifest(model, self.namespace, self.settings))
        from kubernetes import client

        apps: Any = client.AppsV1Api(self.core.api_client)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.operator is not None and self.operator.poll() is not None:
                raise RuntimeError(f"the operator exited {self.operator.returncode}: {self.operator_log()}")
            found = apps.list_namespaced_deployment(self.namespace, label_selector=f"{LABEL_MODEL}={name}").items
            if found:
                self.applied.add(name)
                return name
            time.sleep(0.5)
        raise RuntimeError(f"WarmModel {name}: no Deployment after {SETTLE_TIMEOUT_S:g}s: {self.operator_log()}")

    def operator_log(self) -> str:
        path = self.work / "operator.log"
        return path.read_text(errors="replace")[-1500:] if path.exists() else ""

    def _pods(self, name: str) -> list[Any]:
        items = self.core.list_namespaced_pod(self.namespace, label_selector=f"{LABEL_MODEL}={name}").items
        return [p for p in items if p.metadata.deletion_timestamp is None]

    def _scale(self, name: str, replicas: int) -> None:
        self.custom.patch_namespaced_custom_object_scale(API_GROUP, API_VERSION, self.namespace, PLURAL, name,
                                                         {"spec": {"replicas": replicas}})

    def measure(self, model: BenchModel, prompt: list[int]) -> dict[str, Any]:
        name = self._ensure(model)
        self._wait_no_pods(name)
        run: dict[str, Any] = {}
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
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
            steady = []
            for _ in range(self.settings.steady):
                started = time.perf_counter()
                if _http(base + "/v1/completions", body, timeout=self.settings.timeout_s)[0] == 200:
                    steady.append(time.perf_counter() - started)
            run["steady_ttft_s"] = median(steady)
            run["first_over_steady"] = ratio(run["first_ttft_s"], run["steady_ttft_s"])
            return run
        finally:
            self._scale(name, 0)
            self._wait_no_pods(name)

    def _wait_no_pods(self, name: str) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            items = self.core.list_namespaced_pod(self.namespace, label_selector=f"{LABEL_MODEL}={name}").items
            if not items:
                return
            time.sleep(0.5)
        raise RuntimeError(f"WarmModel {name}: pods still there {SETTLE_TIMEOUT_S:g}s after scaling to 0")

    def stop(self) -> None:
        """Delete the WarmModels while the operator runs (it holds their finalizers), then the rest."""
        try:
            if self.custom is not None:
                for name in sorted(self.applied):
                    with contextlib.suppress(Exception):
                        self.custom.delete_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace,
                                                                    PLURAL, name)
                deadline = time.monotonic() + 60
                while self.applied and time.monotonic() < deadline:
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
