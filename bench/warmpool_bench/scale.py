"""`warmpool bench scale`: the operator with N WarmModels on the local control plane.

Each WarmModel asks for one worker pod, pinned by a nodeSelector to fake nodes of our own
(``bench-kwok-*``) that kwok manages, in a cluster of kwok nodes only (no real node): kwok
binds the pods and gives them loopback IPs, nothing runs in them, so their metrics
endpoints are absent (a scrape is refused at once, and the pod is Unknown, never 0 % used).
``minWarm: 0`` makes a WarmModel Ready once reconciled, which is what is timed: the
operator's own cost per object, not a worker's start.

For each N (doubling, e.g. 50/100/200): first the floor (``scale_floor``: the same WarmModels and
the children the operator would make, applied by one process over a pooled client at a
concurrency tuned to the server in this run), then a fresh namespace and a fresh operator process
(`warmpool operator -n NS`, scraping only 127.0.0.0/8), N WarmModels created by the same pooled
client, then poll until all are Ready (bounded in time, progress every 10 s).  Measured: apply -> all
Ready, reconcile latency p50/p95 and the timer pass (scrape cycle) p50/p95 from the
operator's own histogram, operator CPU seconds (utime+stime from /proc) and RSS.

Memory per WarmModel: the operator's RSS idle at N above its RSS before the first WarmModel.

A restart over the N (the backlog): the operator is stopped and a fresh one started; it lists all
N and passes over each (kopf's resume).  Once its first pass is counted, LATE_COUNT WarmModels are
created one by one, and each one's first pass is timed (create -> status Ready, through a watch):
what a user creating a WarmModel meets while the operator works through a backlog.  The backlog's
own time is start -> every listed WarmModel's pass counted (the operator's histogram).

Status lag after a pod's Ready event: nothing runs on the bench nodes, so the bench plays the
kubelet for a sample of pods.  It patches each pod's status to Ready (one every
``LAG_SPACING_S``, so each is a lone event, not a burst) and times, through a watch on the
WarmModels, until that WarmModel's ``status.readyReplicas`` says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from warmpool_bench.stats import growth

NODE_PREFIX = "bench-kwok-"
BENCH_LABEL = "warmpool.dev/bench"
BENCH_NODES = 4
PODS_PER_NODE = "250"
HOST = "127.0.0.1"
#: Pods the status-lag measurement turns Ready (a sample: the figure is a per-event latency).
LAG_SAMPLE = 40
LAG_SPACING_S = 0.5
LAG_WAIT_S = 30.0
#: The N the scale targets are set at (1,000 WarmModels).
TARGET_N = 1000
#: WarmModels created while a restarted operator works through the N it listed (the backlog), one
#: every LATE_SPACING_S: each one's first pass is timed, create -> its status Ready.
LATE_COUNT = 10
LATE_SPACING_S = 0.3
LATE_LABEL = "warmpool.dev/bench-late"
LATE_WAIT_S = 120.0


def warmmodel_manifest(name: str, namespace: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "warmpool.dev/v1alpha1",
        "kind": "WarmModel",
        "metadata": {"name": name, "namespace": namespace, **({"labels": labels} if labels else {})},
        "spec": {
            "model": {"nodeCache": {"key": "smollm2-135m-instruct"}, "servedName": name},
            "pool": {"replicas": 1, "minWarm": 0, "maxReplicas": 1},
            "pod": {"nodeSelector": {BENCH_LABEL: "scale"}},
        },
    }


def bench_nodes() -> list[dict[str, Any]]:
    """kwok-managed Nodes of the benchmark's own: pods bind and get an IP, nothing runs."""
    from warmpool_devcluster.kwok import node_manifests

    nodes = node_manifests(BENCH_NODES)
    for index, node in enumerate(nodes):
        name = f"{NODE_PREFIX}{index}"
        node["metadata"]["name"] = name
        node["metadata"]["labels"]["kubernetes.io/hostname"] = name
        node["metadata"]["labels"][BENCH_LABEL] = "scale"
        for key in ("capacity", "allocatable"):
            node["status"][key]["pods"] = PODS_PER_NODE
    return nodes


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) pairs, +Inf last."""
    if not buckets:
        return None
    buckets = sorted(buckets)
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound  # beyond the last finite bucket: its bound is all we know
            span = count - lower_count
            return bound if span <= 0 else lower_bound + (bound - lower_bound) * (rank - lower_count) / span
        lower_bound, lower_count = bound, count
    return buckets[-1][0]


def reconcile_histograms(metrics_text: str) -> dict[str, list[tuple[float, float]]]:
    """kind -> cumulative buckets of the operator's reconcile-duration histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    from warmpool.contract.metrics import LABEL_KIND, METRIC_OPERATOR_RECONCILE_SECONDS

    out: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == METRIC_OPERATOR_RECONCILE_SECONDS + "_bucket":
                kind = sample.labels.get(LABEL_KIND, "")
                out.setdefault(kind, []).append((float(sample.labels["le"]), float(sample.value)))
    return out


