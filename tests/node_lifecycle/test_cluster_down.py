"""`warmpool cluster down` leaves nothing of the real nodes behind: no process or shim, no mount,
no bridge, network namespace or veth, no iptables or ip6tables chain, no kubepods cgroup, every
kernel setting as it was, also when the `up` that made the node was killed half way.  On the way,
two real nodes (`up --nodes 2`) serve pods that reach each other across them, each with its own
/var/lib/warmpool.

It needs a real-node cluster of its own from start to end, and only one real node runs on a
machine at a time, so it is not part of the main session (which shares one cluster across the
suite): `make test` runs it afterwards, `pytest -m node_lifecycle tests/node_lifecycle`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from warmpool_devcluster import cluster, images, netpol_enforcer, node, node_cleanup, node_namespaced, node_network

pytestmark = pytest.mark.node_lifecycle

REPO = Path(__file__).resolve().parents[2]
#: The parts of /proc/sys a node could touch; compared whole before `up` and after `down`.
SETTINGS_TREES = ("kernel", "vm", "fs", "user", "net/core", "net/ipv4", "net/ipv6", "net/bridge", "net/netfilter")
#: Entries that are counters or random, not settings: they change by themselves.
VOLATILE = re.compile(r"kernel/(ns_last_pid|random/.*|pty/nr)"
                      r"|fs/(dentry-state|file-nr|inode-nr|inode-state|aio-nr|quota/.*)"
                      r"|net/netfilter/nf_conntrack_count")
#: Host values unlike those the real node sets (the kernel's defaults for root's key quotas, no IP
#: forwarding, bridged traffic not through iptables), so a setting the node leaves behind shows.
UNLIKE_A_NODE = {"kernel.keys.root_maxkeys": "200", "kernel.keys.root_maxbytes": "20000",
                 "net.ipv4.ip_forward": "0", "net.bridge.bridge-nf-call-iptables": "0"}


def _sysctl(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def _settings() -> dict[str, str]:
    """Every readable entry under SETTINGS_TREES but the volatile ones, by path below /proc/sys."""
    found = {}
    for tree in SETTINGS_TREES:
        for directory, _, files in os.walk(Path("/proc/sys") / tree):
            for name in files:
                path = Path(directory) / name
                key = str(path.relative_to("/proc/sys"))
                if VOLATILE.fullmatch(key) or not os.access(path, os.R_OK):
                    continue
                try:
                    found[key] = path.read_text().strip()
                except OSError:
                    continue
    return found


def _changed(before: dict[str, str], after: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Entries in both whose values differ (per-interface entries come and go with interfaces)."""
    return {key: (before[key], after[key]) for key in before.keys() & after.keys() if before[key] != after[key]}


@pytest.fixture()
def host_unlike_a_node() -> Iterator[dict[str, str]]:
    """Give the host the UNLIKE_A_NODE values for the test, and its own back afterwards."""
    original = {name: _sysctl(name).read_text().strip() for name in UNLIKE_A_NODE}
    try:
        for name, value in UNLIKE_A_NODE.items():
            _sysctl(name).write_text(value)
        yield dict(UNLIKE_A_NODE)
    finally:
        for name, value in original.items():
            _sysctl(name).write_text(value)


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in argv:
                found.append(f"{entry.name}: {argv[:200]}")
    return found


