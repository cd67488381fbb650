"""The dev cluster's real node, as the suite runs on it: the Kubernetes project's kubelet and
kube-proxy with containerd, pods in real containers from the checkout's images.

What a kubelet must get right (Ready only after the readiness probe passes, a liveness failure
restarts the container, a deleted pod's process ends), what the node is made of (its own
identity, the API server behind the ``kubernetes`` Service, logs/exec/port-forward through the
API server, Services through kube-proxy), and what keeps this machine safe (the guard that drops
pod traffic leaving through any interface but the bridge and keeps pods off this machine's own
services, and no image ever pulled).
"""

from __future__ import annotations

import calendar
import json
import re
import socket
import subprocess
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from warmpool_devcluster import build, node, node_network
from warmpool_devcluster import cluster as devcluster
from warmpool_devcluster.node_kubelet import NODE_NAME
from warmpool_devcluster.testing import ClusterHandle

pytestmark = pytest.mark.integration

T = TypeVar("T")
PORT = 8000
#: An image reference on a registry of this machine's loopback: pulled on purpose, by one test.
LOOPBACK_REGISTRY = re.compile(r"(127\.0\.0\.1|localhost)(:[0-9]+)?/")
#: Seconds the slow server answers /ready with 503 before it turns 200.
READY_AFTER = 6

#: A server that turns ready READY_AFTER seconds after start; the delay comes from a configMap
#: volume file, so volumes are exercised too.
SLOW_SERVER = textwrap.dedent(
    """
    import http.server, time
    started = time.time()
    delay = float(open("/etc/slow/ready-after").read())
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path != "/ready" or time.time() - started >= delay
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"warming")
    print("serving, ready after", delay, flush=True)
    http.server.ThreadingHTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
    """
)


@pytest.fixture()
def real_node(cluster: ClusterHandle) -> Any:
    if cluster.node is None or cluster.name is None:
        pytest.skip("about the local cluster's real node, not a cluster given by WARMPOOL_KUBECONFIG")
    return cluster.node


def _apply(cluster: ClusterHandle, namespace: str, *objects: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objects))