def _proc_cpu_rss(pid: int) -> tuple[float, int, int] | None:
    """(CPU seconds user+system, RSS bytes, peak RSS bytes) of a live process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15 of stat)
        rss = hwm = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
        return cpu, rss, hwm
    except (OSError, IndexError, ValueError):
        return None


def _ready_count(cluster: Any, namespace: str) -> int:
    proc = cluster.kubectl("get", "warmmodels", "-n", namespace, "-o", "json", check=False, timeout=60)
    if proc.returncode != 0:
        return 0
    count = 0
    for item in json.loads(proc.stdout).get("items", []):
        for cond in (item.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "Ready" and cond.get("status") == "True":
                count += 1
    return count


def _ready_patch(now: str) -> dict[str, Any]:
    """What a kubelet writes when a pod's container starts and its readiness probe passes."""
    conditions = [{"type": kind, "status": "True", "lastTransitionTime": now}
                  for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
    return {"status": {"phase": "Running", "conditions": conditions}}


def measure_status_lag(kubeconfig: Path, namespace: str, names: list[str]) -> dict[str, Any]:
    """Turn one pod of each named WarmModel Ready, one at a time, and time until its WarmModel's
    status.readyReplicas reflects it (seen through a watch).  Bounded: len(names) patches and
    LAG_WAIT_S after the last one."""
    import threading

    from kubernetes import client, config, watch

    from warmpool.contract.api import API_GROUP
    from warmpool.contract.pods import LABEL_MODEL

    # The client's Python package is untyped where it matters here: its objects are handled as Any.
    api: Any = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
    core: Any = client.CoreV1Api(api)
    custom: Any = client.CustomObjectsApi(api)
    pod_of: dict[str, str] = {}
    for pod in core.list_namespaced_pod(namespace, label_selector=LABEL_MODEL).items:
        model = (pod.metadata.labels or {}).get(LABEL_MODEL)
        if model in names and model not in pod_of and pod.spec.node_name:
            pod_of[model] = pod.metadata.name
    seen: dict[str, float] = {}
    stop = threading.Event()
    listed = custom.list_namespaced_custom_object(API_GROUP, "v1alpha1", namespace, "warmmodels")

    def watch_status() -> None:
        stream: Any = watch.Watch()  # type: ignore[no-untyped-call]
        for event in stream.stream(custom.list_namespaced_custom_object, API_GROUP, "v1alpha1", namespace,
                                   "warmmodels", resource_version=listed["metadata"]["resourceVersion"],
                                   timeout_seconds=int(len(names) * LAG_SPACING_S + LAG_WAIT_S + 30)):
            obj = event["object"]
            name = obj["metadata"]["name"]
            if name not in seen and int((obj.get("status") or {}).get("readyReplicas") or 0) >= 1:
                seen[name] = time.monotonic()
            if stop.is_set():
                stream.stop()

    watcher = threading.Thread(target=watch_status, daemon=True)
    watcher.start()
    time.sleep(1.0)  # the watch is open before the first event it must see
    started: dict[str, float] = {}
    for model, pod_name in pod_of.items():
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        started[model] = time.monotonic()
        core.patch_namespaced_pod_status(pod_name, namespace, _ready_patch(now))
        time.sleep(LAG_SPACING_S)
    deadline = time.monotonic() + LAG_WAIT_S
    while time.monotonic() < deadline and not set(started) <= set(seen):
        time.sleep(0.2)
    stop.set()
    lags = [seen[m] - started[m] for m in started if m in seen]
    from warmpool_bench.stats import percentile

    return {"sampled": len(started), "reflected": len(lags), "p50_s": percentile(lags, 50),
            "p95_s": percentile(lags, 95), "max_s": max(lags, default=None)}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def reconcile_figures(text: str) -> dict[str, Any]:
    """The operator's reconcile and scrape-cycle quantiles, per kind and overall, from its /metrics."""
    hists = reconcile_histograms(text)
    figures: dict[str, Any] = {"reconcile_kinds": {k: v[-1][1] for k, v in hists.items() if v}}
    merged: dict[float, float] = {}
    for kind, buckets in hists.items():
        for bound, value in buckets:
            merged[bound] = merged.get(bound, 0.0) + value
        figures[f"reconcile_{kind}_p50_s"] = histogram_quantile(buckets, 0.5)
        figures[f"reconcile_{kind}_p95_s"] = histogram_quantile(buckets, 0.95)
    all_buckets = list(merged.items())
    figures["reconcile_p50_s"] = histogram_quantile(all_buckets, 0.5)
    figures["reconcile_p95_s"] = histogram_quantile(all_buckets, 0.95)
    timer = hists.get("timer")
    figures["scrape_cycle_p50_s"] = histogram_quantile(timer, 0.5) if timer else None
    figures["scrape_cycle_p95_s"] = histogram_quantile(timer, 0.95) if timer else None
    return figures


def _wait_ready(cluster: Any, namespace: str, count: int, pid: int, applied: float, deadline: float,
                point: dict[str, Any]) -> tuple[int, int]:
    """Poll until all ``count`` WarmModels are Ready or the deadline (``all_ready_s`` and
    ``ready_count`` into ``point``), saying how far it has got every 10 s; (Ready, peak RSS)."""
    ready = peak_rss = 0
    said = time.monotonic()
    while time.monotonic() < deadline:
        ready = _ready_count(cluster, namespace)
        sample = _proc_cpu_rss(pid)
        if sample is not None:
            peak_rss = max(peak_rss, sample[1])
        if ready >= count:
            point["all_ready_s"] = time.monotonic() - applied
            break
        if time.monotonic() - said >= 10:
            said = time.monotonic()
            print(f"[bench scale] N={count}: {ready}/{count} Ready after {said - applied:.0f} s",
                  file=sys.stderr, flush=True)
        time.sleep(1.0)
    point["ready_count"] = ready
    return ready, peak_rss


def _deployments_done(cluster: Any, namespace: str) -> int:
    """Deployments whose controller has made their pod (status.replicas >= spec.replicas)."""
    got = cluster.kubectl("get", "deployments", "-n", namespace, "-o", "json", check=False, timeout=120)
    if got.returncode != 0:
        return 0
    return sum(1 for d in json.loads(got.stdout).get("items", [])
               if int((d.get("status") or {}).get("replicas") or 0) >= int(d["spec"].get("replicas") or 0))


def _wait_settled(cluster: Any, namespace: str, count: int, deadline: float) -> float | None:
    """Seconds after all Ready until the controllers have made every pod (None: not by the deadline).
    The Deployment controller makes ReplicaSets and pods at its own client's rate (20 writes/s by
    default) long after the operator is done, and each is a watch event the operator handles:
    idle is measured once that has ended, or it measures the controller's tail."""
    started = time.monotonic()
    while time.monotonic() < deadline:
        if _deployments_done(cluster, namespace) >= count:
            return time.monotonic() - started
        time.sleep(2.0)
    return None


def _idle_window(pid: int, scrape_interval: float, point: dict[str, Any]) -> tuple[float, int, int] | None:
    """Idle at N: the operator's CPU over a window of steady state (into ``point``), as many scrape
    rounds as a pool with nothing to scrape takes between passes (at least two); the operator's
    CPU and memory reading at its end."""
    from warmpool_operator.control.reconciler import QUIET_ROUNDS_PER_PASS

    idle_from = _proc_cpu_rss(pid)
    idle_started = time.monotonic()
    time.sleep(min(max(2, QUIET_ROUNDS_PER_PASS) * scrape_interval, 120))
    end = _proc_cpu_rss(pid)
    if idle_from is not None and end is not None:
        point["idle_cpu_percent"] = 100 * (end[0] - idle_from[0]) / (time.monotonic() - idle_started)
        point["idle_rss_bytes"] = end[1]
    return end


def _delete_all(cluster: Any, namespace: str, timeout_s: float) -> float | None:
    """Delete every WarmModel of the namespace; seconds until none is left (None: not within the timeout)."""
    deleting = time.monotonic()
    cluster.kubectl("delete", "warmmodels", "--all", "-n", namespace, "--wait=false", check=False)
    while time.monotonic() - deleting < timeout_s:
        left = cluster.kubectl("get", "warmmodels", "-n", namespace, "-o", "name", check=False)
        if left.returncode == 0 and not left.stdout.strip():
            return time.monotonic() - deleting
        time.sleep(1.0)
    return None


def _start_operator(cluster: Any, namespace: str, scrape_interval: float,
                    log: Any) -> tuple[subprocess.Popen[bytes], int]:
    """A fresh `warmpool operator -n NS` process and its metrics port; up when its /metrics answers
    (bounded: 120 s; check ``poll()`` afterwards)."""
    port = _free_port()
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig))
    operator = subprocess.Popen(
        [sys.executable, "-m", "warmpool", "operator", "-n", namespace, "--scrape-interval", str(scrape_interval),
         "--scrape-network", "127.0.0.0/8", "--metrics-port", str(port), "--health-port", "0",
         "--bind", HOST, "--log-level", "WARNING"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and operator.poll() is None:  # up when its /metrics answers
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=2).read()
            break
        time.sleep(0.5)
    return operator, port


def _stop_operator(operator: subprocess.Popen[bytes]) -> None:
    if operator.poll() is None:
        operator.terminate()
        try:
            operator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait(timeout=30)


def _handler_passes(port: int) -> float:
    """Prompted passes (a create / resume handler waited for each) the operator has counted so far."""
    with contextlib.suppress(OSError):
        text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10).read().decode()
        buckets = reconcile_histograms(text).get("handler") or []
        return buckets[-1][1] if buckets else 0.0
    return 0.0


