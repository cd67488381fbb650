"""`warmpool demo --object-store`: the demo's model served from a real object store.

SeaweedFS starts beside the demo cluster, on loopback, with fresh credentials (the same store
as `warmpool cluster up --with-object-store`; its first use builds ``weed``: long).  The model
is pushed there by `warmpool model push`, as a user would; a `warmpool node-agent` process
fills node ``warmpool-node-0``'s cache from the bucket under its fill Lease; the WarmModel
names the bucket (``spec.model.s3``) and a Secret with the credentials, and its pods run on
that node and map the revision the agent published.  The fill's progress is read from
``status.cacheNodes``, where the agent reports it.

The store and the agent stay up with the cluster; `warmpool demo --down` stops them.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from warmpool.contract.files import S3_SECRET_ACCESS_KEY_ID_KEY, S3_SECRET_SECRET_ACCESS_KEY_KEY
from warmpool_dev.paths import cache_root

#: The local cluster's real node, whose cache the demo's agent fills (the pods are pinned to it).
NODE = "warmpool-node-0"
SECRET = "demo-models-s3"
#: Where in the bucket the demo's model goes.
PREFIX = "smollm2-135m-instruct"
PUSH_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ObjectStore:
    endpoint: str
    bucket: str
    credentials_file: Path
    key_id: str
    secret: str = field(repr=False)


def state_dir() -> Path:
    return cache_root() / "demo"


def agent_pid_file() -> Path:
    return state_dir() / "node-agent.pid"


def node_cache_root() -> Path:
    """The demo node's cache: a directory of this machine, which the real node's pods mount by hostPath."""
    return state_dir() / "node-cache"


def store_dir(cluster_name: str) -> Path:
    from warmpool_devcluster.cli import object_store_dir

    return object_store_dir(cluster_name)


def start_store(cluster_name: str) -> ObjectStore:
    from warmpool_devcluster import seaweedfs
    from warmpool_nodecache.s3 import credentials_from_file

    urls = seaweedfs.ensure_recorded(store_dir(cluster_name))
    credentials = credentials_from_file(Path(urls["credentials"]))
    return ObjectStore(urls["s3"], urls["bucket"], Path(urls["credentials"]), credentials.access_key_id,
                       credentials.secret_access_key)


def stop_store(cluster_name: str) -> None:
    from warmpool_devcluster import seaweedfs

    seaweedfs.stop_recorded(store_dir(cluster_name))


def push(store: ObjectStore, model_dir: Path) -> str:
    """`warmpool model push` as a user runs it (its progress on stderr); the revision's digest."""
    done = subprocess.run(
        [sys.executable, "-m", "warmpool", "model", "push", str(model_dir), f"s3://{store.bucket}/{PREFIX}",
         "--endpoint", store.endpoint, "--credentials-file", str(store.credentials_file)],
        stdout=subprocess.PIPE, text=True, timeout=PUSH_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"warmpool model push failed (exit {done.returncode}): see its message above")
    return done.stdout.strip()


def secret_manifest(store: ObjectStore, namespace: str) -> str:
    """The credentials Secret (applied through stdin: never on a command line)."""
    def encode(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": SECRET, "namespace": namespace},
        "data": {S3_SECRET_ACCESS_KEY_ID_KEY: encode(store.key_id),
                 S3_SECRET_SECRET_ACCESS_KEY_KEY: encode(store.secret)},
    })


def from_store(body: dict[str, Any], store: ObjectStore) -> dict[str, Any]:
    """The example WarmModel with its model read from the bucket instead of a node directory."""
    model = body["spec"]["model"]
    model.pop("nodeCache", None)
    model["s3"] = {"endpoint": store.endpoint, "bucket": store.bucket, "prefix": PREFIX,
                   "secretRef": {"name": SECRET}}
    body["spec"].setdefault("pod", {}).setdefault("nodeSelector", {})["kubernetes.io/hostname"] = NODE
    return body


def start_agent(kubeconfig: Path, namespace: str, log_path: Path) -> subprocess.Popen[bytes]:
    node_cache_root().mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmpool", "node-agent", "--node-name", NODE,
             "--cache-root", str(node_cache_root()), "--namespace", namespace, "--lease-namespace", namespace,
             "--interval", "2",
             # The demo's store listens on loopback, which the agent refuses for sources by default.
             "--source-allow-network", "127.0.0.1/32"],
            env=dict(os.environ, KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1"),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    agent_pid_file().parent.mkdir(parents=True, exist_ok=True)
    agent_pid_file().write_text(str(proc.pid))
    return proc


def stop_agent() -> None:
    pid_file = agent_pid_file()
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(pid_file.read_text()), signal.SIGTERM)
        pid_file.unlink(missing_ok=True)


def fill_line(status: dict[str, Any]) -> str:
    """The agents' progress from status.cacheNodes, one node per part."""
    parts = []
    for entry in status.get("cacheNodes") or []:
        total = int(entry.get("bytesTotal") or 0)
        cached = int(entry.get("bytesCached") or 0)
        share = f" ({100 * cached / total:.0f} %)" if total else ""
        state = "published" if entry.get("published") else (entry.get("message") or "filling")
        parts.append(f"{entry.get('node')}: {cached >> 20}/{total >> 20} MiB{share}, {state}")
    return "; ".join(parts) or "no node agent has reported yet"


def wait_filled(read_status: Callable[[], dict[str, Any]], say: Callable[[str], None], agent: subprocess.Popen[bytes],
                timeout: float) -> None:
    """Until the demo node's agent has published the revision, its progress shown as it moves."""
    started = time.monotonic()
    deadline = started + timeout
    last = ""
    while time.monotonic() < deadline:
        status = read_status()
        line = fill_line(status)
        if line != last:
            say(f"+{time.monotonic() - started:5.1f}s node cache: {line}")
            last = line
        if any(e.get("node") == NODE and e.get("published") for e in status.get("cacheNodes") or []):
            return
        if agent.poll() is not None:
            raise RuntimeError(f"the node agent exited (code {agent.returncode}): see its log")
        time.sleep(0.5)
    raise RuntimeError(f"the node agent did not publish the revision within {timeout:.0f}s ({last})")