def _pods(cluster: ClusterHandle, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads(
        cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)["items"]
    return items


def _condition(pod: dict[str, Any], kind: str) -> str | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition["type"] == kind:
            return str(condition["status"])
    return None


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    status: dict[str, Any] = ((pod.get("status") or {}).get("containerStatuses") or [{}])[0]
    return status


def _wait(cluster: ClusterHandle, namespace: str, what: str, probe: Callable[[], T | None],
          timeout: float = 90.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value is not None and value is not False:
            return value
        time.sleep(0.5)
    pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "yaml", check=False).stdout
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{pods[-6000:]}")


def _answers(url: str) -> int | None:
    """HTTP status of a GET (pod IPs on the node's bridge, ClusterIPs), None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _python_container(cluster: ClusterHandle, name: str, code: str, **extra: Any) -> dict[str, Any]:
    """A container of the operator image (it has Python) running ``code``, as the chart runs containers."""
    return {
        "name": name, "image": cluster.images["operator"], "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-c", code],
        "ports": [{"name": "http", "containerPort": PORT}],
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
        **extra,
    }


def _http_server(cluster: ClusterHandle, name: str, **extra: Any) -> dict[str, Any]:
    return _python_container(cluster, name, "import http.server; http.server.ThreadingHTTPServer("
                                            f"('0.0.0.0', {PORT}), http.server.SimpleHTTPRequestHandler)"
                                            ".serve_forever()", workingDir="/", **extra)


def test_a_pod_turns_ready_only_after_its_readiness_probe(cluster: ClusterHandle, namespace: str,
                                                           real_node: Any) -> None:
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "slow"},
                  "data": {"ready-after": str(READY_AFTER)}}
    container = _python_container(
        cluster, "web", SLOW_SERVER, volumeMounts=[{"name": "slow", "mountPath": "/etc/slow"}],
        readinessProbe={"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1})
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "slow"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "slow"}},
                 "template": {"metadata": {"labels": {"app": "slow"}},
                              "spec": {"terminationGracePeriodSeconds": 5, "containers": [container],
                                       "volumes": [{"name": "slow", "configMap": {"name": "slow"}}]}}},
    }
    _apply(cluster, namespace, config_map, deployment)

    def running() -> dict[str, Any] | None:
        pods = _pods(cluster, namespace, "app=slow")
        return pods[0] if pods and "running" in (_container(pods[0]).get("state") or {}) else None

    pod = _wait(cluster, namespace, "the slow server to run", running)
    ip = pod["status"]["podIP"]
    assert real_node.holds(ip), f"a pod IP on the node's bridge ({real_node.pod_cidr}), got {ip}"
    assert pod["spec"]["nodeName"] == NODE_NAME
    assert _condition(pod, "Ready") == "False", pod["status"]

    def ready() -> dict[str, Any] | None:
        pods = _pods(cluster, namespace, "app=slow")
        return pods[0] if pods and _condition(pods[0], "Ready") == "True" else None

    pod = _wait(cluster, namespace, "the pod to become Ready", ready)
    assert _answers(f"http://{ip}:{PORT}/ready") == 200
    status = _container(pod)
    assert status["ready"] is True and status["restartCount"] == 0
    assert status["imageID"], status  # a real container of a real image
    became_ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")["lastTransitionTime"]
    started = status["state"]["running"]["startedAt"]
    waited = calendar.timegm(time.strptime(became_ready, "%Y-%m-%dT%H:%M:%SZ")) - calendar.timegm(
        time.strptime(started, "%Y-%m-%dT%H:%M:%SZ"))
    assert waited >= READY_AFTER - 1, f"Ready {waited:.0f}s after start; the probe passes after {READY_AFTER}s"

    cluster.kubectl("delete", "deployment", "slow", "-n", namespace, "--wait=false")
    _wait(cluster, namespace, "the deleted pod's server to stop answering",
          lambda: _answers(f"http://{ip}:{PORT}/") is None)
    _wait(cluster, namespace, "the deleted pod to go away", lambda: not _pods(cluster, namespace, "app=slow"))


def test_a_failing_liveness_probe_restarts_and_a_failing_readiness_probe_keeps_unready(
    cluster: ClusterHandle, namespace: str, real_node: Any
) -> None:
    never_ready = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "never-ready", "labels": {"case": "unready"}},
                   "spec": {"terminationGracePeriodSeconds": 2, "containers": [_http_server(
                       cluster, "web", readinessProbe={"httpGet": {"path": "/missing", "port": "http"},
                                                       "periodSeconds": 1})]}}
    not_alive = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "not-alive", "labels": {"case": "liveness"}},
                 "spec": {"terminationGracePeriodSeconds": 2, "containers": [_http_server(
                     cluster, "web", livenessProbe={"httpGet": {"path": "/missing", "port": "http"},
                                                    "periodSeconds": 1, "failureThreshold": 2,
                                                    "initialDelaySeconds": 1})]}}
    _apply(cluster, namespace, never_ready, not_alive)

    def restarted() -> dict[str, Any] | None:
        # The kubelet may report the new restartCount a status update before the last state.
        pods = _pods(cluster, namespace, "case=liveness")
        status = _container(pods[0]) if pods else {}
        return pods[0] if status.get("restartCount", 0) > 0 and "terminated" in status.get("lastState", {}) else None

    _wait(cluster, namespace, "the liveness failure to restart the container", restarted)

    def running_unready() -> dict[str, Any] | None:
        pods = _pods(cluster, namespace, "case=unready")
        if not pods or pods[0]["status"].get("phase") != "Running":
            return None
        return pods[0] if _answers(f"http://{pods[0]['status']['podIP']}:{PORT}/missing") == 404 else None

    pod = _wait(cluster, namespace, "the never-ready pod running, its server answering", running_unready)
    assert _condition(pod, "Ready") != "True", pod["status"]


def test_services_logs_exec_and_port_forward_go_through_the_real_node(
    cluster: ClusterHandle, namespace: str, real_node: Any
) -> None:
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [_http_server(
                                  cluster, "web", readinessProbe={"httpGet": {"path": "/", "port": "http"},
                                                                  "periodSeconds": 1})]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
               "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": PORT}]}}
    _apply(cluster, namespace, deployment, service)
    _wait(cluster, namespace, "the web pod Ready",
          lambda: any(_condition(p, "Ready") == "True" for p in _pods(cluster, namespace, "app=web")))
    cluster_ip = cluster.kubectl("get", "svc", "web", "-n", namespace, "-o", "jsonpath={.spec.clusterIP}").stdout
    assert cluster_ip.startswith("10.96."), cluster_ip
    # From the host, through kube-proxy's DNAT to the pod on the bridge.
    _wait(cluster, namespace, "the Service's ClusterIP to answer", lambda: _answers(f"http://{cluster_ip}/") == 200)

    # From another pod: the Service by its ClusterIP, and the API server by the `kubernetes` Service,
    # with the pod's own token and the cluster's CA (the serving certificate names 10.96.0.1).
    client = textwrap.dedent(f"""
        import json, os, ssl, urllib.request
        print("service", urllib.request.urlopen("http://{cluster_ip}/", timeout=5).status)
        sa = "/var/run/secrets/kubernetes.io/serviceaccount"
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        request = urllib.request.Request(f"https://{{host}}:{{port}}/version",
                                         headers={{"Authorization": "Bearer " + open(sa + "/token").read()}})
        context = ssl.create_default_context(cafile=sa + "/ca.crt")
        print("apiserver", host, json.load(urllib.request.urlopen(request, context=context, timeout=5))["gitVersion"])
    """)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client"},
           "spec": {"restartPolicy": "Never", "containers": [_python_container(cluster, "client", client)]}}
    _apply(cluster, namespace, pod)
    _wait(cluster, namespace, "the client pod to finish", lambda: cluster.kubectl(
        "get", "pod", "client", "-n", namespace, "-o", "jsonpath={.status.phase}").stdout in ("Succeeded", "Failed"))
    log = cluster.kubectl("logs", "client", "-n", namespace).stdout  # logs: API server -> kubelet
    assert "service 200" in log and f"apiserver {node_network.KUBERNETES_SERVICE_IP} v1.34" in log, log

    web = _pods(cluster, namespace, "app=web")[0]["metadata"]["name"]
    assert cluster.kubectl("exec", "-n", namespace, web, "--", "python", "-c", "print(6 * 7)").stdout.strip() == "42"
    kubectl = str(build.ensure_binaries(["kubectl"])["kubectl"])
    forward = subprocess.Popen([kubectl, "--kubeconfig", str(cluster.kubeconfig), "-n", namespace, "port-forward",
                                "--address", "127.0.0.1", f"pod/{web}", f":{PORT}"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert forward.stdout is not None
        line = forward.stdout.readline()
        found = re.search(r"127\.0\.0\.1:(\d+)", line)
        assert found, line
        assert _answers(f"http://127.0.0.1:{found.group(1)}/") == 200
    finally:
        forward.kill()
        forward.wait(timeout=10)


def test_the_kubelet_acts_as_its_own_node_not_as_an_admin(cluster: ClusterHandle, real_node: Any) -> None:
    """The kubelet's client certificate is system:node:<name> in system:nodes: the Node authorizer
    lets it read its node, and nothing cluster-wide (an admin kubeconfig would read every Secret)."""
    assert cluster.name is not None
    kubeconfig = node.node_dir(devcluster.state_dir(cluster.name)) / "kubelet.kubeconfig"
    kubectl = str(build.ensure_binaries(["kubectl"])["kubectl"])

    def as_kubelet(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([kubectl, "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True,
                              timeout=60)

    whoami = as_kubelet("auth", "whoami", "-o", "json")
    assert whoami.returncode == 0, whoami.stderr
    user = json.loads(whoami.stdout)["status"]["userInfo"]
    assert user["username"] == f"system:node:{NODE_NAME}" and "system:nodes" in user["groups"]
    assert as_kubelet("get", "node", NODE_NAME).returncode == 0
    refused = as_kubelet("get", "secrets", "-A")
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr


@pytest.fixture()
def dead_end_route() -> Iterator[str]:
    """A route for a test prefix (198.18.0.0/24, RFC 2544's benchmarking range) into a veth whose
    other end sits alone in a network namespace of its own, with no route anywhere: a packet sent
    there cannot leave this machine even if the guard failed.  The host end's device name."""
    namespace, host_end, far_end, prefix = "wpguardtest", "wpguardtest0", "wpguardtest1", "198.18.0.0/24"
    subprocess.run(["ip", "link", "delete", host_end], capture_output=True)
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
    commands = [
        ["ip", "netns", "add", namespace],
        ["ip", "link", "add", host_end, "type", "veth", "peer", "name", far_end, "netns", namespace],
        ["sysctl", "-q", "-w", f"net.ipv6.conf.{host_end}.disable_ipv6=1"],  # no IPv6 chatter on the counter
        ["ip", "link", "set", host_end, "up"],
        ["ip", "-n", namespace, "link", "set", far_end, "up"],
        ["ip", "route", "add", prefix, "dev", host_end],
    ]
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True)
        yield host_end
    finally:
        subprocess.run(["ip", "link", "delete", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)


def _guard_drops(net: node_network.NodeNetwork) -> int:
    """Packets the guard's "a pod routed anywhere but the bridge" rule has dropped so far."""
    out = subprocess.run(["iptables", "-w", "-t", "filter", "-L", net.filter_chain, "-v", "-x", "-n"],
                         capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[2] == "DROP" and fields[5] == net.bridge and fields[6] == f"!{net.bridge}":
            return int(fields[0])
    raise AssertionError(f"the guard's bridge rule is missing:\n{out}")


def test_the_guard_keeps_pod_traffic_on_the_bridge(cluster: ClusterHandle, namespace: str, real_node: Any,
                                                   dead_end_route: str) -> None:
    """`cluster up` installed the guard, whole; a pod that sends to an address routed through
    another interface (a dead end here, so nothing could leave anyway) is dropped at the guard."""
    assert cluster.name is not None
    state = json.loads((devcluster.state_dir(cluster.name) / "cluster.json").read_text())
    net = node.NodeState.from_json(state["node"]).network
    assert node_network.guard_missing(net) == []
    before = _guard_drops(net)
    sent = Path(f"/sys/class/net/{dead_end_route}/statistics/tx_packets")
    tx_before = int(sent.read_text())
    probe = ("import socket\ns = socket.socket(); s.settimeout(3)\n"
             "try:\n    s.connect(('198.18.0.1', 80))\nexcept OSError as e:\n    print('refused', e)")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "leaver"},
           "spec": {"restartPolicy": "Never", "containers": [_python_container(cluster, "leaver", probe)]}}
    _apply(cluster, namespace, pod)
    _wait(cluster, namespace, "the probe pod to finish", lambda: cluster.kubectl(
        "get", "pod", "leaver", "-n", namespace, "-o", "jsonpath={.status.phase}").stdout in ("Succeeded", "Failed"))
    assert "refused" in cluster.kubectl("logs", "leaver", "-n", namespace).stdout
    assert _guard_drops(net) > before, "the pod's packet was not dropped by the guard"
    assert int(sent.read_text()) == tx_before, "a pod's packet reached another interface"


def test_no_image_was_ever_pulled(cluster: ClusterHandle, namespace: str, real_node: Any) -> None:
    """Pods use the images loaded into the node's containerd (IfNotPresent, local tags): its log
    shows no pull, for a pod this test starts and every pod the suite started before it.  The one
    pull the suite expects is from its own registry on loopback (the install-from-a-registry test)."""
    assert cluster.name is not None
    _apply(cluster, namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "local-image",
                                                                          "labels": {"app": "local-image"}},
                                "spec": {"containers": [_http_server(cluster, "web")]}})

    def running() -> bool:
        pods = _pods(cluster, namespace, "app=local-image")
        return bool(pods) and "running" in (_container(pods[0]).get("state") or {})

    _wait(cluster, namespace, "a pod of the operator image to run", running)
    log = (devcluster.state_dir(cluster.name) / "logs" / "containerd.log").read_text(errors="replace")
    assert "CreateContainer" in log, "the node's containerd log records this test's container"
    pulls = [line for line in log.splitlines()
             if "PullImage" in line and not LOOPBACK_REGISTRY.search(line)]
    assert not pulls, "\n".join(pulls[:10])