def _time_late_warmmodels(kubeconfig: Path, namespace: str) -> dict[str, float]:
    """Create LATE_COUNT WarmModels, LATE_SPACING_S apart; seconds from each create until a watch
    sees its status Ready (bounded: LATE_WAIT_S after the last create)."""
    import threading

    from kubernetes import client, config, watch

    from warmpool.contract.api import API_GROUP, API_VERSION, CONDITION_READY, PLURAL

    api: Any = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
    custom: Any = client.CustomObjectsApi(api)
    listed = custom.list_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL,
                                                  label_selector=LATE_LABEL)
    seen: dict[str, float] = {}
    stop = threading.Event()

    def watch_ready() -> None:
        stream: Any = watch.Watch()  # type: ignore[no-untyped-call]
        for event in stream.stream(custom.list_namespaced_custom_object, API_GROUP, API_VERSION, namespace, PLURAL,
                                   label_selector=LATE_LABEL, resource_version=listed["metadata"]["resourceVersion"],
                                   timeout_seconds=int(LATE_COUNT * LATE_SPACING_S + LATE_WAIT_S + 30)):
            obj = event["object"]
            conditions = (obj.get("status") or {}).get("conditions") or []
            if any(c.get("type") == CONDITION_READY and c.get("status") == "True" for c in conditions):
                seen.setdefault(obj["metadata"]["name"], time.monotonic())
            if stop.is_set():
                stream.stop()

    watcher = threading.Thread(target=watch_ready, daemon=True)
    watcher.start()
    time.sleep(0.5)  # the watch is open before the first event it must see
    created: dict[str, float] = {}
    for i in range(LATE_COUNT):
        name = f"late-{i:02d}"
        created[name] = time.monotonic()
        custom.create_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL,
                                               warmmodel_manifest(name, namespace, {LATE_LABEL: "yes"}))
        time.sleep(LATE_SPACING_S)
    deadline = time.monotonic() + LATE_WAIT_S
    while time.monotonic() < deadline and not set(created) <= set(seen):
        time.sleep(0.1)
    stop.set()
    return {name: seen[name] - created[name] for name in created if name in seen}