def _state_of(pid: int) -> bytes:
    """The process state letter field of /proc/<pid>/stat (b"" once the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1][:3]
    except (OSError, IndexError):
        return b""


def _guard_rules_left(octet: int) -> str:
    rules = "".join(subprocess.run([tool], capture_output=True, text=True).stdout
                    for tool in ("iptables-save", "ip6tables-save"))
    return "\n".join(line for line in rules.splitlines() if re.search(rf"WARMPOOL-[A-Z]+-{octet}\b", line))


def _server_pod(name: str, node_name: str, image: str) -> dict[str, object]:
    """A pod on ``node_name`` serving its own name over HTTP, and writing it to the node's
    /var/lib/warmpool (hostPath, as the node agent's cache)."""
    script = (f"mkdir -p /tmp/srv && echo {name} > /tmp/srv/index.html && echo {name} > /node-cache/{name} "
              "&& cd /tmp/srv && exec python -m http.server 8080")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": node_name,
                     "containers": [{"name": "serve", "image": image, "imagePullPolicy": "IfNotPresent",
                                     "command": ["sh", "-c", script],
                                     # root: the hostPath folder the kubelet makes is root's
                                     "securityContext": {"runAsUser": 0},
                                     "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"},
                                                      {"name": "cache", "mountPath": "/node-cache"}]}],
                     "volumes": [{"name": "scratch", "emptyDir": {"medium": "Memory"}},
                                 {"name": "cache", "hostPath": {"path": "/var/lib/warmpool",
                                                                "type": "DirectoryOrCreate"}}]}}


def _wait_running(name: str, pods: list[str]) -> dict[str, str]:
    """pod -> its IP once every pod in ``pods`` runs."""
    deadline = time.monotonic() + 120
    while True:
        items = json.loads(cluster.kubectl(name, "get", "pods", "-n", "default", "-o", "json").stdout)["items"]
        ips = {p["metadata"]["name"]: p["status"].get("podIP", "") for p in items
               if p["status"].get("phase") == "Running"}
        if all(ips.get(pod) for pod in pods):
            return ips
        assert time.monotonic() < deadline, f"pods never ran: {ips}"
        time.sleep(0.5)


def _fetch_in(name: str, pod: str, url: str) -> str:
    fetch = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read().decode().strip())"
    return cluster.kubectl(name, "exec", pod, "--", "python", "-c", fetch).stdout.strip()


def _check_two_nodes_serve_apart(name: str, root: Path, loaded: dict[str, str]) -> node.NodeState:
    """Pods on node 0 and node 1 reach each other, and each wrote into its own node's cache."""
    state = node.NodeState.from_json(json.loads((root / "cluster.json").read_text())["node"])
    further = state.extra[0]
    images.load(REPO, further.base(root), ["operator"])
    pods = [_server_pod("serve-0", "warmpool-node-0", loaded["operator"]),
            _server_pod("serve-1", further.name, loaded["operator"])]
    cluster.kubectl(name, "apply", "-f", "-", input_text=yaml.safe_dump_all(pods))
    ips = _wait_running(name, ["serve-0", "serve-1"])
    assert ips["serve-0"].startswith(f"10.244.{state.octet}.") and ips["serve-1"].startswith(f"10.244.{further.octet}.")
    assert _fetch_in(name, "serve-0", f"http://{ips['serve-1']}:8080/") == "serve-1"
    assert _fetch_in(name, "serve-1", f"http://{ips['serve-0']}:8080/") == "serve-0"
    # Node 1's /var/lib/warmpool is its own directory; node 0's is the host's.
    assert (further.cache_dir(root) / "serve-1").read_text().strip() == "serve-1"
    assert not (further.cache_dir(root) / "serve-0").exists()
    assert not (node_namespaced.NODE_CACHE_MOUNTPOINT / "serve-1").exists()
    (node_namespaced.NODE_CACHE_MOUNTPOINT / "serve-0").unlink()
    assert node_cleanup.kubepods_cgroups(parent=further.cgroup_parent)
    assert node_namespaced.netns_exists(further.netns)
    return state


