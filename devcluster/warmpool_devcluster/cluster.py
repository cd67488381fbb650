"""Start, stop and inspect a real local Kubernetes control plane, bound to 127.0.0.1 only.

Layout of a cluster's state directory (default ``~/.cache/warmpool/clusters/<name>/``):
``pki/`` certificates, ``etcd/`` data, ``logs/<component>.log``, ``kubeconfig`` (admin),
``<component>.kubeconfig``, ``kubelet/`` the local kubelet's work dir, ``cluster.json``
ports and pids.  Every component runs as its own process group so ``down`` can end it
and everything it started.
"""

from __future__ import annotations

import json
import os
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

from warmpool.paths import cache_root
from warmpool_devcluster import build, certs, kwok
from warmpool_devcluster.kubelet import kill_leftovers
from warmpool_devcluster.processes import alive, free_port, stop_pid

#: Pod IPs are loopback addresses (127.N.0.0/16): nothing in tests may dial a private range.
#: Each live cluster on the machine gets its own N, so two clusters never hand out one IP.
POD_CIDR_SECOND_OCTETS = range(10, 250)
#: The API server insists on a service range; we never dial a ClusterIP (traffic stays on loopback).
SERVICE_CIDR = "10.96.0.0/16"
DEFAULT_NODES = 2
READY_TIMEOUT_S = 120.0

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kubelet")


class ClusterError(RuntimeError):
    """The cluster could not be started or is unhealthy; the message says which part and why."""


@dataclass
class ClusterState:
    name: str
    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    pod_cidr: str = ""


def clusters_root() -> Path:
    return cache_root() / "clusters"


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
                        pod_cidr=data.get("pod_cidr", ""))


def _choose_pod_cidr(name: str) -> str:
    """The first 127.N.0.0/16 that no other live cluster on this machine uses."""
    taken = set()
    if clusters_root().exists():
        for other in clusters_root().iterdir():
            state = _load_state(other.name) if other.name != name else None
            if state is not None and any(alive(pid) for pid in state.pids.values()):
                taken.add(state.pod_cidr)
    for octet in POD_CIDR_SECOND_OCTETS:
        cidr = f"127.{octet}.0.0/16"
        if cidr not in taken:
            return cidr
    raise ClusterError("every loopback pod range 127.10-249.0.0/16 is taken by a running cluster")


def _save_state(state: ClusterState) -> None:
    path = state_dir(state.name) / "cluster.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2))
    tmp.replace(path)




def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True