def measure_backlog(cluster: Any, namespace: str, count: int, scrape_interval: float, log: Any,
                    deadline: float) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """A restart over the N WarmModels: a fresh operator lists them all (the backlog: a resume pass
    each) and, once its first pass is counted, LATE_COUNT WarmModels are created one by one; their
    first passes are timed (create -> Ready), and the backlog's (start -> every listed WarmModel's
    pass counted).  Returns the operator, still running (the deletion is measured with it)."""
    started = time.monotonic()
    operator, port = _start_operator(cluster, namespace, scrape_interval, log)
    out: dict[str, Any] = {}
    if operator.poll() is not None:
        out["error"] = f"the restarted operator exited {operator.returncode}"
        return operator, out
    while time.monotonic() < deadline and _handler_passes(port) < 1:
        time.sleep(0.1)
    out["first_pass_s"] = time.monotonic() - started
    from warmpool_bench.stats import percentile

    lags = list(_time_late_warmmodels(cluster.kubeconfig, namespace).values())
    out |= {"late_created": LATE_COUNT, "late_ready": len(lags), "late_p50_s": percentile(lags, 50),
            "late_p95_s": percentile(lags, 95), "late_max_s": max(lags, default=None)}
    passes = _handler_passes(port)
    out["backlog_left_when_late_ready"] = max(0.0, count + LATE_COUNT - passes)
    while time.monotonic() < deadline and passes < count + LATE_COUNT:
        time.sleep(0.5)
        passes = _handler_passes(port)
    out["backlog_s"] = time.monotonic() - started if passes >= count + LATE_COUNT else None
    return operator, out


