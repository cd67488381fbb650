"""The chart's NetworkPolicies, enforced on the real node (issue 40 item 9).

The dev cluster's bridge CNI enforces no NetworkPolicy, so `cluster up` runs the project's enforcer
beside it (devcluster netpol_enforcer.py: iptables on this host, from the same evaluator the
activator applies), for the whole suite. The chart is installed as users run it: operator and
activator pods in the release namespace, the PodMonitor on (a stand-in for the Prometheus Operator's
PodMonitor CRD when the cluster has none), and `networkPolicy.metricsClients` naming a Prometheus
pod. One WarmModel runs in team B's namespace: an external engine (the worker image serving on port
8000, every address) beside the sidecar (port `http`: serving, /metrics and /control/*), with
scaleToZero, so the activator serves it. Team A's namespace is watched too: its pods may reach the
activator, whose own check then applies.

Under enforcement:
- the worker pod, started after the enforcer, is scraped (verified warm) and directed
  (/control/tier) by the operator pod;
- team A's pod reaches no worker port straight: not serving, /metrics or /control;
- no pod reaches the engine's port, team B's own included;
- the labelled Prometheus pod reaches /metrics, and another pod of its namespace does not;
- through the activator, team A gets the activator's own refusal (421), and team B is served
  (with three namespaces watched, which found the activator's relist bug: see the test).
Then the enforcer stops: no rule is left, and every route that was dropped opens.  So each drop
above is the enforcer's doing.  It starts again for the rest of the suite.

Addresses dialled: pod IPs on the node's bridge only.  Every wait and probe is bounded.
"""

from __future__ import annotations

import json
import socket
import textwrap
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_devcluster import cluster as devcluster
from warmpool_devcluster import netpol_enforcer, node
from warmpool_devcluster.chart_values import local_values
from warmpool_devcluster.testing import ClusterHandle

from tests.integration.test_helm_install import CHART, adopt_existing_crd, helm, wait_for
from tests.support.e2e import delete_warmmodels, http, metric, model_root, one_shot_pod, pod_ready, tiny_model
from warmpool.contract.api import API_GROUP_VERSION, KIND
from warmpool.contract.files import MODEL_MOUNT_PATH
from warmpool.contract.http import DEFAULT_WORKER_PORT, PATH_CONTROL_TIER, PATH_METRICS, PATH_READYZ
from warmpool.contract.metrics import METRIC_DIRECTIVE_ACTIVE
from warmpool.contract.pods import ENV_POD_IP, LABEL_MODEL
from warmpool.contract.zero import DEFAULT_ACTIVATOR_PORT

pytestmark = pytest.mark.e2e

ENGINE_PORT = 8000
POOL = "np"
PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}
PODMONITOR_CRD = "podmonitors.monitoring.coreos.com"
#: Seconds a probe keeps trying a route (a route let through answers within the first try or two;
#: a dropped one times out each try until then).
PATIENCE_S = 8

#: What each probe pod runs: every route at once, each tried until it answers or PATIENCE_S passed;
#: one JSON line per route with its HTTP status (0: no answer) and the last error's name.
PROBE = textwrap.dedent("""
    import http.client, json, sys, threading, time
    def attempt(route):
        deadline = time.monotonic() + route["patience"]
        while True:
            connection = http.client.HTTPConnection(route["ip"], route["port"], timeout=2)
            try:
                body = json.dumps({"prompt": "hello there", "max_tokens": 2, "temperature": 0})
                method = "POST" if route["path"].startswith(("/v1/", "/control/")) else "GET"
                connection.request(method, route["path"], body=body if method == "POST" else None,
                                   headers={"Host": route.get("host") or route["ip"],
                                            "Content-Type": "application/json"})
                answer = connection.getresponse()
                text = answer.read()[:300].decode(errors="replace")
                return {**route, "status": answer.status, "error": "", "body": text}
            except OSError as error:
                if time.monotonic() + 0.5 >= deadline:
                    return {**route, "status": 0, "error": type(error).__name__}
                time.sleep(0.5)
            finally:
                connection.close()
    routes = json.loads(sys.argv[1])
    results = [None] * len(routes)
    def run(i):
        results[i] = attempt(routes[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(routes))]
    for t in threads: t.start()
    for t in threads: t.join()
    for r in results: print(json.dumps(r))
""")


