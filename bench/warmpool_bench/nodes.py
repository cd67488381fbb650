"""`warmpool bench nodes`: warm capacity through a drain and through a node's death, on two real nodes.

First, with no other cluster up, **up**: `cluster up --nodes 1` and `--nodes 2` side by side, fresh
clusters of their own each taken down after, ``--up-rounds`` of each, alternating (target: the
ratio of the medians <= 1.5).

Then the run's own two-node cluster (`cluster up --nodes 2`; ``--cluster`` names a running one), the
checkout's images on both nodes, and three scenes.  First **cache** (nodes_cache.py, with a chart
install and a pool of its own): the chart's node agents fill each node's own cache from SeaweedFS,
new pods land where the revision is cached, and a cached start is set against an uncached one.
Then the operator of this checkout as a local process scraping both nodes' pod subnets, and one
pool of the real small model (``--model tiny``: a tiny random Llama), ``minWarm`` 2, its pods
placed for each scene by cordoning a node while they start:

* **drain**: the pool's two pods warm on node 1; a client sends one completion at a time through
  the pool Service's ClusterIP (the host's kube-proxy sends each to a pod on either node), while
  `kubectl drain warmpool-node-1` runs.  Recorded: whether the drain completed and its seconds,
  the fewest Ready pods the Service had (sampled every 0.2 s), requests sent and failed (target:
  never below minWarm, none failed).
* **partition**: one warm pod on each node, then node 1's link down (every process alive, as a
  switch port or a cable fails) until minWarm pods are Ready on node 0, then up again.  Recorded:
  cut -> warm on node 0, and healed -> the pool back at minWarm pods, all Ready (the surplus
  scaled down, coldest first), with the pods before and after.
* **node death**: the pool's pods warm one on each node (``--death-placement spread``, where the
  scheduler puts them by itself) or both on node 1 (``packed``); then node 1's kubelet, containerd,
  kube-proxy, NetworkPolicy enforcer, container shims and every pod process are SIGKILLed at once
  and its link taken down, the way a machine that loses power vanishes.  Recorded: death ->
  minWarm pods Ready on node 0, and the replacements' own cold start (created -> Ready, from the
  API's timestamps), the floor (target: death -> warm <= cold start + 5 s).  Spread, node 0's pod
  answering is the witness that lets the operator judge node 1 by its pods' failed scrapes
  (rules/node_answers.py); packed, only node 1's Lease tells.  Node 1 stays dead; a ``--cluster``
  one must be taken down after.

Only loopback, the nodes' pods and the pool's ClusterIP are ever dialled.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmpool.contract.api import API_GROUP_VERSION, KIND
from warmpool.contract.pods import LABEL_MODEL
from warmpool_bench.bench_cluster import BenchCluster
from warmpool_bench.nodes_cache import cache_scene
from warmpool_bench.stats import median, ratio

POOL = "nodes"
MIN_WARM = 2
PROMPT = "The capital of France is"
NODE_0, NODE_1 = "warmpool-node-0", "warmpool-node-1"
SAMPLE_S = 0.2
#: The client's bound during the drain: requests and seconds.
MAX_REQUESTS, CLIENT_TIMEOUT_S = 2000, 600.0


@dataclass
class NodesSettings:
    up_rounds: int = 2
    model: str = "smollm2"  # or "tiny"
    #: the pool when node 1 dies: one pod on each node ("spread", as the scheduler places them), or
    #: both on node 1 ("packed": no pod of ours answers elsewhere, so only node 1's Lease tells)
    death_placement: str = "spread"
    cluster: str | None = None
    work_dir: Path = field(default_factory=lambda: Path("/tmp/warmpool-bench-nodes"))
    timeout_s: float = 600.0


def _say(message: str) -> None:
    print(f"[bench nodes] {message}", file=sys.stderr, flush=True)


def measure_up(rounds: int) -> dict[str, Any]:
    """Seconds of `cluster up --nodes 1` and `--nodes 2`, alternating, each on a fresh cluster."""
    from warmpool_devcluster import cluster

    seconds: dict[str, list[float]] = {"1": [], "2": []}
    for round_index in range(rounds):
        for nodes in (1, 2):
            name = f"bench-up-{os.getpid()}-{nodes}"
            started = time.monotonic()
            try:
                cluster.up(name, node_runtime="containerd", nodes=nodes)
                seconds[str(nodes)].append(time.monotonic() - started)
            finally:
                problems = cluster.down(name, quiet=True, purge=True)
            if problems:
                raise RuntimeError(f"`cluster down` of {name} left {problems}")
            _say(f"up round {round_index + 1}: --nodes {nodes} in {seconds[str(nodes)][-1]:.1f}s")
    return {"seconds": seconds, "ratio": ratio(median(seconds["2"]), median(seconds["1"]))}


def _model_dir(settings: NodesSettings) -> Path:
    if settings.model == "tiny":
        from warmpool_dev.testing_models import make_tiny_llama

        return make_tiny_llama(settings.work_dir / "tiny-llama", layers=4)
    from warmpool_dev.model_fetch import ensure_model

    return ensure_model()


def _manifest(model: Path, tiny: bool) -> dict[str, Any]:
    args = ["--device=cpu", *(["--prompts-per-bucket=1", "--decode-tokens=2"] if tiny else [])]
    return {"apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": POOL},
            "spec": {"model": {"hostPath": {"path": str(model)}},
                     "pool": {"replicas": MIN_WARM, "minWarm": MIN_WARM, "maxReplicas": 2 * MIN_WARM},
                     "warmup": {"buckets": [16, 32], "timeoutSeconds": 300}, "pod": {"workerArgs": args}}}


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


class Scene:
    """The pool on the two-node cluster, and what the scenes ask of it."""

    def __init__(self, bench: BenchCluster, settings: NodesSettings) -> None:
        self.bench, self.settings, self.ns = bench, settings, bench.namespace

    def kubectl(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        proc: subprocess.CompletedProcess[str] = self.bench.cluster.kubectl(*args, timeout=timeout)
        return proc

    def pods(self) -> list[dict[str, Any]]:
        out = self.kubectl("-n", self.ns, "get", "pods", "-l", f"{LABEL_MODEL}={POOL}", "-o", "json").stdout
        return list(json.loads(out)["items"])

    def serving(self, node: str | None = None) -> list[dict[str, Any]]:
        """The pool's Ready pods that are not terminating (what the Service routes to), on ``node``."""
        return [p for p in self.pods() if _ready(p) and not p["metadata"].get("deletionTimestamp")
                and (node is None or p["spec"].get("nodeName") == node)]

    def wait(self, check: Any, what: str) -> Any:
        deadline = time.monotonic() + self.settings.timeout_s
        while time.monotonic() < deadline:
            self.bench.check_operator()
            value = check()
            if value:
                return value
            time.sleep(SAMPLE_S)
        raise RuntimeError(f"timed out waiting for {what}; operator log: {self.bench.operator_log()}")

    def warm_on_node_1(self) -> None:
        """The pool's MIN_WARM pods Ready on node 1, and no other pod of it anywhere."""
        self.kubectl("uncordon", NODE_1)
        self.kubectl("cordon", NODE_0)
        try:
            for pod in self.pods():
                if pod["spec"].get("nodeName") != NODE_1:
                    self.kubectl("-n", self.ns, "delete", "pod", pod["metadata"]["name"], "--wait=false")
            self.wait(lambda: len(self.serving(NODE_1)) >= MIN_WARM, f"{MIN_WARM} Ready pods on {NODE_1}")
        finally:
            self.kubectl("uncordon", NODE_0)
        self.wait(lambda: len(self.pods()) == MIN_WARM and len(self.serving(NODE_1)) == MIN_WARM,
                  f"the pool at {MIN_WARM} pods, all on {NODE_1}")

    def warm_spread(self) -> None:
        """The pool's two pods Ready, one on each node (where the scheduler spreads them by itself)."""
        self.kubectl("uncordon", NODE_0)
        self.kubectl("uncordon", NODE_1)

        def spread() -> bool:
            nodes = [p["spec"].get("nodeName") for p in self.serving()]
            return len(self.pods()) == MIN_WARM and sorted(nodes) == [NODE_0, NODE_1]

        if not spread():
            crowded = NODE_0 if [p["spec"].get("nodeName") for p in self.pods()].count(NODE_0) > 1 else NODE_1
            other = NODE_1 if crowded == NODE_0 else NODE_0
            self.kubectl("cordon", crowded)
            try:
                moved = next(p for p in self.pods() if p["spec"].get("nodeName") == crowded)
                self.kubectl("-n", self.ns, "delete", "pod", moved["metadata"]["name"], "--wait=false")
                self.wait(lambda: self.serving(other), f"a Ready pod on {other}")
            finally:
                self.kubectl("uncordon", crowded)
        self.wait(spread, "the pool at one Ready pod on each node")

    def service_url(self) -> str:
        service = json.loads(self.kubectl("-n", self.ns, "get", "service", POOL, "-o", "json").stdout)
        ip = service["spec"]["clusterIP"]
        _check_service_address(ip)
        return f"http://{ip}:{service['spec']['ports'][0]['port']}"


