"""`warmpool bench zero`: scale to zero on the real node, against the floors measured in the same run.

One pool of the real small model (or a tiny random Llama with ``--model tiny``), the operator of
this checkout as a local process, the activator's two replicas from the operator's image:

* **from zero** (each round): the pool idles to zero, one streamed completion goes to the Service's
  ClusterIP; a pod watch records when the new pod was created and when it turned Ready (its cold
  start, the floor), and the client when the first token came.  Overhead = first token - request
  sent - cold start: the activator's hold, the operator's two reactions and the forward.
* **from sleep** (each round): the pool's pod sleeps instead (scale to zero far off); the request
  wakes it.  Floor: the worker's own wake seconds (its wake-duration histogram).
* **burst**: at zero, ``--burst`` requests at once, below each activator replica's maxHeldRequests:
  each must be answered (200); 429 and 503 refusals are counted apart from requests lost.
* **forward**: the pool warm, time to first token sent straight to the pod against the same request
  through an activator replica (which forwards at once when the pool has pods): the activator's cost
  per request while it holds.  And ``--forward-samples`` requests to the ClusterIP leave the
  activator's request counters unchanged: once a pod is warm it is out of the data path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmpool_devcluster import build

from warmpool.contract.api import API_GROUP_VERSION, KIND, PLURAL
from warmpool.contract.http import DEFAULT_WORKER_PORT
from warmpool.contract.metrics import METRIC_ACTIVATOR_REQUESTS, METRIC_SLEEP_LEVEL, METRIC_WAKE_DURATION
from warmpool.contract.pods import AWAKE_TRUE, LABEL_AWAKE, LABEL_MODEL
from warmpool.contract.zero import DEFAULT_ACTIVATOR_PORT
from warmpool_bench import zero_activator as activator
from warmpool_bench.bench_cluster import BenchCluster
from warmpool_bench.stats import percentile
from warmpool_bench.zero_report import MAX_HELD_PER_REPLICA, burst_outcome

POOL = "zero"
PROMPT = "The capital of France is"
#: afterIdleSeconds while the pool must stay warm (the start, the forwarding samples), then for the
#: rounds from zero.
WARM_IDLE_S = 3600
ZERO_IDLE_S = 5
#: Seconds a pod watch (kubectl) is given to start and list before the request it times is sent.
WATCH_START_S = 1.5


@dataclass
class ZeroSettings:
    rounds: int = 3
    burst: int = 50
    forward_samples: int = 30
    model: str = "smollm2"  # or "tiny"
    cluster: str | None = None
    work_dir: Path = field(default_factory=lambda: Path("/tmp/warmpool-bench-zero"))
    timeout_s: float = 600.0


def _say(message: str) -> None:
    print(f"[bench zero] {message}", file=sys.stderr, flush=True)


def _model_dir(settings: ZeroSettings) -> Path:
    if settings.model == "tiny":
        from warmpool_dev.testing_models import make_tiny_llama

        return make_tiny_llama(settings.work_dir / "tiny-llama", layers=4)
    from warmpool_dev.model_fetch import ensure_model

    return ensure_model()


def _manifest(model: Path, tiny: bool) -> dict[str, Any]:
    pod: dict[str, Any] = {"workerArgs": ["--device=cpu"]}
    if tiny:
        pod["workerArgs"] += ["--prompts-per-bucket=1", "--decode-tokens=2"]
    return {"apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": POOL},
            "spec": {"model": {"hostPath": {"path": str(model)}},
                     "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": 2,
                              "scaleToZero": {"afterIdleSeconds": WARM_IDLE_S, "holdTimeoutSeconds": 600,
                                              "maxHeldRequests": MAX_HELD_PER_REPLICA}},
                     "warmup": {"buckets": [16, 32], "timeoutSeconds": 300}, "pod": pod}}


def _post(url: str, stream: bool, host: str | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """One completion: status, seconds to the first body byte (the first token when streamed), to the end."""
    body = json.dumps({"model": POOL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": stream})
    headers = {"Content-Type": "application/json", **({"Host": host} if host else {})}
    request = urllib.request.Request(url + "/v1/completions", data=body.encode(), headers=headers)
    sent = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read(1)
            first = time.monotonic()
            response.read()
            done = time.monotonic()
            return {"status": response.status, "sent": sent, "first_s": first - sent, "total_s": done - sent}
    except urllib.error.HTTPError as error:
        return {"status": error.code, "sent": sent, "error": error.read().decode(errors="replace")[:300]}
    except (urllib.error.URLError, OSError) as error:
        return {"status": 0, "sent": sent, "error": str(error)[:300]}


class Run:
    def __init__(self, bench: BenchCluster, settings: ZeroSettings) -> None:
        self.bench, self.settings, self.ns = bench, settings, bench.namespace

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.bench.cluster.kubectl("-n", self.ns, *args, "-o", "json").stdout)

    def pods(self) -> list[dict[str, Any]]:
        return [p for p in self.kubectl_json("get", "pods", "-l", f"{LABEL_MODEL}={POOL}")["items"]
                if not p["metadata"].get("deletionTimestamp")]

    def wait(self, check: Any, what: str, timeout: float | None = None) -> Any:
        deadline = time.monotonic() + (timeout or self.settings.timeout_s)
        while time.monotonic() < deadline:
            self.bench.check_operator()
            value = check()
            if value:
                return value
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}; operator log: {self.bench.operator_log()}")

    def routed(self) -> tuple[list[str], list[str]]:
        """The addresses of the pool Service's two slices: (the pods', the activator's)."""
        slices = self.kubectl_json("get", "endpointslices", "-l", f"kubernetes.io/service-name={POOL}")["items"]
        listed = {s["metadata"]["name"]: sorted(a for e in s.get("endpoints") or [] for a in e["addresses"])
                  for s in slices}
        return listed.get(f"{POOL}-pods") or [], listed.get(f"{POOL}-activator") or []

    def at_zero(self) -> bool:
        deployment = self.kubectl_json("get", "deployment", POOL)
        pods, activators = self.routed()
        return (deployment["spec"]["replicas"] == 0 and not self.pods() and not pods
                and len(activators) == activator.REPLICAS)

    def warm_pod(self) -> dict[str, Any] | None:
        wm = self.kubectl_json("get", PLURAL, POOL)
        if (wm.get("status") or {}).get("warmReplicas", 0) < 1:
            return None
        awake = [p for p in self.pods() if (p["metadata"].get("labels") or {}).get(LABEL_AWAKE) == AWAKE_TRUE
                 and _ready(p)]
        return awake[0] if awake else None

    def service_url(self) -> tuple[str, str]:
        service = self.kubectl_json("get", "service", POOL)
        ip = service["spec"]["clusterIP"]
        return ip, f"http://{ip}:{service['spec']['ports'][0]['port']}"


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _watch_pod(run: Run, seen: dict[str, float]) -> subprocess.Popen[str]:
    """Record, by the monotonic clock at each watch event's arrival, when a pod of the pool first
    exists and first is Ready and awake: a ``kubectl get --watch`` (no polling lag, which at a
    kubectl call per poll was up to a few hundred milliseconds on each end of the cold start).
    Terminate the process to stop it."""
    binary = build.ensure_binaries(["kubectl"])["kubectl"]
    watch = subprocess.Popen(
        [str(binary), "--kubeconfig", str(run.bench.cluster.kubeconfig), "-n", run.ns, "get", "pods",
         "-l", f"{LABEL_MODEL}={POOL}", "--watch", "-o", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def read() -> None:
        assert watch.stdout is not None
        lines: list[str] = []
        for line in watch.stdout:  # one pretty-printed object per event, closed by "}" on its own line
            lines.append(line)
            if line.rstrip("\n") != "}":
                continue
            pod, lines = json.loads("".join(lines)), []
            if pod["metadata"].get("deletionTimestamp"):
                continue
            seen.setdefault("created", time.monotonic())
            if _ready(pod) and (pod["metadata"].get("labels") or {}).get(LABEL_AWAKE) == AWAKE_TRUE:
                seen.setdefault("ready", time.monotonic())

    threading.Thread(target=read, daemon=True).start()
    return watch


def _from_zero(run: Run, url: str) -> dict[str, Any]:
    run.wait(run.at_zero, "the pool at zero")
    seen: dict[str, float] = {}
    watch = _watch_pod(run, seen)
    time.sleep(WATCH_START_S)
    listed = dict(seen)
    answer = _post(url, stream=True)
    watch.terminate()
    watch.wait(timeout=10)
    if listed:
        return {"error": "a pod of the pool existed before the request", **answer}
    if answer["status"] != 200 or "created" not in seen or "ready" not in seen:
        return {"error": answer.get("error", "no pod seen"), **answer}
    cold = seen["ready"] - seen["created"]
    return {"first_token_s": answer["first_s"], "cold_start_s": cold,
            "to_pod_created_s": seen["created"] - answer["sent"], "overhead_s": answer["first_s"] - cold}


def _worker_metric(pod: dict[str, Any], name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://{pod['status']['podIP']}:{DEFAULT_WORKER_PORT}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def _wake_sum(pod: dict[str, Any]) -> float:
    return _worker_metric(pod, f"{METRIC_WAKE_DURATION}_sum")


def _from_sleep(run: Run, url: str) -> dict[str, Any]:
    def asleep() -> dict[str, Any] | None:
        # By the worker's own account: the pool's last pod sleeps still listed in the Service (it
        # wakes on the request itself), so its awake label says nothing here.
        pods = run.pods()
        return pods[0] if len(pods) == 1 and _worker_metric(pods[0], METRIC_SLEEP_LEVEL) else None

    pod = run.wait(asleep, "the pool's pod asleep")
    before = _wake_sum(pod)
    answer = _post(url, stream=True)
    if answer["status"] != 200:
        return {"error": answer.get("error"), **answer}
    wake = _wake_sum(pod) - before
    return {"first_token_s": answer["first_s"], "wake_s": wake, "overhead_s": answer["first_s"] - wake}


def _burst(run: Run, url: str) -> dict[str, Any]:
    run.wait(run.at_zero, "the pool at zero (burst)")
    with ThreadPoolExecutor(run.settings.burst) as pool:
        answers = list(pool.map(lambda _: _post(url, stream=False), range(run.settings.burst)))
    return {**burst_outcome([int(a["status"]) for a in answers], MAX_HELD_PER_REPLICA),
            "slowest_s": max((a.get("total_s", 0.0) for a in answers), default=0.0)}



def _activator_requests(run: Run) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for pod in run.kubectl_json("get", "pods", "-l", activator.SELECTOR)["items"]:
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:{activator.METRICS_PORT}/metrics",
                                    timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            total += sum(s.value for s in family.samples if s.name == METRIC_ACTIVATOR_REQUESTS
                         and s.labels.get("warmmodel") == POOL)
    return total


def _forward(run: Run, cluster_ip: str, url: str) -> dict[str, Any]:
    pod = run.wait(run.warm_pod, "a warm pod")
    direct = f"http://{pod['status']['podIP']}:{DEFAULT_WORKER_PORT}"
    via = [f"http://{p['status']['podIP']}:{DEFAULT_ACTIVATOR_PORT}"
           for p in run.kubectl_json("get", "pods", "-l", activator.SELECTOR)["items"]]
    run.wait(lambda: run.routed() == ([pod["status"]["podIP"]], []), "the Service switched to the pod")
    time.sleep(2)  # kube-proxy follows the switch back to the pod
    before = _activator_requests(run)
    for _ in range(run.settings.forward_samples):
        if _post(url, stream=True)["status"] != 200:
            raise RuntimeError("a request to the warm pool's ClusterIP failed")
    untouched = _activator_requests(run) == before
    pairs = []
    for i in range(run.settings.forward_samples):
        straight = _post(direct, stream=True)
        through = _post(via[i % len(via)], stream=True, host=cluster_ip)
        if straight["status"] == through["status"] == 200:
            pairs.append(through["first_s"] - straight["first_s"])
    return {"samples": len(pairs), "added_p50_s": percentile(pairs, 50), "added_p95_s": percentile(pairs, 95),
            "activator_untouched_when_warm": untouched}


def _figures(round_: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in round_.items() if k != "sent")


def run_zero(settings: ZeroSettings) -> dict[str, Any]:
    namespace = f"bench-zero-{os.getpid()}"
    bench = BenchCluster(settings.cluster, settings.work_dir, namespace,
                         operator_args=("--activator-service", f"{namespace}/{activator.NAME}",
                                        "--scrape-interval", "1"))
    result: dict[str, Any] = {"benchmark": "zero", "model": settings.model, "rounds": settings.rounds,
                              "from_zero": [], "from_sleep": []}
    try:
        published = bench.start([_model_dir(settings)])
        run = Run(bench, settings)
        for obj in activator.activator_objects(bench.cluster.images["operator"], namespace):
            bench.cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(obj))
        manifest = _manifest(next(iter(published.values())), settings.model == "tiny")
        bench.create(manifest)
        cluster_ip, url = run.wait(lambda: run.warm_pod() and run.service_url(), "the pool warm")
        _say("the pool is warm: forwarding samples (straight to the pod, and through an activator)")
        result["forward"] = _forward(run, cluster_ip, url)
        # Now the pool may idle to zero; until here it stayed warm, whenever the bench looked.
        patch = {"spec": {"pool": {"scaleToZero": {"afterIdleSeconds": ZERO_IDLE_S}}}}
        bench.cluster.kubectl("-n", namespace, "patch", f"{PLURAL}/{POOL}", "--type=merge", "-p", json.dumps(patch))
        for done in range(settings.rounds):
            _say(f"from zero, round {done + 1}/{settings.rounds}: waiting for the pool to idle to zero")
            result["from_zero"].append(_from_zero(run, url))
            _say(f"from zero, round {done + 1}: {_figures(result['from_zero'][-1])}")
        _say(f"a burst of {settings.burst} at zero")
        result["burst"] = _burst(run, url)
        # From sleep: the pod sleeps after 3 s idle; zero is an hour away.
        patch = {"spec": {"pool": {"sleep": {"afterIdleSeconds": 3, "minAwake": 0, "level": 1},
                                   "scaleToZero": {"afterIdleSeconds": 3600}}}}
        bench.cluster.kubectl("-n", namespace, "patch", f"{PLURAL}/{POOL}", "--type=merge", "-p", json.dumps(patch))
        for done in range(settings.rounds):
            _say(f"from sleep, round {done + 1}/{settings.rounds}: waiting for the pod to sleep")
            result["from_sleep"].append(_from_sleep(run, url))
            _say(f"from sleep, round {done + 1}: {_figures(result['from_sleep'][-1])}")
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:  # what was measured is kept
        result["error"] = str(error)[:2000]
    finally:
        bench.stop()
    return result
