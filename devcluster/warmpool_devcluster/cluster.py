"""Start, stop and inspect a real local Kubernetes cluster on this machine.

Two kinds of node, or none:

* ``--node-runtime containerd``: one real node (node.py): the kubelet and kube-proxy with a
  containerd of the cluster's own, pods in real containers from local images on a bridge of the
  cluster's own.  The API server then listens on the bridge's host address, where pods reach it
  through the ``kubernetes`` Service, and nowhere else.  NetworkPolicies are enforced there as a
  policy-enforcing CNI would (netpol_enforcer.py, started with the node).
* ``kwok`` (the default): fake nodes only, for the scale benchmark: pods are scheduled and get
  loopback IPs, nothing runs.  The API server listens on 127.0.0.1 only.
* ``none``: etcd and the API server alone (no controllers, no scheduler, no nodes), on 127.0.0.1,
  for the tests of the operator's control layer that play the controllers themselves.

Layout of a cluster's state directory (default ``~/.cache/warmpool/clusters/<name>/``):
``pki/`` certificates, ``etcd/`` data, ``logs/<component>.log``, ``kubeconfig`` (admin),
``<component>.kubeconfig``, ``node/`` the real node's state, ``cluster.json`` ports and pids.
Every component runs as its own process group so ``down`` can end it and everything it started.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from warmpool_devcluster import build, certs, kwok, node, node_containerd, node_holder, node_namespaced
from warmpool_devcluster.node_kubelet import NODE_NAME
from warmpool_devcluster.node_network import KUBERNETES_SERVICE_IP, SERVICE_CIDR
from warmpool_devcluster.processes import alive, free_port, stop_pid

#: kwok's fake pods get loopback addresses (127.N.0.0/16); each live cluster on the machine gets
#: its own N, so two clusters never hand out one IP.
POD_CIDR_SECOND_OCTETS = range(10, 250)
#: Fake nodes of a kwok cluster (a real-node cluster has none unless asked).
DEFAULT_FAKE_NODES = 2
READY_TIMEOUT_S = 120.0
#: kwok: fake nodes; containerd: the real node; none: an API server alone (etcd and kube-apiserver:
#: no controllers, no scheduler, no nodes), for tests that play the controllers themselves
NODE_RUNTIMES = ("kwok", "containerd", "none")

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


class ClusterError(RuntimeError):
    """The cluster could not be started or is unhealthy; the message says which part and why."""


@dataclass
class ClusterState:
    name: str
    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    #: kwok's loopback pod range ("" when the cluster has no fake nodes)
    pod_cidr: str = ""
    #: where the API server listens: 127.0.0.1, or the real node's bridge address
    apiserver_host: str = "127.0.0.1"
    fake_nodes: int = 0
    #: the real node, or None for a kwok cluster
    node: node.NodeState | None = None
    #: False for an API server alone (node runtime "none")
    controllers: bool = True

    @property
    def apiserver_url(self) -> str:
        return f"https://{self.apiserver_host}:{self.ports['apiserver']}"

    def components(self) -> tuple[str, ...]:
        if not self.controllers:
            return CONTROL_PLANE[:2]
        return CONTROL_PLANE + (("kwok",) if self.fake_nodes else ())

    @property
    def runtime(self) -> str:
        return "containerd" if self.node is not None else "kwok" if self.controllers else "none"


def clusters_root() -> Path:
    return node_holder.clusters_root()


def state_dir(name: str) -> Path:
    return clusters_root() / name


def kubeconfig_path(name: str) -> Path:
    return state_dir(name) / "kubeconfig"


def _log(message: str) -> None:
    print(f"[warmpool cluster] {message}", file=sys.stderr, flush=True)


def _load_state(name: str) -> ClusterState | None:
    path = state_dir(name) / "cluster.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return ClusterState(name=data["name"], ports=data["ports"], pids=data["pids"],
                        pod_cidr=data.get("pod_cidr", ""), apiserver_host=data.get("apiserver_host", "127.0.0.1"),
                        fake_nodes=int(data.get("fake_nodes", 0)), controllers=bool(data.get("controllers", True)),
                        node=node.NodeState.from_json(data["node"]) if data.get("node") else None)


def _live_states(excluding: str) -> list[ClusterState]:
    """The other clusters on this machine with a process still running."""
    found = []
    if clusters_root().exists():
        for other in clusters_root().iterdir():
            state = _load_state(other.name) if other.name != excluding else None
            if state is not None and any(alive(pid) for pid in [*state.pids.values(),
                                                                 *(state.node.pids.values() if state.node else [])]):
                found.append(state)
    return found


def _choose_pod_cidr(name: str) -> str:
    """The first 127.N.0.0/16 that no other live cluster on this machine uses."""
    taken = {state.pod_cidr for state in _live_states(name)}
    for octet in POD_CIDR_SECOND_OCTETS:
        cidr = f"127.{octet}.0.0/16"
        if cidr not in taken:
            return cidr
    raise ClusterError("every loopback pod range 127.10-249.0.0/16 is taken by a running cluster")


def _save_state(state: ClusterState) -> None:
    path = state_dir(state.name) / "cluster.json"
    tmp = path.with_suffix(".tmp")
    data = asdict(state)
    data["node"] = state.node.to_json() if state.node else None
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)




def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True




def _choose_ports(requested_apiserver_port: int | None, apiserver_host: str) -> dict[str, int]:
    ports = {
        "etcd-client": free_port(),
        "etcd-peer": free_port(),
        "apiserver": requested_apiserver_port or free_port(),
        "controller-manager": free_port(),
        "scheduler": free_port(),
    }
    if len(set(ports.values())) != len(ports):  # the kernel may hand out a port twice
        return _choose_ports(requested_apiserver_port, apiserver_host)
    for purpose, port in ports.items():
        host = apiserver_host if purpose == "apiserver" else "127.0.0.1"
        if not _port_free(port, host):
            raise ClusterError(f"port {port} on {host} (for {purpose}) is already in use; "
                               f"stop what holds it or choose another with --port")
    return ports


def _kubeconfig(server: str, pki: Path, identity: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "warmpool", "cluster": {
            "server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": identity, "user": {
            "client-certificate": str(pki / f"{identity}.crt"),
            "client-key": str(pki / f"{identity}.key")}}],
        "contexts": [{"name": "warmpool", "context": {"cluster": "warmpool", "user": identity}}],
        "current-context": "warmpool",
    }


def _write_kubeconfig(target: Path, server: str, pki: Path, stem: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(_kubeconfig(server, pki, stem)))
    target.chmod(0o600)


def _write_kubeconfigs(root: Path, server: str) -> None:
    for identity in certs.IDENTITIES:
        target = root / ("kubeconfig" if identity.file_stem == "admin" else f"{identity.file_stem}.kubeconfig")
        _write_kubeconfig(target, server, root / "pki", identity.file_stem)


def _spawn(name: str, argv: list[str], root: Path, env: dict[str, str] | None = None) -> int:
    log_path = root / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"\n--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    return proc.pid


def _https_ok(url: str, root: Path, timeout: float = 2.0) -> bool:
    context = ssl.create_default_context(cafile=str(root / "pki" / "ca.crt"))
    context.load_cert_chain(str(root / "pki" / "admin.crt"), str(root / "pki" / "admin.key"))
    try:
        with urllib.request.urlopen(url, context=context, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _wait(what: str, check: Callable[[], bool], state: ClusterState, component: str,
          timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        pid = state.pids.get(component)
        if pid is not None and not alive(pid):
            log = state_dir(state.name) / "logs" / f"{component}.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
            raise ClusterError(f"{component} exited while waiting for {what}; log {log}:\n{tail}")
        time.sleep(0.25)
    raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}; logs in "
                       f"{state_dir(state.name) / 'logs'}")


def kubectl(name: str, *args: str, input_text: str | None = None, check: bool = True,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run the cluster's own kubectl against it with the admin kubeconfig."""
    binary = build.ensure_binaries(["kubectl"])["kubectl"]
    proc = subprocess.run([str(binary), "--kubeconfig", str(kubeconfig_path(name)), *args],
                          input=input_text, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def _healthy(state: ClusterState) -> bool:
    pids = [state.pids.get(c) for c in state.components()]
    if state.node is not None:
        pids += [state.node.pids.get(p) for p in node.PROCESSES]
    return all(alive(pid) for pid in pids) and _https_ok(f"{state.apiserver_url}/readyz", state_dir(state.name))


def is_healthy(name: str) -> bool:
    state = _load_state(name)
    return state is not None and _healthy(state)


def node_runtime(name: str) -> str | None:
    """The running cluster's node runtime (one of NODE_RUNTIMES), None when it is not up."""
    state = _load_state(name)
    return state.runtime if state is not None else None


def pod_gateway(name: str) -> str | None:
    """This machine's address on the cluster's node bridge, where pods reach a server of the
    host (the API server listens there); None for a cluster without a real node, or not up."""
    state = _load_state(name)
    if state is None or state.node is None:
        return None
    return state.apiserver_host


def up(name: str = "default", *, node_runtime: str = "kwok", fake_nodes: int | None = None,
       apiserver_port: int | None = None, nodes: int = 1) -> Path:
    """Start the cluster (or find it already running) and return its admin kubeconfig path.

    ``node_runtime`` "containerd" adds ``nodes`` real nodes (node.py, node_namespaced.py);
    ``fake_nodes`` kwok nodes (default: two on a kwok cluster, none beside a real node).
    """
    if node_runtime not in NODE_RUNTIMES:
        raise ClusterError(f"--node-runtime must be one of {', '.join(NODE_RUNTIMES)}, not {node_runtime!r}")
    if nodes != 1 and node_runtime != "containerd":
        raise ClusterError(f"--nodes {nodes} needs real nodes: add --node-runtime containerd")
    fakes = fake_nodes if fake_nodes is not None else (DEFAULT_FAKE_NODES if node_runtime == "kwok" else 0)
    if fakes < 0 or (node_runtime == "kwok" and fakes < 1):
        raise ClusterError("a kwok cluster needs at least one fake node (--fake-nodes)")
    if node_runtime == "none" and fakes:
        raise ClusterError("an API server alone (--node-runtime none) runs no nodes: drop --fake-nodes")
    running = _load_state(name)
    if running is not None and _healthy(running):
        if running.runtime != node_runtime:
            raise ClusterError(f"cluster {name!r} is up with node runtime {running.runtime}, "
                               f"not {node_runtime}: `warmpool cluster down --name {name}` first")
        running_nodes = _real_nodes(running)
        if running_nodes != nodes:
            raise ClusterError(f"cluster {name!r} is up with {running_nodes} real node(s), not {nodes}: "
                               f"`warmpool cluster down --name {name}` first")
        _log(f"cluster {name!r} is already up")
        return kubeconfig_path(name)
    down(name, quiet=True)  # a half-started cluster: clear it before starting afresh
    try:
        return _start(name, node_runtime, fakes, apiserver_port, nodes)
    except BaseException:
        # Never leave half a cluster running after a failed (or interrupted) start.
        down(name, quiet=True)
        raise


def _component_identity_flags(kubeconfig: Path, port: int) -> list[str]:
    """What controller-manager and scheduler share: their own identity for every API call, a
    loopback-only secure port, and no leader election (one replica of each)."""
    return [
        "--kubeconfig", str(kubeconfig),
        "--authentication-kubeconfig", str(kubeconfig),
        "--authorization-kubeconfig", str(kubeconfig),
        "--bind-address", "127.0.0.1", "--secure-port", str(port),
        "--leader-elect=false",
    ]


def _apiserver_argv(binary: Path, root: Path, state: ClusterState) -> list[str]:
    pki = root / "pki"
    ports = state.ports
    etcd_url = f"http://127.0.0.1:{ports['etcd-client']}"
    argv = [
        str(binary),
        "--etcd-servers", etcd_url,
        "--bind-address", state.apiserver_host, "--advertise-address", state.apiserver_host,
        "--secure-port", str(ports["apiserver"]),
        "--tls-cert-file", str(pki / "apiserver.crt"), "--tls-private-key-file", str(pki / "apiserver.key"),
        "--client-ca-file", str(pki / "ca.crt"),
        "--authorization-mode", "Node,RBAC",
        "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
        "--service-account-key-file", str(pki / "sa.pub"),
        "--service-account-signing-key-file", str(pki / "sa.key"),
        "--service-cluster-ip-range", SERVICE_CIDR,
        "--allow-privileged=true",
        "--enable-admission-plugins", "NodeRestriction",
        "--profiling=false", "--v", "1",
    ]
    if state.node is None:
        # A loopback address cannot be an endpoint, and no pod runs to reach it anyway.
        argv += ["--endpoint-reconciler-type", "none"]
    else:
        # The `kubernetes` Service's endpoint is the bridge address pods route to (lease reconciler);
        # towards kubelets (logs, exec, port-forward) the API server has its own client identity and
        # verifies the kubelet's serving certificate.
        argv += [
            "--endpoint-reconciler-type", "lease",
            "--kubelet-client-certificate", str(pki / f"{certs.APISERVER_KUBELET_CLIENT}.crt"),
            "--kubelet-client-key", str(pki / f"{certs.APISERVER_KUBELET_CLIENT}.key"),
            "--kubelet-certificate-authority", str(pki / "ca.crt"),
            "--kubelet-preferred-address-types", "InternalIP",
        ]
    return argv


def restart_apiserver(name: str = "default") -> None:
    """Stop the API server and start it again on the same port and store (watch-resilience tests:
    every watch and connection of every client ends; their clients must reconnect)."""
    state = _load_state(name)
    if state is None:
        raise RuntimeError(f"cluster {name!r} is not up")
    root = state_dir(name)
    pid = state.pids.get("kube-apiserver")
    if pid is not None:
        stop_pid(pid)
    binaries = build.ensure_binaries(["kube-apiserver"])
    state.pids["kube-apiserver"] = _spawn("kube-apiserver", _apiserver_argv(binaries["kube-apiserver"], root, state),
                                          root)
    _save_state(state)
    _log(f"kube-apiserver restarting on {state.apiserver_url}")
    _wait("kube-apiserver /readyz", lambda: _https_ok(f"{state.apiserver_url}/readyz", root), state, "kube-apiserver")


def _start(name: str, node_runtime: str, fake_nodes: int, apiserver_port: int | None, nodes: int = 1) -> Path:
    started = time.monotonic()
    wanted = [*(CONTROL_PLANE if node_runtime != "none" else CONTROL_PLANE[:2]), "kubectl"]
    if fake_nodes:
        wanted.append("kwok")
    if node_runtime == "containerd":
        node.preflight(node_holder.holders(clusters_root(), excluding=name))
        wanted += ["kubelet", "kube-proxy"]
    binaries = build.ensure_binaries(wanted)
    root = state_dir(name)
    root.mkdir(parents=True, exist_ok=True)
    state = ClusterState(name=name, fake_nodes=fake_nodes, controllers=node_runtime != "none")
    if fake_nodes:
        state.pod_cidr = _choose_pod_cidr(name)
    serving_ips: tuple[str, ...] = ()
    if node_runtime == "containerd":
        taken = {octet for s in _live_states(name) if s.node is not None for octet in s.node.octets}
        state.node = node.NodeState(octet=node.choose_octet(taken))
        node.plan_further_nodes(state.node, nodes, taken)
        state.apiserver_host = state.node.network.gateway
        serving_ips = (state.apiserver_host, KUBERNETES_SERVICE_IP)
    certs.generate_pki(root / "pki", serving_ips)
    pki = root / "pki"
    state.ports = _choose_ports(apiserver_port, state.apiserver_host) if state.node is None else {}
    if state.node is not None:
        # The bridge (and its address) first: the API server binds to it.
        _save_state(state)
        node.start_network(state.node, root)
        state.ports = _choose_ports(apiserver_port, state.apiserver_host)
        node.publish_apiserver(state.node, state.ports["apiserver"])
        certs.issue_node_pki(pki, NODE_NAME, state.apiserver_host)
        node.issue_further_node_pki(state.node, pki, root, state.apiserver_url,
                                    lambda path, server, stem: _write_kubeconfig(path, server, pki, stem))
    _write_kubeconfigs(root, state.apiserver_url)
    ports = state.ports

    def spawn(component: str, argv: list[str]) -> int:
        return _spawn(component, argv, root)

    etcd_url = f"http://127.0.0.1:{ports['etcd-client']}"
    peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
    state.pids["etcd"] = spawn("etcd", [
        str(binaries["etcd"]), "--name", "warmpool", "--data-dir", str(root / "etcd"),
        "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"warmpool={peer_url}", "--listen-metrics-urls", "",
        # A throwaway test store: skipping fsync makes the control plane several times faster.
        "--unsafe-no-fsync", "--quota-backend-bytes", str(2 * 1024**3), "--log-level", "warn",
    ])
    _save_state(state)
    _log("etcd starting")
    _wait("etcd health", lambda: _http_ok(f"{etcd_url}/health"), state, "etcd", 60)

    state.pids["kube-apiserver"] = spawn("kube-apiserver", _apiserver_argv(binaries["kube-apiserver"], root, state))
    _save_state(state)
    _log(f"kube-apiserver starting on {state.apiserver_url}")
    _wait("kube-apiserver /readyz", lambda: _https_ok(f"{state.apiserver_url}/readyz", root), state, "kube-apiserver")
    if not state.controllers:
        _log(f"API server {name!r} (no controllers, no nodes) is up in {time.monotonic() - started:.1f}s; "
             f"kubeconfig: {kubeconfig_path(name)}")
        return kubeconfig_path(name)

    _start_controllers(state, root, binaries, spawn)
    _save_state(state)
    if state.node is not None:
        _start_real_node(state, state.node, root, binaries, spawn)
    if fake_nodes:
        _start_fake_nodes(state, binaries["kwok"], fake_nodes)
    _wait("the default service account", lambda: kubectl(
        name, "get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0,
        state, "kube-controller-manager")
    _log(f"cluster {name!r} is up in {time.monotonic() - started:.1f}s; "
         f"kubeconfig: {kubeconfig_path(name)}")
    return kubeconfig_path(name)


def _start_real_node(state: ClusterState, real_node: node.NodeState, root: Path, binaries: dict[str, Path],
                     spawn: Callable[[str, list[str]], int]) -> None:
    """containerd, the kubelet and kube-proxy, then (once the node is Ready) the NetworkPolicy enforcer."""
    node.write_node_kubeconfigs(root, state.apiserver_url,
                                lambda path, server, stem: _write_kubeconfig(path, server, root / "pki", stem))
    _log(f"real node starting: containerd, kubelet, kube-proxy on bridge {real_node.network.bridge} "
         f"({real_node.network.pod_cidr})")
    node.start_runtime(real_node, root, spawn)
    _save_state(state)
    node.start_agents(real_node, root, binaries, spawn)
    _save_state(state)
    node.wait_ready(real_node, root, lambda: _ready_nodes(state.name, NODE_NAME) >= 1)
    _log("NetworkPolicy enforcer starting")
    node.start_policy_enforcer(real_node, root, kubeconfig_path(state.name), spawn)
    _save_state(state)
    if real_node.extra:
        _log(f"further real nodes starting: {', '.join(n.name for n in real_node.extra)}")
        node.start_further_nodes(real_node, root, binaries, spawn, kubeconfig_path(state.name),
                                 lambda node_name: _ready_nodes(state.name, node_name) >= 1,
                                 lambda: _save_state(state))


def _real_node(name: str) -> tuple[ClusterState, node.NodeState]:
    state = _load_state(name)
    if state is None or state.node is None or not _healthy(state):
        raise ClusterError(f"cluster {name!r} is not up with a real node")
    return state, state.node


def stop_policy_enforcer(name: str) -> None:
    """Stop the real node's NetworkPolicy enforcer, and its rules with it, until
    :func:`start_policy_enforcer` (a test proves with this that each drop was the enforcer's)."""
    state, real_node = _real_node(name)
    node.stop_policy_enforcer(real_node, _log)
    _save_state(state)


def start_policy_enforcer(name: str) -> None:
    """Start the real node's NetworkPolicy enforcer again after :func:`stop_policy_enforcer`."""
    state = _load_state(name)
    if state is None or state.node is None:
        raise ClusterError(f"cluster {name!r} is not up with a real node")
    if alive(state.node.pids.get(node.POLICY_ENFORCER)):
        return
    node.start_policy_enforcer(state.node, state_dir(name), kubeconfig_path(name),
                               lambda component, argv: _spawn(component, argv, state_dir(name)))
    _save_state(state)


def _start_controllers(state: ClusterState, root: Path, binaries: dict[str, Path],
                       spawn: Callable[[str, list[str]], int]) -> None:
    """The controller manager and the scheduler, each with its own identity."""
    ports, pki = state.ports, root / "pki"
    state.pids["kube-controller-manager"] = spawn("kube-controller-manager", [
        str(binaries["kube-controller-manager"]),
        *_component_identity_flags(root / "controller-manager.kubeconfig", ports["controller-manager"]),
        "--use-service-account-credentials=true",
        "--service-account-private-key-file", str(pki / "sa.key"),
        "--root-ca-file", str(pki / "ca.crt"),
        "--cluster-signing-cert-file", str(pki / "ca.crt"), "--cluster-signing-key-file", str(pki / "ca.key"),
        "--allocate-node-cidrs=false",
        # No cloud and no node IPAM (the CNI's host-local ranges and kwok hand out pod IPs).
        "--controllers", ",".join(["*", "-node-ipam-controller", "-cloud-node-lifecycle-controller",
                                   "-service-lb-controller", "-node-route-controller"]),
        # The node-lifecycle controller stays: it lifts the node.kubernetes.io/not-ready taint the
        # API server puts on every new node.  A generous grace: on a loaded 2-core machine a late
        # heartbeat (kwok's, or the kubelet's) must not taint the node and evict every pod.
        "--node-monitor-grace-period", "5m",
        "--v", "1",
    ])
    state.pids["kube-scheduler"] = spawn("kube-scheduler", [
        str(binaries["kube-scheduler"]),
        *_component_identity_flags(root / "scheduler.kubeconfig", ports["scheduler"]),
        "--v", "1",
    ])


def _start_fake_nodes(state: ClusterState, kwok_binary: Path, count: int) -> None:
    """kwok and ``count`` fake nodes; beside a real node they carry the fake-node taint, so only
    pods that tolerate it (the tests that need a second node) land there, never by chance."""
    root = state_dir(state.name)
    state.pod_cidr = state.pod_cidr or _choose_pod_cidr(state.name)
    state.fake_nodes = count
    state.pids["kwok"] = _spawn("kwok", kwok.kwok_command(kwok_binary, root / "kwok.kubeconfig", state.pod_cidr,
                                                          root / "kwok"), root)
    _save_state(state)
    _log(f"registering {count} fake nodes")
    manifests = {"apiVersion": "v1", "kind": "List",
                 "items": kwok.node_manifests(count, tainted=state.node is not None)}
    kubectl(state.name, "apply", "-f", "-", input_text=json.dumps(manifests))
    _wait(f"{count} Ready fake nodes", lambda: _ready_nodes(state.name, kwok.NODE_NAME_PREFIX) >= count, state, "kwok")


def _real_nodes(state: ClusterState) -> int:
    return 1 + len(state.node.extra) if state.node is not None else 1


def running_real_nodes(name: str) -> int | None:
    """How many real nodes the cluster ``name`` runs, or None when it is not up with real nodes."""
    state = _load_state(name)
    if state is None or state.node is None or not _healthy(state):
        return None
    return _real_nodes(state)


def _ready_nodes(name: str, prefix: str) -> int:
    proc = kubectl(name, "get", "nodes", "-o", "json", check=False)
    if proc.returncode != 0:
        return 0
    count = 0
    for item in json.loads(proc.stdout).get("items", []):
        if not item["metadata"]["name"].startswith(prefix):
            continue
        for condition in item.get("status", {}).get("conditions", []):
            if condition.get("type") == "Ready" and condition.get("status") == "True":
                count += 1
    return count


def down(name: str = "default", quiet: bool = False, purge: bool = False) -> list[str]:
    """Stop every component (the node first, so it ends its pods) and remove what the node made;
    what could not be removed is returned."""
    state = _load_state(name)
    root = state_dir(name)
    say = (lambda message: None) if quiet else _log
    problems: list[str] = []
    if state is not None:
        if state.node is not None:
            kube_proxy = build.find_binary(build.Binary("kube-proxy", build.KUBERNETES_VERSION))
            problems = node.stop(state.node, root, kube_proxy, say)
        for component in reversed(state.components()):
            pid = state.pids.get(component)
            if pid is not None and alive(pid):
                say(f"stopping {component} (pid {pid})")
                stop_pid(pid)
        if not problems:
            (root / "cluster.json").unlink(missing_ok=True)
    if purge and not problems:
        shutil.rmtree(root, ignore_errors=True)
    elif (root / "etcd").exists():
        # etcd's data is per run: a fresh `up` starts from an empty store.
        shutil.rmtree(root / "etcd", ignore_errors=True)
    say(f"cluster {name!r} is down" + (f", but {len(problems)} things remain (above)" if problems else ""))
    return problems


def leftovers(name: str) -> dict[str, list[str]]:
    """What the cluster's real node left on the machine (empty lists after a clean down)."""
    state = _load_state(name)
    if state is None or state.node is None:
        return {}
    return node.leftovers(state.node, state_dir(name))


def status(name: str = "default") -> dict[str, Any]:
    state = _load_state(name)
    if state is None:
        return {"name": name, "running": False}
    components = {c: {"pid": state.pids.get(c), "alive": alive(state.pids.get(c))} for c in state.components()}
    if state.node is not None:
        components |= {p: {"pid": state.node.pids.get(p), "alive": alive(state.node.pids.get(p))}
                       for p in node.PROCESSES}
        components |= {f"node-{n.index}-{p}": {"pid": n.pids.get(p), "alive": alive(n.pids.get(p))}
                       for n in state.node.extra for p in (node_namespaced.HOLDER, *node_namespaced.PROCESSES)}
    ready = _https_ok(f"{state.apiserver_url}/readyz", state_dir(name))
    report: dict[str, Any] = {
        "name": name, "running": ready, "apiserver": state.apiserver_url,
        "nodeRuntime": state.runtime,
        "kubeconfig": str(kubeconfig_path(name)), "readyNodes": _ready_nodes(name, "") if ready else 0,
        "components": components, "logs": str(state_dir(name) / "logs"),
    }
    if state.pod_cidr:
        report["fakePodCIDR"] = state.pod_cidr
    if state.node is not None:
        net = state.node.network
        report["node"] = {"name": NODE_NAME, "ip": net.gateway, "bridge": net.bridge,
                          "podCIDR": net.pod_cidr, "serviceCIDR": SERVICE_CIDR,
                          "containerdSocket": str(node_containerd.socket_path(node.node_dir(state_dir(name))))}
        report["nodes"] = [{"name": NODE_NAME, "ip": net.gateway, "podCIDR": net.pod_cidr,
                            "state": str(node.node_dir(state_dir(name)))}] + [
            {"name": n.name, "ip": n.address, "podCIDR": n.network.pod_cidr, "networkNamespace": n.netns,
             "state": str(n.base(state_dir(name))), "cache": str(n.cache_dir(state_dir(name)))}
            for n in state.node.extra]
    return report
