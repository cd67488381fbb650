"""The real node's kubelet and kube-proxy: their configuration and command lines.

Both are the Kubernetes project's own binaries, built like the control plane (build.py).  The
kubelet runs pods in containerd through CRI, with its own ``system:node:<name>`` client
certificate (the Node authorizer and NodeRestriction then hold it to its own objects) and a
serving certificate the API server verifies; its API authenticates clients by the cluster's CA
and authorizes them through the API server (webhook), as on any production node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from warmpool_devcluster import certs


def node_name(index: int) -> str:
    """The Node name of the cluster's real node ``index`` (0: the host's own, node_namespaced.py the others)."""
    return f"warmpool-node-{index}"


#: Node 0's name, the host's own real node (kwok's fake nodes are named by kwok.NODE_NAME_PREFIX).
NODE_NAME = node_name(0)
KUBELET_PORT = 10250


def kubelet_config(state: Path, pki: Path, node_ip: str, healthz_port: int, socket: Path,
                   serving_cert: str = certs.KUBELET_SERVING, cgroup_root: str = "/") -> dict[str, Any]:
    """A KubeletConfiguration for one node on this machine (cgroup v1, cgroupfs, containerd 1.6);
    a further node has its own serving certificate and cgroup parent (node_namespaced.py)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": f"unix://{socket}",
        "imageServiceEndpoint": f"unix://{socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        # This machine has cgroup v1 only; the kubelet warns that v1 is in maintenance mode.
        "failCgroupV1": False,
        "failSwapOn": False,
        "podLogsDir": str(state / "kubelet" / "pod-logs"),
        # No cluster DNS runs: pods get an empty resolv.conf (in-cluster clients need no DNS; the
        # ``kubernetes`` Service is reached by the KUBERNETES_SERVICE_* variables).
        "resolvConf": str(state / "kubelet" / "resolv.conf"),
        "clusterDomain": "cluster.local",
        # Serving on the node's bridge address only: nothing listens on the machine's other interfaces.
        "address": node_ip,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "tlsCertFile": str(pki / f"{serving_cert}.crt"),
        "tlsPrivateKeyFile": str(pki / f"{serving_cert}.key"),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        # A developer's machine: never evict pods or collect images because its disk looks full.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "imageMinimumGCAge": "1000h",
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "nodefs.inodesFree": "1%",
                         "imagefs.available": "1%"},
        "evictionPressureTransitionPeriod": "30s",
        "serializeImagePulls": False,
        "maxPods": 60,
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        "protectKernelDefaults": False,
        # Faster status than the defaults: tests and the demo wait on pod readiness.
        "nodeStatusUpdateFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        # No CAP_SYS_RESOURCE here: the kubelet cannot lower its own oom_score_adj.
        "oomScoreAdj": 0,
        "containerLogMaxSize": "10Mi",
        "containerLogMaxFiles": 2,
    }


def write_kubelet_files(state: Path, pki: Path, node_ip: str, healthz_port: int, socket: Path,
                        serving_cert: str = certs.KUBELET_SERVING, cgroup_root: str = "/") -> Path:
    directory = state / "kubelet"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "resolv.conf").write_text("")
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(kubelet_config(state, pki, node_ip, healthz_port, socket, serving_cert,
                                                  cgroup_root)))
    return path


def kubelet_argv(binary: Path, config: Path, kubeconfig: Path, root_dir: Path, node_ip: str,
                 node_name: str = NODE_NAME) -> list[str]:
    return [
        str(binary),
        "--config", str(config),
        "--kubeconfig", str(kubeconfig),
        "--root-dir", str(root_dir),
        "--node-ip", node_ip,
        "--hostname-override", node_name,
        "--node-labels", "warmpool.dev/node=real",
        "--v", "1",
    ]


def kube_proxy_argv(binary: Path, kubeconfig: Path, pod_cidr: str, metrics_port: int, healthz_port: int,
                    node_name: str = NODE_NAME) -> list[str]:
    """kube-proxy in iptables mode: the Service ClusterIPs, DNATed to pod IPs on the bridge.

    The conntrack sysctls are left as they are (zeros say "do not set"), and NodePorts are not
    opened on localhost (that would need route_localnet on every interface).
    """
    return [
        str(binary),
        "--kubeconfig", str(kubeconfig),
        "--hostname-override", node_name,
        "--proxy-mode", "iptables",
        "--cluster-cidr", pod_cidr,
        "--conntrack-max-per-core", "0",
        "--conntrack-tcp-timeout-established", "0",
        "--conntrack-tcp-timeout-close-wait", "0",
        "--iptables-localhost-nodeports=false",
        "--metrics-bind-address", f"127.0.0.1:{metrics_port}",
        "--healthz-bind-address", f"127.0.0.1:{healthz_port}",
        "--v", "1",
    ]


def kube_proxy_cleanup_argv(binary: Path) -> list[str]:
    """kube-proxy's own removal of every chain and rule it made (iptables and ip6tables)."""
    return [str(binary), "--cleanup", "--v", "1"]
