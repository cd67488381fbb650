"""What the node agent's integration tests share (http and s3 sources): the agent as a process,
an operator that mounts the test's cache root, and the checks on the cache and the WarmModel.

The agents run as processes of this machine, beside the local cluster's real node: a pod's
hostPath is a directory of this machine, so the operator is told the test's cache root
(--block-cache-root) and each pod is pinned to the node (nodeSelector) whose agent the test
runs.  The second node is the session's second real node, tainted so nothing is scheduled there:
an agent may claim it, and the pods these tests bind there by name use an image no registry
serves, so no container of theirs runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from warmpool_devcluster import node_kubelet

from tests.support.e2e import ClusterLike, Operator, World
from warmpool.contract.api import PLURAL
from warmpool.contract.files import MANIFEST_FILENAME
from warmpool.contract.nodecache import CACHE_NODE_LABEL_PREFIX, FILL_PROGRESS_NAME

#: The local cluster's real node, where the agent tests' pods run.
NODE = node_kubelet.NODE_NAME
#: The test session's second real node (tainted: nothing is scheduled there unless it tolerates that).
OTHER_NODE = node_kubelet.node_name(1)


#: The tests' sources (Range servers, SeaweedFS) listen on 127.0.0.1, which an agent refuses by
#: default; the rest of loopback stays refused (a test's stand-in for an internal endpoint).
LOOPBACK_SOURCES = ("--source-allow-network", "127.0.0.1/32")


class Agent:
    """One `warmpool node-agent` process (SIGTERM on stop; its log appended to ``log``)."""

    def __init__(self, cluster: ClusterLike, namespace: str, node: str, root: Path, log: Path,
                 budget_bytes: int | None = None, interval_s: float = 5, extra: tuple[str, ...] = ()) -> None:
        budget = ["--budget-bytes", str(budget_bytes)] if budget_bytes is not None else []
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "warmpool", "node-agent", "--node-name", node, "--cache-root", str(root),
                 "--namespace", namespace, "--lease-namespace", namespace, "--interval", f"{interval_s:g}",
                 "--lease-duration", "3", *budget, *LOOPBACK_SOURCES, *extra],
                env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONUNBUFFERED": "1"},
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def cache_world(cluster: ClusterLike, namespace: str, tmp_path: Path,
                nodes: Iterable[str] = (NODE, OTHER_NODE)) -> Iterator[World]:
    """An operator whose pods mount ``tmp_path/cache``; afterwards the WarmModels, the operator and
    the cache labels the agents put on ``nodes`` (the nodes outlive the test) are gone."""
    cache = tmp_path / "cache"
    operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False, heat_write_interval=2,
                        extra_args=(f"--allowed-host-path={tmp_path}", f"--block-cache-root={cache}"))
    operator.start()
    world = World(cluster, namespace, operator, diagnose_timeouts=True)
    try:
        yield world
    finally:
        cluster.kubectl("-n", namespace, "delete", PLURAL, "--all", "--timeout=60s", check=False)
        operator.stop()
        world.close()
        for node in nodes:
            drop_cache_labels(cluster, node)


def drop_cache_labels(cluster: ClusterLike, node: str) -> None:
    labels = cluster.kubectl("get", "node", node, "-o", "jsonpath={.metadata.labels}", check=False).stdout
    for key in [k for k in labels.replace('"', " ").split() if k.startswith(CACHE_NODE_LABEL_PREFIX)]:
        cluster.kubectl("label", "node", node, f"{key}-", check=False)


@contextlib.contextmanager
def agent_processes(tmp_path: Path) -> Iterator[list[Agent]]:
    """The agents a test starts (appended to the list), stopped afterwards; their logs printed."""
    started: list[Agent] = []
    try:
        yield started
    finally:
        for agent in started:
            agent.stop()
        for log in sorted(tmp_path.glob("agent-*.log")):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}")


def cache_entry(world: World, name: str, node: str) -> dict[str, Any] | None:
    """``node``'s entry in the WarmModel's status.cacheNodes, or None."""
    for entry in (world.wm(name).get("status") or {}).get("cacheNodes") or []:
        if entry["node"] == node:
            return dict(entry)
    return None


def assert_files_identical(revision: Path, model: Path) -> None:
    """The published revision holds exactly the model's files (less the manifest), byte for byte;
    a revision filled as a partial view keeps its fill's progress record beside them."""
    names = sorted(p.relative_to(model).as_posix() for p in model.rglob("*")
                   if p.is_file() and p.name != MANIFEST_FILENAME)
    held = sorted(p.relative_to(revision).as_posix() for p in revision.rglob("*")
                  if p.is_file() and p.name != FILL_PROGRESS_NAME)
    assert held == names
    for name in names:
        assert (revision / name).read_bytes() == (model / name).read_bytes(), name


def node_has_label(world: World, node: str, label: str) -> bool:
    labels = world.cluster.kubectl("get", "node", node, "-o", "jsonpath={.metadata.labels}").stdout
    return f'"{label}"' in labels