def test_two_real_nodes_serve_apart_and_down_leaves_nothing_of_either(host_unlike_a_node: dict[str, str]) -> None:
    name = f"lifecycle-{os.getpid()}"
    settings_before = _settings()
    kubeconfig = cluster.up(name, node_runtime="containerd", nodes=2)
    root = cluster.state_dir(name)
    try:
        loaded = images.load(REPO, node.node_dir(root))
        state = _check_two_nodes_serve_apart(name, root, loaded)
        net = state.network
        # What the node made is there before `down` (so the checks below are not vacuous).
        assert node_cleanup.kubepods_cgroups() and node_cleanup.mounts_under([node.node_dir(root)])
        assert node_cleanup.leftover_kube_chains() and _processes_mentioning(str(root))
        assert len(node_network.guard_present(net)) == 5, node_network.guard_present(net)  # 3 IPv4, 2 IPv6
        # The kubelet and the pod's network changed every one of these host settings.
        now = {name: _sysctl(name).read_text().strip() for name in host_unlike_a_node}
        assert all(now[name] != value for name, value in host_unlike_a_node.items()), now
        # The NetworkPolicy enforcer runs, killed the hard way: it cannot remove its own chain, so
        # `down` must.
        enforcer = state.pids[node.POLICY_ENFORCER]
        os.killpg(enforcer, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{enforcer}").exists() and b"Z" not in _state_of(enforcer):
            assert time.monotonic() < deadline, "the enforcer outlived SIGKILL"
            time.sleep(0.1)
        assert netpol_enforcer.present(net), "the killed enforcer left no chain: nothing for `down` to prove"
    finally:
        problems = cluster.down(name, purge=True)
    assert problems == [], problems
    _assert_nothing_left(root, state)
    assert _changed(settings_before, _settings()) == {}
    assert not root.exists()
    assert not Path(kubeconfig).exists()


def _assert_nothing_left(root: Path, state: node.NodeState) -> None:
    net = state.network
    assert _processes_mentioning(str(root)) == []
    assert node_cleanup.mounts_under([root]) == []
    assert node_cleanup.kubepods_cgroups() == []
    assert node_cleanup.leftover_kube_chains() == []
    rules = "".join(subprocess.run([tool], capture_output=True, text=True).stdout
                    for tool in ("iptables-save", "ip6tables-save"))
    assert "KUBE-" not in rules, rules[-3000:]
    assert _guard_rules_left(net.octet) == "" and node_network.guard_present(net) == []
    assert netpol_enforcer.present(net) == []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f" {net.bridge}:" not in links and "veth" not in links, links
    for further in state.extra:
        assert f" {further.host_link}@" not in links and not node_namespaced.netns_exists(further.netns), links
        assert node_namespaced.leftovers(further, root) == {"processes": [], "cgroups": [], "network": []}


def test_down_after_a_killed_up_restores_the_host(host_unlike_a_node: dict[str, str]) -> None:
    """`up` killed (SIGKILL) once the kubelet has changed the host: `down` still restores every
    setting from the record `up` wrote before changing any, and removes the guard."""
    name = f"lifecycle-killed-{os.getpid()}"
    root = cluster.state_dir(name)
    settings_before = _settings()
    start = f"from warmpool_devcluster import cluster; cluster.up({name!r}, node_runtime='containerd')"
    starter = subprocess.Popen(
        [sys.executable, "-c", start], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        # kernel.keys.root_maxkeys: the kubelet sets it at start (the fixture set the kernel's default).
        while _sysctl("kernel.keys.root_maxkeys").read_text().strip() == host_unlike_a_node["kernel.keys.root_maxkeys"]:
            assert starter.poll() is None, f"`up` ended ({starter.returncode}) before the kubelet changed the host"
            assert time.monotonic() < deadline, "the kubelet never changed the host's settings"
            time.sleep(0.2)
        os.killpg(starter.pid, signal.SIGKILL)
        starter.wait(timeout=10)
        net = node.NodeState.from_json(json.loads((root / "cluster.json").read_text())["node"]).network
        assert node_network.guard_present(net)
    finally:
        if starter.poll() is None:
            os.killpg(starter.pid, signal.SIGKILL)
            starter.wait(timeout=10)
        problems = cluster.down(name, purge=True)
    assert problems == [], problems
    assert _changed(settings_before, _settings()) == {}
    assert _guard_rules_left(net.octet) == ""
    assert _processes_mentioning(str(root)) == []