def _check_service_address(ip: str) -> None:
    from warmpool_devcluster.node_network import guarded_service_address

    if not guarded_service_address(ip):
        raise RuntimeError(f"refusing to dial {ip}: not a ClusterIP behind a dev cluster's guard")


def _completion(url: str) -> int:
    body = json.dumps({"model": POOL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, OSError):
        return 0


def drain(scene: Scene) -> dict[str, Any]:
    """`kubectl drain` of node 1 with the pool warm there, a client on the Service throughout."""
    scene.warm_on_node_1()
    url = scene.service_url()
    statuses: list[int] = []
    stop = threading.Event()

    def client() -> None:
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while not stop.is_set() and len(statuses) < MAX_REQUESTS and time.monotonic() < deadline:
            statuses.append(_completion(url))

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    fewest = MIN_WARM
    started = time.monotonic()
    drainer = subprocess.Popen(_kubectl_argv(scene, "drain", NODE_1, "--ignore-daemonsets", "--delete-emptydir-data",
                                             "--timeout=300s"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    while drainer.poll() is None:
        fewest = min(fewest, len(scene.serving()))
        time.sleep(SAMPLE_S)
    seconds = time.monotonic() - started
    fewest = min(fewest, len(scene.serving()))
    time.sleep(2.0)  # requests after the last eviction, through the Service's new endpoints
    stop.set()
    thread.join(timeout=60)
    output = drainer.stdout.read() if drainer.stdout else ""
    scene.kubectl("uncordon", NODE_1)
    failed = [s for s in statuses if s != 200]
    return {"completed": drainer.returncode == 0, "seconds": seconds, "fewest_serving": fewest,
            "min_warm": MIN_WARM, "requests": len(statuses), "failed": len(failed),
            "failed_statuses": sorted(set(failed)), "drain_output": output[-1500:]}


def _kubectl_argv(scene: Scene, *args: str) -> list[str]:
    from warmpool_devcluster import build

    binary = build.ensure_binaries(["kubectl"])["kubectl"]
    return [str(binary), "--kubeconfig", str(scene.bench.cluster.kubeconfig), *args]


def _node_1(cluster_name: str) -> Any:
    """Node 1's state (node_namespaced.NamespacedNode) and the cluster's state directory."""
    from warmpool_devcluster import cluster, node

    root = cluster.state_dir(cluster_name)
    return node.NodeState.from_json(json.loads((root / "cluster.json").read_text())["node"]).extra[0], root


def _node_1_link(cluster_name: str, state: str) -> None:
    further, _ = _node_1(cluster_name)
    subprocess.run(["ip", "link", "set", further.host_link, state], check=True, timeout=30)


def partition(scene: Scene, cluster_name: str) -> dict[str, Any]:
    """Node 1 cut off (its link down, every process alive) with one warm pod on each node, then
    back: seconds until MIN_WARM pods are Ready on node 0, then, once the link is up, until the
    pool is back at MIN_WARM pods, all Ready (the surplus scaled down, coldest first)."""
    scene.warm_spread()
    before = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in scene.pods()}
    _node_1_link(cluster_name, "down")
    cut = time.monotonic()
    try:
        scene.wait(lambda: len(scene.serving(NODE_0)) >= MIN_WARM, f"{MIN_WARM} Ready pods on {NODE_0}")
        warm_s = time.monotonic() - cut
    finally:
        _node_1_link(cluster_name, "up")
    healed = time.monotonic()
    scene.wait(lambda: len(scene.pods()) == MIN_WARM and len(scene.serving()) == MIN_WARM,
               f"the pool back at {MIN_WARM} Ready pods once {NODE_1} answers again")
    after = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in scene.pods()}
    return {"cut_to_warm_s": warm_s, "healed_to_min_warm_s": time.monotonic() - healed,
            "pods_before": before, "pods_after": after}


def kill_node_1(cluster_name: str) -> list[str]:
    """SIGKILL every process of node 1 but its namespace holder, and take its link down."""
    from warmpool_devcluster import node_cleanup, node_containerd, node_namespaced

    further, root = _node_1(cluster_name)
    killed = []
    for name in node_namespaced.PROCESSES:
        pid = further.pids.get(name)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(name)
    node_cleanup.kill_shims(node_containerd.socket_path(further.base(root)))
    node_cleanup.kill_pod_processes(parent=further.cgroup_parent)
    _node_1_link(cluster_name, "down")
    return killed


def node_death(scene: Scene, cluster_name: str) -> dict[str, Any]:
    """Node 1 dies with the pool warm on it (both pods there with ``placement`` "packed", one on each
    node with "spread"): seconds until MIN_WARM pods are Ready on node 0."""
    if scene.settings.death_placement == "packed":
        scene.warm_on_node_1()
    else:
        scene.warm_spread()
    before = {p["metadata"]["uid"] for p in scene.pods()}
    killed = kill_node_1(cluster_name)
    died = time.monotonic()
    died_wall = time.time()
    scene.wait(lambda: len(scene.serving(NODE_0)) >= MIN_WARM, f"{MIN_WARM} Ready pods on {NODE_0}")
    seconds = time.monotonic() - died
    cold = [_cold_start_s(p) for p in scene.serving(NODE_0) if p["metadata"]["uid"] not in before]
    first_created = min((_created(p) for p in scene.pods() if p["metadata"]["uid"] not in before), default=died_wall)
    cold_start = max(cold) if cold else None
    return {"placement": scene.settings.death_placement, "killed": killed, "death_to_warm_s": seconds,
            "replacements": len(cold), "replacement_cold_start_s": cold_start,
            "first_replacement_created_after_s": max(0.0, first_created - died_wall),
            "over_cold_start_s": None if cold_start is None else seconds - cold_start}


def _created(pod: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(pod["metadata"]["creationTimestamp"].replace("Z", "+00:00")).timestamp()


def _cold_start_s(pod: dict[str, Any]) -> float:
    """Created -> Ready, from the API's own timestamps (whole seconds)."""
    from datetime import datetime

    ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    return datetime.fromisoformat(ready["lastTransitionTime"].replace("Z", "+00:00")).timestamp() - _created(pod)


def run_scenes(bench: BenchCluster, settings: NodesSettings, model: Path,
               more: Callable[[BenchCluster, Path], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The cluster and the operator (``bench`` started here); the cache scene (nodes_cache.py, a chart
    and pool of its own, removed after); ``more`` (given the model's path as the pods see it, its
    figures under "more"); the pool, then the drain and the node's death: each scene's figures.  The
    caller stops ``bench``."""
    published = bench.start([model])
    figures: dict[str, Any] = {"cache": cache_scene(bench, settings, model)}
    if more is not None:
        figures["more"] = more(bench, published[model])
    scene = Scene(bench, settings)
    bench.create(_manifest(published[model], settings.model == "tiny") | {
        "metadata": {"name": POOL, "namespace": bench.namespace}})
    figures["drain"] = drain(scene)
    _say(f"drain: {json.dumps({k: v for k, v in figures['drain'].items() if k != 'drain_output'})}")
    figures["partition"] = partition(scene, bench.cluster.name)
    _say(f"partition: {json.dumps(figures['partition'])}")
    figures["node_death"] = node_death(scene, bench.cluster.name)
    _say(f"node death: {json.dumps(figures['node_death'])}")
    return figures


def run_nodes(settings: NodesSettings) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "nodes", "settings": {
        "up_rounds": settings.up_rounds, "model": settings.model, "min_warm": MIN_WARM,
        "death_placement": settings.death_placement}}
    if settings.up_rounds and settings.cluster:
        result["up"] = {"skipped": "--cluster given: `cluster up` is measured only with no other cluster up"}
    elif settings.up_rounds:
        result["up"] = measure_up(settings.up_rounds)
    bench = BenchCluster(settings.cluster, settings.work_dir, f"bench-nodes-{os.getpid()}", nodes=2)
    try:
        result |= run_scenes(bench, settings, _model_dir(settings))
    except (RuntimeError, subprocess.SubprocessError, OSError) as error:
        result["error"] = str(error)[-2000:]
    finally:
        bench.stop()
    return result