def _choose_ports(requested_apiserver_port: int | None) -> dict[str, int]:
    ports = {
        "etcd-client": free_port(),
        "etcd-peer": free_port(),
        "apiserver": requested_apiserver_port or free_port(),
        "controller-manager": free_port(),
        "scheduler": free_port(),
    }
    if len(set(ports.values())) != len(ports):  # the kernel may hand out a port twice
        return _choose_ports(requested_apiserver_port)
    for purpose, port in ports.items():
        if not _port_free(port):
            raise ClusterError(f"port {port} on 127.0.0.1 (for {purpose}) is already in use; "
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


def _write_kubeconfigs(root: Path, apiserver_port: int) -> None:
    server = f"https://127.0.0.1:{apiserver_port}"
    for identity in certs.IDENTITIES:
        target = root / ("kubeconfig" if identity.file_stem == "admin" else f"{identity.file_stem}.kubeconfig")
        target.write_text(yaml.safe_dump(_kubeconfig(server, root / "pki", identity.file_stem)))
        target.chmod(0o600)


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


def is_healthy(name: str) -> bool:
    state = _load_state(name)
    if state is None or not all(alive(state.pids.get(c)) for c in COMPONENTS):
        return False
    return _https_ok(f"https://127.0.0.1:{state.ports['apiserver']}/readyz", state_dir(name))


def up(name: str = "default", nodes: int = DEFAULT_NODES, apiserver_port: int | None = None) -> Path:
    """Start the cluster (or find it already running) and return its admin kubeconfig path."""
    if is_healthy(name):
        _log(f"cluster {name!r} is already up")
        return kubeconfig_path(name)
    down(name, quiet=True)  # a half-started cluster: clear it before starting afresh
    try:
        return _start(name, nodes, apiserver_port)
    except BaseException:
        # Never leave half a control plane running after a failed (or interrupted) start.
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


def _apiserver_argv(binary: Path, root: Path, ports: dict[str, int]) -> list[str]:
    pki = root / "pki"
    etcd_url = f"http://127.0.0.1:{ports['etcd-client']}"
    return [
        str(binary),
        "--etcd-servers", etcd_url,
        "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
        "--secure-port", str(ports["apiserver"]),
        "--tls-cert-file", str(pki / "apiserver.crt"), "--tls-private-key-file", str(pki / "apiserver.key"),
        "--client-ca-file", str(pki / "ca.crt"),
        "--authorization-mode", "Node,RBAC",
        "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
        "--service-account-key-file", str(pki / "sa.pub"),
        "--service-account-signing-key-file", str(pki / "sa.key"),
        "--service-cluster-ip-range", SERVICE_CIDR,
        # Loopback addresses cannot be endpoints; nothing reconciles the kubernetes Service.
        "--endpoint-reconciler-type", "none",
        "--allow-privileged=true",
        "--enable-admission-plugins", "NodeRestriction",
        "--profiling=false", "--v", "1",
    ]


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
    state.pids["kube-apiserver"] = _spawn(
        "kube-apiserver", _apiserver_argv(binaries["kube-apiserver"], root, state.ports), root)
    _save_state(state)
    _log(f"kube-apiserver restarting on https://127.0.0.1:{state.ports['apiserver']}")
    _wait("kube-apiserver /readyz",
          lambda: _https_ok(f"https://127.0.0.1:{state.ports['apiserver']}/readyz", root), state, "kube-apiserver")


def _start(name: str, nodes: int, apiserver_port: int | None) -> Path:
    started = time.monotonic()
    binaries = build.ensure_binaries(["etcd", "kube-apiserver", "kube-controller-manager",
                                      "kube-scheduler", "kubectl", "kwok"])
    root = state_dir(name)
    root.mkdir(parents=True, exist_ok=True)
    certs.generate_pki(root / "pki")
    pki = root / "pki"
    state = ClusterState(name=name, ports=_choose_ports(apiserver_port), pod_cidr=_choose_pod_cidr(name))
    _write_kubeconfigs(root, state.ports["apiserver"])
    ports = state.ports

    etcd_url = f"http://127.0.0.1:{ports['etcd-client']}"
    peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
    state.pids["etcd"] = _spawn("etcd", [
        str(binaries["etcd"]), "--name", "warmpool", "--data-dir", str(root / "etcd"),
        "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"warmpool={peer_url}", "--listen-metrics-urls", "",
        # A throwaway test store: skipping fsync makes the control plane several times faster.
        "--unsafe-no-fsync", "--quota-backend-bytes", str(2 * 1024**3), "--log-level", "warn",
    ], root)
    _save_state(state)
    _log("etcd starting")
    _wait("etcd health", lambda: _http_ok(f"{etcd_url}/health"), state, "etcd", 60)

    state.pids["kube-apiserver"] = _spawn(
        "kube-apiserver", _apiserver_argv(binaries["kube-apiserver"], root, ports), root)
    _save_state(state)
    _log(f"kube-apiserver starting on https://127.0.0.1:{ports['apiserver']}")
    _wait("kube-apiserver /readyz",
          lambda: _https_ok(f"https://127.0.0.1:{ports['apiserver']}/readyz", root), state, "kube-apiserver")

    state.pids["kube-controller-manager"] = _spawn("kube-controller-manager", [
        str(binaries["kube-controller-manager"]),
        *_component_identity_flags(root / "controller-manager.kubeconfig", ports["controller-manager"]),
        "--use-service-account-credentials=true",
        "--service-account-private-key-file", str(pki / "sa.key"),
        "--root-ca-file", str(pki / "ca.crt"),
        "--cluster-signing-cert-file", str(pki / "ca.crt"), "--cluster-signing-key-file", str(pki / "ca.key"),
        "--allocate-node-cidrs=false",
        # No cloud and no node IPAM (a node podCIDR would override kwok's loopback range).
        "--controllers", ",".join(["*", "-node-ipam-controller", "-cloud-node-lifecycle-controller",
                                   "-service-lb-controller", "-node-route-controller"]),
        # The node-lifecycle controller stays: it lifts the node.kubernetes.io/not-ready taint the
        # API server puts on every new node (without it nothing schedules on a fresh cluster).
        # But the fake nodes cannot fail, and on a loaded machine a late kwok heartbeat made it
        # mark every pod NotReady (and taint and evict them) while the local kubelet, the only
        # source of truth for containers, saw them healthy: give heartbeats an hour.
        "--node-monitor-grace-period", "1h",
        "--v", "1",
    ], root)
    state.pids["kube-scheduler"] = _spawn("kube-scheduler", [
        str(binaries["kube-scheduler"]),
        *_component_identity_flags(root / "scheduler.kubeconfig", ports["scheduler"]),
        "--v", "1",
    ], root)
    state.pids["kwok"] = _spawn("kwok", kwok.kwok_command(
        binaries["kwok"], root / "kubelet.kubeconfig", state.pod_cidr, root / "kwok"), root)
    kubelet_env = dict(os.environ)
    kubelet_env["PYTHONUNBUFFERED"] = "1"
    # Pod commands such as `warmpool worker serve` resolve against this Python's scripts.
    kubelet_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), kubelet_env.get("PATH", "")])
    state.pids["kubelet"] = _spawn("kubelet", [
        sys.executable, "-m", "warmpool_devcluster.kubelet",
        "--kubeconfig", str(root / "kubelet.kubeconfig"), "--work-dir", str(root / "kubelet"),
    ], root, env=kubelet_env)
    _save_state(state)

    _log(f"registering {nodes} fake nodes")
    manifests = {"apiVersion": "v1", "kind": "List", "items": kwok.node_manifests(nodes)}
    kubectl(name, "apply", "-f", "-", input_text=json.dumps(manifests))
    _wait(f"{nodes} Ready nodes", lambda: _ready_nodes(name) >= nodes, state, "kwok")
    _wait("the default service account", lambda: kubectl(
        name, "get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0,
        state, "kube-controller-manager")
    _log(f"cluster {name!r} is up in {time.monotonic() - started:.1f}s; "
         f"kubeconfig: {kubeconfig_path(name)}")
    return kubeconfig_path(name)


def _ready_nodes(name: str) -> int:
    proc = kubectl(name, "get", "nodes", "-o", "json", check=False)
    if proc.returncode != 0:
        return 0
    count = 0
    for node in json.loads(proc.stdout).get("items", []):
        for condition in node.get("status", {}).get("conditions", []):
            if condition.get("type") == "Ready" and condition.get("status") == "True":
                count += 1
    return count




def down(name: str = "default", quiet: bool = False, purge: bool = False) -> None:
    """Stop every component (kubelet first, so it ends its pods' processes) and leftovers."""
    state = _load_state(name)
    root = state_dir(name)
    if state is not None:
        for component in reversed(COMPONENTS):
            pid = state.pids.get(component)
            if pid is not None and alive(pid):
                if not quiet:
                    _log(f"stopping {component} (pid {pid})")
                stop_pid(pid)
        (root / "cluster.json").unlink(missing_ok=True)
    leftovers = kill_leftovers(root / "kubelet") if (root / "kubelet").exists() else 0
    if leftovers and not quiet:
        _log(f"ended {leftovers} leftover pod processes")
    if purge:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    elif (root / "etcd").exists():
        # etcd's data is per run: a fresh `up` starts from an empty store.
        import shutil

        shutil.rmtree(root / "etcd", ignore_errors=True)
    if not quiet:
        _log(f"cluster {name!r} is down")


def status(name: str = "default") -> dict[str, Any]:
    state = _load_state(name)
    if state is None:
        return {"name": name, "running": False}
    components = {c: {"pid": state.pids.get(c), "alive": alive(state.pids.get(c))} for c in COMPONENTS}
    ready = _https_ok(f"https://127.0.0.1:{state.ports['apiserver']}/readyz", state_dir(name))
    return {"name": name, "running": ready, "apiserver": f"https://127.0.0.1:{state.ports['apiserver']}",
            "podCIDR": state.pod_cidr,
            "kubeconfig": str(kubeconfig_path(name)), "readyNodes": _ready_nodes(name) if ready else 0,
            "components": components, "logs": str(state_dir(name) / "logs")}