def measure(cluster: Any, count: int, timeout_s: float, scrape_interval: float, work: Path,
            concurrency: int) -> dict[str, Any]:
    from warmpool_bench.scale_floor import timed_apply

    namespace = f"bench-scale-{count}-{os.getpid()}"
    cluster.kubectl("create", "namespace", namespace)
    log_path = work / f"operator-{count}.log"
    point: dict[str, Any] = {"count": count, "namespace": namespace}
    operators: list[subprocess.Popen[bytes]] = []
    with log_path.open("wb") as log:
        try:
            operator, port = _start_operator(cluster, namespace, scrape_interval, log)
            operators.append(operator)
            if operator.poll() is not None:
                point["error"] = f"operator exited {operator.returncode}"
                return point
            base = _proc_cpu_rss(operator.pid)
            manifests = [warmmodel_manifest(f"wm-{i:04d}", namespace) for i in range(count)]
            applied = time.monotonic()
            # The same pooled client and concurrency as the floor: the clock measures the operator.
            created = timed_apply(cluster.kubeconfig, manifests, concurrency, f"N={count} WarmModels: ")
            point["apply_s"] = created["s"]
            if "error" in created:
                point["error"] = created["error"]
                return point
            deadline = applied + timeout_s
            ready, peak_rss = _wait_ready(cluster, namespace, count, operator.pid, applied, deadline, point)
            point["settled_s"] = _wait_settled(cluster, namespace, count, deadline)
            end = _idle_window(operator.pid, scrape_interval, point)
            # After the idle window: these events would not be idle.
            if ready >= count:
                picked = [f"wm-{i:04d}" for i in range(0, count, max(1, count // LAG_SAMPLE))][:LAG_SAMPLE]
                try:
                    point["status_lag"] = measure_status_lag(cluster.kubeconfig, namespace, picked)
                except Exception as error:  # a failed figure is reported; the run goes on
                    point["status_lag"] = {"error": f"{type(error).__name__}: {error}"}
            elapsed = time.monotonic() - applied
            if base is not None and end is not None:
                point["operator_cpu_s"] = end[0] - base[0]
                point["operator_cpu_percent"] = 100 * (end[0] - base[0]) / elapsed
                point["operator_rss_bytes"] = end[1]
                point["operator_rss_peak_bytes"] = max(end[2], peak_rss)
                # Memory per WarmModel: idle at N above the same process before the first WarmModel.
                point["operator_rss_base_bytes"] = base[1]
                point["rss_per_warmmodel_bytes"] = (end[1] - base[1]) / count
            with contextlib.suppress(OSError):
                text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10).read().decode()
                point |= reconcile_figures(text)
            # A restart over the N: the backlog, and WarmModels created during it.
            if ready >= count:
                _stop_operator(operator)
                restarted, point["restart"] = measure_backlog(cluster, namespace, count, scrape_interval, log,
                                                              time.monotonic() + timeout_s)
                operators.append(restarted)
            # Teardown while an operator runs (as a user's would).
            point["all_deleted_s"] = _delete_all(cluster, namespace, timeout_s)
        finally:
            for running in operators:
                _stop_operator(running)
            # Left behind only if an older operator set finalizers: dropped, or the namespace never goes.
            left = cluster.kubectl("get", "warmmodels", "-n", namespace, "-o", "name", check=False)
            for ref in left.stdout.split()[: count + LATE_COUNT + 1] if left.returncode == 0 else []:
                cluster.kubectl("patch", ref, "-n", namespace, "--type=merge", "-p",
                                '{"metadata":{"finalizers":null}}', check=False)
            drain_namespace(cluster, namespace)
    return point


def measure_floor(cluster: Any, count: int, concurrency: int) -> dict[str, Any]:
    """The floor at N (``scale_floor``): the N WarmModels and their children applied in one process
    over a pooled client, ``concurrency`` at once, no operator.  What this API server on this
    machine takes at N; the operator's figure is compared with it."""
    from warmpool_bench.scale_floor import floor_objects, timed_apply

    namespace = f"bench-floor-{count}-{os.getpid()}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        manifests = [warmmodel_manifest(f"wm-{i:04d}", namespace) for i in range(count)]
        point = timed_apply(cluster.kubeconfig, floor_objects(manifests), concurrency, f"N={count} floor: ")
        point["count"] = count
        if "error" not in point:
            point["all_done_s"] = point["s"]
        return point
    finally:
        drain_namespace(cluster, namespace)


def tune_floor(cluster: Any) -> tuple[int, list[dict[str, Any]]]:
    """The floor's requests in flight, tuned to this server in this run: each of CONCURRENCY_SWEEP
    applies the objects of SWEEP_MODELS WarmModels into a fresh namespace; the fastest wins."""
    from warmpool_bench.scale_floor import CONCURRENCY_SWEEP, SWEEP_MODELS, best_concurrency, floor_objects, timed_apply

    sweep: list[dict[str, Any]] = []
    for concurrency in CONCURRENCY_SWEEP:
        namespace = f"bench-sweep-{concurrency}-{os.getpid()}"
        cluster.kubectl("create", "namespace", namespace)
        try:
            manifests = [warmmodel_manifest(f"wm-{i:04d}", namespace) for i in range(SWEEP_MODELS)]
            sweep.append(timed_apply(cluster.kubeconfig, floor_objects(manifests), concurrency))
        finally:
            drain_namespace(cluster, namespace)
        print(f"[bench scale] floor sweep: {sweep[-1]}", file=sys.stderr, flush=True)
    return best_concurrency(sweep), sweep


def drain_namespace(cluster: Any, namespace: str) -> None:
    """Delete a bench namespace and wait for it (bounded), so the next N does not share the
    control plane with this teardown.  No kubelet serves the bench nodes, so nothing would ever
    confirm a pod's termination: force them (nothing runs there).  A terminating namespace
    admits no new pods, so the forced deletions converge; a round that outlasts its kubectl
    timeout (500 pods on a loaded API server took more than 120 s) goes on server-side and the
    next round picks up what is left."""
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    for _ in range(60):
        with contextlib.suppress(subprocess.TimeoutExpired):
            cluster.kubectl("delete", "pods", "--all", "-n", namespace, "--force", "--grace-period=0",
                            "--wait=false", check=False, timeout=300)
        if cluster.kubectl("get", "namespace", namespace, check=False).returncode != 0:
            return
        time.sleep(5)


def _target(value: float | None, limit: float, unit: str = "") -> dict[str, Any]:
    return {"value": value, "target": f"<= {limit:g}{unit}", "met": None if value is None else value <= limit}


def targets(point: dict[str, Any], growth_table: dict[str, dict[str, float | None]]) -> dict[str, dict[str, Any]]:
    """The scale targets at the largest N, each with its figure and met / missed (None: not measured)."""
    rss = point.get("operator_rss_peak_bytes")
    per_warmmodel = point.get("rss_per_warmmodel_bytes")
    doublings = [v for key in ("all_ready_s", "operator_cpu_s", "operator_rss_peak_bytes", "all_deleted_s")
                 for v in growth_table.get(key, {}).values() if v is not None]
    n = point["count"]
    return {
        f"all reconciled vs floor (N={n})": _target(point.get("ratio_to_floor"), 1.5, "x"),
        "reconcile p95 (all passes)": _target(point.get("reconcile_p95_s"), 1.0, " s"),
        "reconcile p95 (first pass of each object)": _target(point.get("reconcile_handler_p95_s"), 1.0, " s"),
        "first pass of a WarmModel created during a restart's backlog, p95":
            _target((point.get("restart") or {}).get("late_p95_s"), 2.0, " s"),
        "operator RSS above its empty start, per WarmModel": _target(
            None if per_warmmodel is None else per_warmmodel / 1024, 10, " KiB"),
        f"growth of all reconciled, {n} -> {2 * n}": _target(
            growth_table.get("all_ready_s", {}).get(f"{n}->{2 * n}"), 2.2, "x"),
        "status lag after a pod Ready event, p95": _target(point.get("status_lag_p95_s"), 1.0, " s"),
        "operator RSS, peak": _target(None if rss is None else rss / 1e6, 200, " MB"),
        "operator idle CPU (% of one core)": _target(point.get("idle_cpu_percent"), 10, " %"),
        f"delete all {n}": _target(point.get("all_deleted_s"), 60, " s"),
        "growth per doubling of N (worst of time, CPU, RSS, delete)": _target(max(doublings, default=None), 2.0, "x"),
    }


def run_scale(steps: list[int], timeout_s: float, scrape_interval: float, kubeconfig: Path | None) -> dict[str, Any]:
    from warmpool_devcluster.testing import start_or_attach_simulated

    from warmpool_bench.coldstart import machine_info

    result: dict[str, Any] = {
        "benchmark": "scale",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "settings": {"steps": steps, "timeout_s": timeout_s, "scrape_interval_s": scrape_interval},
        "points": [],
    }
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "warmpool-bench" / "scale"
    work.mkdir(parents=True, exist_ok=True)
    # Simulated (kwok) nodes: the operator's work at 1,000 WarmModels, not a real node's pod starts.
    cluster = start_or_attach_simulated(str(kubeconfig) if kubeconfig else None, f"bench-scale-{os.getpid()}")
    try:
        crd = Path(__file__).resolve().parents[2] / "crds" / "warmmodels.warmpool.dev.yaml"
        cluster.kubectl("apply", "-f", str(crd))
        cluster.kubectl("wait", "--for=condition=Established", "crd/warmmodels.warmpool.dev", "--timeout=60s")
        cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(n) for n in bench_nodes()))
        concurrency, result["floor_sweep"] = tune_floor(cluster)
        result["settings"]["concurrency"] = concurrency
        for count in steps:
            print(f"[bench scale] N={count}", file=sys.stderr, flush=True)
            floor = measure_floor(cluster, count, concurrency)
            print(f"[bench scale] N={count} floor: {floor}", file=sys.stderr, flush=True)
            point = measure(cluster, count, timeout_s, scrape_interval, work, concurrency)
            point["floor"] = floor
            if point.get("all_ready_s") and floor.get("all_done_s"):
                point["ratio_to_floor"] = point["all_ready_s"] / floor["all_done_s"]
            print(f"[bench scale] N={count}: {point}", file=sys.stderr, flush=True)
            result["points"].append(point)
    finally:
        cluster.kubectl("delete", "nodes", *[f"{NODE_PREFIX}{i}" for i in range(BENCH_NODES)], "--wait=false",
                        check=False)
        cluster.close()
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    return summarise(result)


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """The growth table and the issue's targets, from the measured points."""
    points = result["points"]
    for point in points:  # flattened for the growth table
        point["floor_all_done_s"] = (point.get("floor") or {}).get("all_done_s")
        point["status_lag_p95_s"] = (point.get("status_lag") or {}).get("p95_s")
        point["late_p95_s"] = (point.get("restart") or {}).get("late_p95_s")
        point["restart_backlog_s"] = (point.get("restart") or {}).get("backlog_s")
    result["growth"] = {
        key: growth({p["count"]: p.get(key) for p in points})
        for key in ("floor_all_done_s", "all_ready_s", "reconcile_p95_s", "status_lag_p95_s", "operator_cpu_s",
                    "idle_cpu_percent", "operator_rss_peak_bytes", "rss_per_warmmodel_bytes", "late_p95_s",
                    "restart_backlog_s", "all_deleted_s")
    }
    failed = [f"N={p['count']}: {p['error']}" for p in points if "error" in p]
    failed += [f"N={p['count']} floor: {p['floor']['error']}" for p in points if "error" in (p.get("floor") or {})]
    if failed:
        result["missing"] = "; ".join(failed)
    # Judged at the N (1,000) when it was measured to the end, else at the largest N that
    # was (a failed step has no figures); larger Ns are there for the growth.
    measured = [p for p in points if "error" not in p]
    judged = next((p for p in measured if p["count"] == TARGET_N), None) or max(
        measured, key=lambda p: p["count"], default=None)
    if judged is not None:
        result["targets"], result["targets_n"] = targets(judged, result["growth"]), judged["count"]
    return result