@dataclass
class Stack:
    """The chart's release and the namespaces around it."""

    cluster: ClusterHandle
    release: str
    system: str  # the release namespace: operator and activator pods
    team_b: str  # the WarmModel's namespace
    team_a: str  # another watched namespace
    monitoring: str  # Prometheus' namespace
    probes: int = 0

    def kubectl(self, *args: str, check: bool = True) -> str:
        return self.cluster.kubectl(*args, check=check).stdout

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return list(json.loads(self.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json"))["items"])

    def wm(self) -> dict[str, Any]:
        return dict(json.loads(self.kubectl("get", "wm", POOL, "-n", self.team_b, "-o", "json")))


def _podmonitor_crd() -> dict[str, Any]:
    """The Prometheus Operator's PodMonitor kind, schema left open: what a cluster with the PodMonitor
    on has (the chart's own render tests check the objects' fields)."""
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": PODMONITOR_CRD},
            "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                     "names": {"plural": "podmonitors", "singular": "podmonitor", "kind": "PodMonitor"},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


def _values(cluster: ClusterHandle, stack: Stack) -> dict[str, Any]:
    assert cluster.node is not None
    values = local_values(cluster.images, cluster.node.pod_cidr)
    return values | {
        "watch": {"namespaces": [stack.system, stack.team_b, stack.team_a]},
        "operator": {**values["operator"], "scrapeInterval": 2, "logLevel": "INFO",
                     "allowedHostPaths": [str(model_root())]},
        "probes": {"readiness": {"initialDelaySeconds": 1, "periodSeconds": 2, "timeoutSeconds": 5,
                                 "failureThreshold": 3}},
        "metrics": {"podMonitor": {"enabled": True}},
        "networkPolicy": {"metricsClients": [{
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": stack.monitoring}},
            "podSelector": {"matchLabels": PROMETHEUS_LABELS}}]},
    }


@pytest.fixture(scope="module")
def stack(cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if cluster.node is None or "operator" not in cluster.images or "worker" not in cluster.images:
        pytest.skip("enforces on the local cluster's real node, with the checkout's images loaded there")
    suffix = uuid.uuid4().hex[:6]
    stack = Stack(cluster, f"np{suffix}", f"t-np-system-{suffix}", f"t-np-b-{suffix}", f"t-np-a-{suffix}",
                  f"t-np-mon-{suffix}")
    made_crd = cluster.kubectl("get", "crd", PODMONITOR_CRD, check=False).returncode != 0
    installed = False
    try:
        for namespace in (stack.system, stack.team_b, stack.team_a, stack.monitoring):
            cluster.kubectl("create", "namespace", namespace)
        if made_crd:
            cluster.kubectl("apply", "-f", "-", input=json.dumps(_podmonitor_crd()))
            cluster.kubectl("wait", "--for=condition=Established", f"crd/{PODMONITOR_CRD}", "--timeout=60s")
        adopt_existing_crd(cluster, stack.release, stack.system)
        values = tmp_path_factory.mktemp("np") / "values.yaml"
        values.write_text(yaml.safe_dump(_values(cluster, stack)))
        # No --wait: the operator's pods start while the enforcer does; the pool waits for both.
        helm(cluster, "install", stack.release, str(CHART), "-n", stack.system, "-f", str(values))
        installed = True
        yield stack
    finally:
        logs = cluster.kubectl("-n", stack.system, "logs", "-l", "app.kubernetes.io/component=activator",
                               "--tail=30", "--prefix", check=False)
        print("\n===== activator logs (tail) =====\n" + logs.stdout + logs.stderr)
        delete_warmmodels(cluster, stack.team_b)  # while the operator runs: it removes its finalizer
        if installed:
            helm(cluster, "uninstall", stack.release, "-n", stack.system, "--wait", "--timeout", "120s", check=False)
        for namespace in (stack.system, stack.team_b, stack.team_a, stack.monitoring):
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found", check=False)
        if made_crd:
            cluster.kubectl("delete", "crd", PODMONITOR_CRD, "--ignore-not-found", check=False)


class Enforcer:
    """The cluster's own enforcer (``cluster up`` starts it with the real node): this module checks
    that it runs, and stops it once to prove that each drop is its doing, then starts it again."""

    def __init__(self, cluster: ClusterHandle) -> None:
        assert cluster.node is not None and cluster.name is not None, "the enforcer runs on our own real node"
        self.cluster_name = cluster.name
        self.net = netpol_enforcer.network_of(cluster.node.pod_cidr)
        self.log = devcluster.state_dir(cluster.name) / "logs" / f"{node.POLICY_ENFORCER}.log"
        assert devcluster.status(cluster.name)["components"][node.POLICY_ENFORCER]["alive"], (
            f"`cluster up` started no NetworkPolicy enforcer: {self.text()}")
        assert netpol_enforcer.present(self.net), f"the enforcer has programmed no chain: {self.text()}"
        self.started_at = time.time()  # running now, so before anything this module creates

    def text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else "(no log)"

    def stop(self) -> None:
        """Stop it (SIGTERM: it removes its rules) and check that nothing of it is left."""
        devcluster.stop_policy_enforcer(self.cluster_name)
        left = netpol_enforcer.present(self.net)
        assert not left, f"the enforcer left rules behind: {left}\n{self.text()}"

    def start(self) -> None:
        devcluster.start_policy_enforcer(self.cluster_name)
        assert netpol_enforcer.present(self.net), self.text()


@pytest.fixture(scope="module")
def enforcer(stack: Stack) -> Iterator[Enforcer]:
    running = Enforcer(stack.cluster)
    try:
        yield running
    finally:
        print("\n===== enforcer log (tail) =====\n" + running.text())
        running.start()  # for the rest of the suite, whatever this module did


def _pool(stack: Stack) -> dict[str, Any]:
    image = stack.cluster.images["worker"]
    return {
        "apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": POOL},
        "spec": {
            "model": {"hostPath": {"path": str(tiny_model())}},
            "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": 1,
                     "scaleToZero": {"afterIdleSeconds": 3600, "holdTimeoutSeconds": 60, "maxHeldRequests": 5}},
            "warmup": {"buckets": [8, 16], "timeoutSeconds": 120},
            "engine": {
                "kind": "sidecar", "image": image, "port": ENGINE_PORT, "healthPath": PATH_READYZ,
                "args": ["serve", f"--model={MODEL_MOUNT_PATH}", f"--port={ENGINE_PORT}", "--device=cpu",
                         "--buckets=16", "--prompts-per-bucket=1", "--decode-tokens=1"],
                # Every address, as vLLM binds by default: only a NetworkPolicy keeps other pods out.
                "env": [{"name": ENV_POD_IP, "value": "0.0.0.0"}],
            },
            # This engine exports no KV-cache gauge, which reads as an Unknown tier, and the operator
            # directs no pod of Unknown tier: the sidecar reads the pod's memory instead, so the
            # operator sends its /control/tier.
            "pod": {"workerArgs": ["--prompts-per-bucket=1", "--decode-tokens=1", "--memory-source=device",
                                   "--device=cpu"]},
        },
    }


@pytest.fixture(scope="module")
def worker(stack: Stack, enforcer: Enforcer) -> dict[str, Any]:
    """The pool's one pod, created after the enforcer started, verified warm by the operator."""
    stack.cluster.kubectl("apply", "-n", stack.team_b, "-f", "-", input=json.dumps(_pool(stack)))

    def warm() -> dict[str, Any] | None:
        status = stack.wm().get("status") or {}
        return status if status.get("warmReplicas", 0) >= 1 else None

    try:
        wait_for("the pool verified warm by the operator pod, under enforcement", warm, timeout=240)
    except AssertionError:
        print(stack.kubectl("get", "wm,pods,events", "-n", stack.team_b, "-o", "wide", check=False))
        print(stack.kubectl("get", "pods", "-n", stack.system, "-o", "wide", check=False))
        raise
    (pod,) = stack.pods(stack.team_b, f"{LABEL_MODEL}={POOL}")
    return pod


def _probe(stack: Stack, routes: dict[str, tuple[str, dict[str, str], list[dict[str, Any]]]]
           ) -> dict[str, dict[str, Any]]:
    """Run one probe pod per entry (name -> namespace, labels, routes) at once; each route's result
    by its "name"."""
    stack.probes += 1
    image = stack.cluster.images["operator"]
    names = {}
    for key, (namespace, labels, each) in routes.items():
        name = f"probe-{key}-{stack.probes}"
        names[name] = namespace
        command = ["python3", "-c", PROBE, json.dumps([{**r, "patience": PATIENCE_S} for r in each])]
        stack.cluster.kubectl("apply", "-n", namespace, "-f", "-",
                              input=json.dumps(one_shot_pod(name, image, command, labels)))

    def finished() -> bool:
        return all(stack.kubectl("get", "pod", name, "-n", ns, "-o", "jsonpath={.status.phase}")
                   in ("Succeeded", "Failed") for name, ns in names.items())

    wait_for("the probe pods to finish", finished, timeout=120, interval=1.0)
    results: dict[str, dict[str, Any]] = {}
    raw: dict[str, str] = {}
    for name, namespace in names.items():
        logs = stack.cluster.kubectl("logs", name, "-n", namespace, check=False)
        raw[name] = (logs.stdout + logs.stderr)[-1500:]
        results |= {r["name"]: r for r in (json.loads(line) for line in logs.stdout.splitlines()
                                           if line.startswith("{"))}
    expected = {r["name"] for _, _, each in routes.values() for r in each}
    assert set(results) == expected, (expected - set(results), raw)
    return results


def _routes(stack: Stack, worker_ip: str, activator_ip: str) -> dict[str, tuple[str, dict[str, str],
                                                                                   list[dict[str, Any]]]]:
    pool_host = f"{POOL}.{stack.team_b}"

    def route(name: str, ip: str, port: int, path: str, host: str = "") -> dict[str, Any]:
        return {"name": name, "ip": ip, "port": port, "path": path, "host": host}

    return {
        "a": (stack.team_a, {"app": "client"}, [
            route("a-serving", worker_ip, DEFAULT_WORKER_PORT, "/v1/completions"),
            route("a-metrics", worker_ip, DEFAULT_WORKER_PORT, PATH_METRICS),
            route("a-control", worker_ip, DEFAULT_WORKER_PORT, PATH_CONTROL_TIER),
            route("a-engine", worker_ip, ENGINE_PORT, "/v1/completions"),
            route("a-activator", activator_ip, DEFAULT_ACTIVATOR_PORT, "/v1/completions", pool_host),
            route("a-activator-own-namespace", activator_ip, DEFAULT_ACTIVATOR_PORT, "/v1/completions", POOL),
        ]),
        "b": (stack.team_b, {"app": "client"}, [
            route("b-serving", worker_ip, DEFAULT_WORKER_PORT, "/v1/completions"),
            route("b-engine", worker_ip, ENGINE_PORT, "/v1/completions"),
            route("b-activator", activator_ip, DEFAULT_ACTIVATOR_PORT, "/v1/completions", pool_host),
        ]),
        "prom": (stack.monitoring, PROMETHEUS_LABELS, [
            route("prometheus-metrics", worker_ip, DEFAULT_WORKER_PORT, PATH_METRICS),
        ]),
        "other": (stack.monitoring, {"app": "not-prometheus"}, [
            route("other-metrics", worker_ip, DEFAULT_WORKER_PORT, PATH_METRICS),
        ]),
    }


#: The routes a NetworkPolicy of the chart closes, and what a dropped connection looks like.
DROPPED = ("a-serving", "a-metrics", "a-control", "a-engine", "b-engine", "other-metrics")


def _activator_ip(stack: Stack) -> str:
    selector = f"app.kubernetes.io/instance={stack.release},app.kubernetes.io/component=activator"
    ready = wait_for("an activator pod Ready", lambda: [p for p in stack.pods(stack.system, selector)
                                                        if pod_ready(p)], timeout=120)
    return str(ready[0]["status"]["podIP"])


@pytest.mark.timeout(420)
def test_the_operator_pod_scrapes_and_directs_a_worker_started_under_enforcement(
        stack: Stack, enforcer: Enforcer, worker: dict[str, Any]) -> None:
    created = worker["metadata"]["creationTimestamp"]
    assert time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(enforcer.started_at)) <= created, (
        "the worker pod predates the enforcer")
    ip = worker["status"]["podIP"]
    assert stack.cluster.node is not None and stack.cluster.node.holds(ip)
    # Warm by the operator's own scrape (warmReplicas counts pods verified from their /metrics), and
    # directed: a directive holds only if the operator's POST /control/tier got through.  Read
    # from this host, which NetworkPolicy never isolates from its node's pods.
    status, text = http(f"http://{ip}:{DEFAULT_WORKER_PORT}{PATH_METRICS}", timeout=10)
    assert status == 200 and metric(text, METRIC_DIRECTIVE_ACTIVE) == 1.0, (status, text[:500])
    # And it stays fresh: four more scrape intervals, and still no pod of unknown tier.
    def fresh_for_a_while() -> bool:
        counts = (stack.wm().get("status") or {}).get("tierCounts") or {}
        return bool(counts.get("unknown", 0) == 0 and counts.get("full", 0) + counts.get("truncated", 0) >= 1)

    deadline = time.monotonic() + 8  # 4 scrape intervals
    while time.monotonic() < deadline:
        assert fresh_for_a_while(), stack.wm().get("status")
        time.sleep(1)


