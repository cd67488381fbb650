"""`warmpool cluster down` leaves nothing of the real node behind: no process or shim, no mount,
no bridge, no iptables chain, no kubepods cgroup, every sysctl as it was.

It needs a real-node cluster of its own from start to end, and only one real node runs on a
machine at a time, so it is not part of the main session (which shares one cluster across the
suite): `make test` runs it afterwards, `pytest -m node_lifecycle tests/node_lifecycle`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from warmpool_devcluster import cluster, images, node, node_cleanup

pytestmark = pytest.mark.node_lifecycle

REPO = Path(__file__).resolve().parents[2]


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


def test_down_leaves_nothing_of_the_real_node_behind() -> None:
    name = f"lifecycle-{os.getpid()}"
    sysctls_before = node_cleanup.read_sysctls()
    kubeconfig = cluster.up(name, node_runtime="containerd")
    root = cluster.state_dir(name)
    try:
        loaded = images.load(REPO, node.node_dir(root))
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper", "namespace": "default"},
               "spec": {"containers": [{"name": "sleep", "image": loaded["operator"], "imagePullPolicy": "IfNotPresent",
                                        "command": ["python", "-c", "import time; time.sleep(3600)"],
                                        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}],
                        "volumes": [{"name": "scratch", "emptyDir": {"medium": "Memory"}}]}}
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "sleeper", "namespace": "default"},
                   "spec": {"selector": {"app": "none"}, "ports": [{"port": 80}]}}
        cluster.kubectl(name, "apply", "-f", "-", input_text=yaml.safe_dump_all([pod, service]))
        deadline = time.monotonic() + 120
        while cluster.kubectl(name, "get", "pod", "sleeper", "-o", "jsonpath={.status.phase}").stdout != "Running":
            assert time.monotonic() < deadline, "the pod never ran"
            time.sleep(0.5)
        state = json.loads((root / "cluster.json").read_text())
        net = node.NodeState.from_json(state["node"]).network
        # What the node made is there before `down` (so the checks below are not vacuous).
        assert node_cleanup.kubepods_cgroups() and node_cleanup.mounts_under([node.node_dir(root)])
        assert node_cleanup.leftover_kube_chains() and _processes_mentioning(str(root))
    finally:
        problems = cluster.down(name, purge=True)
    assert problems == [], problems
    assert _processes_mentioning(str(root)) == []
    assert node_cleanup.mounts_under([root]) == []
    assert node_cleanup.kubepods_cgroups() == []
    assert node_cleanup.leftover_kube_chains() == []
    rules = "".join(subprocess.run([tool], capture_output=True, text=True).stdout
                    for tool in ("iptables-save", "ip6tables-save"))
    assert net.filter_chain not in rules and net.mangle_chain not in rules and "KUBE-" not in rules, rules[-3000:]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f" {net.bridge}:" not in links and "veth" not in links, links
    assert node_cleanup.read_sysctls() == sysctls_before
    assert not root.exists()
    assert not Path(kubeconfig).exists()