class _Listener:
    """A TCP server of this machine that accepts and counts connections, then closes them."""

    def __init__(self, address: str, family: socket.AddressFamily = socket.AF_INET) -> None:
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        if family == socket.AF_INET6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too: every address
        self.sock.bind((address, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port: int = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture()
def host_listeners(real_node: Any) -> Iterator[dict[str, _Listener]]:
    """Two servers of this machine that no pod is meant to reach, on high ports the node does not
    need: one on every address (IPv4 and IPv6), one on the node's bridge address."""
    listeners = {"wildcard": _Listener("::", socket.AF_INET6), "bridge": _Listener(real_node.gateway)}
    try:
        yield listeners
    finally:
        for listener in listeners.values():
            listener.close()


def _other_host_addresses(bridge: str) -> list[str]:
    """This machine's IPv4 addresses on interfaces other than loopback and the node's bridge."""
    links = json.loads(subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True,
                                      check=True).stdout)
    return [a["local"] for link in links if link.get("ifname") not in ("lo", bridge)
            for a in link.get("addr_info", []) if a.get("local")]


def _link_local(device: str) -> str | None:
    links = json.loads(subprocess.run(["ip", "-j", "-6", "addr", "show", "dev", device], capture_output=True,
                                      text=True, check=True).stdout or "[]")
    return next((a["local"] for link in links for a in link.get("addr_info", [])
                 if str(a.get("local", "")).startswith("fe80:")), None)


#: Connects from inside a pod: "open", or why not ("timeout" when the packet was dropped).
DIAL = textwrap.dedent("""
    import socket, sys
    host, port = sys.argv[1], int(sys.argv[2])
    try:
        socket.create_connection((host, port), timeout=3).close()
        print("open")
    except socket.timeout:
        print("timeout")
    except OSError as error:
        print("refused" if isinstance(error, ConnectionRefusedError) else f"error {error}")
""")


def test_pods_reach_the_api_server_and_no_other_service_of_this_machine(
    cluster: ClusterHandle, namespace: str, real_node: Any, host_listeners: dict[str, _Listener]
) -> None:
    """The guard's INPUT chains: a pod reaches the API server (through the ``kubernetes`` Service)
    and nothing else this machine serves, whether bound to every address or to the bridge's, over
    IPv4 or IPv6; publishing a port to pods (what the dev tools do for Jaeger and SeaweedFS on the
    bridge address) opens exactly that one."""
    assert cluster.name is not None
    net = node_network.NodeNetwork(int(real_node.gateway.split(".")[2]))
    prober = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "prober"},
              "spec": {"containers": [_python_container(cluster, "prober", "import time; time.sleep(3600)")]}}
    _apply(cluster, namespace, prober)
    _wait(cluster, namespace, "the prober pod to run", lambda: cluster.kubectl(
        "get", "pod", "prober", "-n", namespace, "-o", "jsonpath={.status.phase}").stdout == "Running")

    def dial(host: str, port: int) -> str:
        return cluster.kubectl("exec", "-n", namespace, "prober", "--", "python", "-c", DIAL, host,
                               str(port)).stdout.strip()

    assert dial(node_network.KUBERNETES_SERVICE_IP, 443) == "open"
    wildcard, bridge = host_listeners["wildcard"], host_listeners["bridge"]
    targets = [(real_node.gateway, wildcard.port), (real_node.gateway, bridge.port)]
    targets += [(address, wildcard.port) for address in _other_host_addresses(net.bridge)]
    results = {f"{host}:{port}": dial(host, port) for host, port in targets}
    assert all(result == "timeout" for result in results.values()), results  # dropped, not even refused
    link_local = _link_local(net.bridge)
    if link_local is not None:
        # The host's IPv6 address on the bridge, which a pod could reach by its link-local address
        # (dropped too, neighbour discovery included: no route, or no answer).
        assert dial(f"{link_local}%eth0", wildcard.port) != "open"
    assert wildcard.accepted == 0 and bridge.accepted == 0

    # The same listener, published: the pod gets in (so the timeouts above were the guard's).
    assert node_network.publish_to_pods(real_node.gateway, bridge.port)
    try:
        assert dial(real_node.gateway, bridge.port) == "open"
        _wait(cluster, namespace, "the published listener to accept", lambda: bridge.accepted == 1, timeout=10)
    finally:
        node_network.withdraw_from_pods(real_node.gateway, bridge.port)
    assert dial(real_node.gateway, bridge.port) == "timeout"