@pytest.fixture(scope="module")
def enforced(stack: Stack, enforcer: Enforcer, worker: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every route once, under enforcement."""
    results = _probe(stack, _routes(stack, worker["status"]["podIP"], _activator_ip(stack)))
    print("routes under enforcement: " + json.dumps(results))
    return results


@pytest.mark.timeout(300)
def test_only_the_charts_peers_reach_the_worker_and_no_pod_reaches_the_engine(
        enforced: dict[str, dict[str, Any]]) -> None:
    dropped = {name: r for name, r in enforced.items() if name in DROPPED}
    assert all(r["status"] == 0 and r["error"] == "TimeoutError" for r in dropped.values()), dropped
    assert enforced["b-serving"]["status"] == 200, enforced["b-serving"]
    assert enforced["prometheus-metrics"]["status"] == 200, enforced["prometheus-metrics"]
    # Team B through the activator: forwarded to the pod (the activator reaches the worker under enforcement).
    assert enforced["b-activator"]["status"] == 200, enforced["b-activator"]
    # Team A's pod reaches the activator (its namespace is watched): the network let it in, and
    # the bare Host "np" names no pool of team A's own namespace.
    assert enforced["a-activator-own-namespace"]["status"] == 421, enforced["a-activator-own-namespace"]


@pytest.mark.timeout(300)
def test_through_the_activator_another_namespace_gets_the_activators_own_refusal(
        enforced: dict[str, dict[str, Any]]) -> None:
    """The activator watches several namespaces here (the release's and both teams'): each
    namespace's relist once dropped the others' policies, and team A's pod was served team B's
    pool (unit/test_activator_reach.py::test_one_namespaces_relist_keeps_every_other_namespaces_policies_and_slices)."""
    assert enforced["a-activator"]["status"] == 421, enforced["a-activator"]


def _container_memory_cgroup(pod: dict[str, Any]) -> Path:
    """The memory cgroup the kubelet made for the pod's one container, on this host (cgroup v1 or v2)."""
    uid = pod["metadata"]["uid"]
    container = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    for root in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
        for pod_dir in (*root.glob(f"kubepods*/**/pod{uid}"), *root.glob(f"kubepods*/**/*pod{uid.replace('-', '_')}*")):
            for found in pod_dir.glob(f"*{container}*"):
                return found
    raise AssertionError(f"no memory cgroup for container {container} of pod {uid}")


def _memory(cgroup: Path) -> tuple[int, int]:
    """(peak bytes, limit bytes) of a container's memory cgroup."""
    if (cgroup / "memory.max_usage_in_bytes").exists():  # v1
        return (int((cgroup / "memory.max_usage_in_bytes").read_text()),
                int((cgroup / "memory.limit_in_bytes").read_text()))
    return int((cgroup / "memory.peak").read_text()), int((cgroup / "memory.max").read_text())


def _trickle(ip: str) -> socket.socket:
    """A connection that sends half a request head and then nothing."""
    sock = socket.create_connection((ip, DEFAULT_ACTIVATOR_PORT), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: np\r\nX-Slow: ")
    return sock


def _oversized(ip: str, host: str) -> bytes:
    """A request head announcing a body of 4 MiB (a worker takes 1 MiB); the answer's first bytes."""
    with socket.create_connection((ip, DEFAULT_ACTIVATOR_PORT), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {4 * 2**20}\r\n\r\n".encode() + b'{"prompt": "' + b"z" * 2**16)
        return sock.recv(64)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.timeout(300)
def test_the_charts_activator_pod_stays_under_its_memory_limit_under_slow_connections_and_oversized_bodies(
        stack: Stack, worker: dict[str, Any]) -> None:
    """200 connections that trickle half a request head and 50 requests announcing 4 MiB bodies, at
    the activator pod the chart runs (its limit: 256 Mi), while team B's requests go through it.
    Sent from this host: the node, which the activator admits as NetworkPolicy admits a pod's node."""
    selector = f"app.kubernetes.io/instance={stack.release},app.kubernetes.io/component=activator"
    pod = wait_for("an activator pod Ready", lambda: [p for p in stack.pods(stack.system, selector)
                                                      if pod_ready(p)], timeout=120)[0]
    ip, cgroup = pod["status"]["podIP"], _container_memory_cgroup(pod)
    peak_before, limit = _memory(cgroup)
    assert limit == 256 * 2**20, f"read the wrong cgroup? {cgroup}: limit {limit}"
    pool_host = f"{POOL}.{stack.team_b}"

    def served() -> int:
        connection = HTTPConnection(ip, DEFAULT_ACTIVATOR_PORT, timeout=60)
        try:
            connection.request("POST", "/v1/completions", headers={"Host": pool_host,
                                                                   "Content-Type": "application/json"},
                               body=json.dumps({"prompt": "hello there", "max_tokens": 2, "temperature": 0}))
            answer = connection.getresponse()
            answer.read()
            return answer.status
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=32) as pool:
        slow = list(pool.map(lambda _: _trickle(ip), range(200)))
        answered = pool.submit(lambda: [served() for _ in range(5)])
        refused = list(pool.map(lambda _: _oversized(ip, pool_host), range(50)))
        assert answered.result(timeout=120) == [200] * 5
    try:
        assert all(answer.startswith(b"HTTP/1.1 413") for answer in refused), {a[:20] for a in refused}
        # The chart's header deadline (10 s) closes every trickling connection.
        assert all(_closed_within(sock, 30) for sock in slow)
    finally:
        for sock in slow:
            sock.close()
    peak, _ = _memory(cgroup)
    restarted = json.loads(stack.kubectl("get", "pod", pod["metadata"]["name"], "-n", stack.system, "-o", "json"))
    assert restarted["status"]["containerStatuses"][0]["restartCount"] == 0, restarted["status"]
    print(f"\nthe activator pod's memory peak: {peak_before / 2**20:.0f} MiB before, {peak / 2**20:.0f} MiB after "
          f"200 trickling connections and 50 bodies of 4 MiB; limit {limit / 2**20:.0f} MiB")
    assert peak < limit // 2, f"peak {peak / 2**20:.0f} MiB of a {limit / 2**20:.0f} MiB limit"


@pytest.mark.timeout(300)
def test_without_the_enforcer_no_rule_is_left_and_every_dropped_route_opens(
        stack: Stack, enforcer: Enforcer, worker: dict[str, Any], enforced: dict[str, dict[str, Any]]) -> None:
    enforcer.stop()
    assert netpol_enforcer.present(enforcer.net) == []
    results = _probe(stack, _routes(stack, worker["status"]["podIP"], _activator_ip(stack)))
    opened = {name: r for name, r in results.items() if name in DROPPED}
    assert all(r["status"] > 0 for r in opened.values()), opened
