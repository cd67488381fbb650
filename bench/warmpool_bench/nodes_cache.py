"""`bench nodes`' cache scene: where the node caches send a pool's pods, on two real nodes.

SeaweedFS runs on node 0's bridge address (the S3 gateway published to the pods of every node); the
model is pushed there with `warmpool model push`.  The project's chart is installed in a namespace of
the scene's own: the operator (in a pod, watching that namespace only) and the node agent's
DaemonSet on both nodes, its cache under ``/var/lib/warmpool``, which each node has of its own (a
mount namespace per node).  A WarmModel reads the pushed model from the store; then:

1. **first pod**: no node holds the revision; the agent of the node the pod lands on fills it from
   S3 before the worker starts.  Scale request -> Ready.
2. **cached placements**: the pool grows by one pod, ``CACHED_PLACEMENTS`` times.  Each new pod must
   land on the node that holds the revision (its agent's label; the pods prefer it), and starts
   from the cache.
3. **the other node**: the cached node tainted (NoSchedule), one more pod; the other node's agent fills its own
   cache from S3 before the worker starts.  Both nodes then report the revision in
   ``status.cacheNodes``, each from its own directory.

Recorded: each start (the scale request -> the new pod Ready, polled), its node, and the ratio of a
cached start to the uncached one on the other node.  Only the nodes' pods, node 0's bridge address
and loopback are dialled.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from warmpool.contract.api import API_GROUP_VERSION, KIND, PLURAL
from warmpool.contract.files import S3_SECRET_ACCESS_KEY_ID_KEY, S3_SECRET_SECRET_ACCESS_KEY_KEY
from warmpool.contract.nodecache import CACHE_NODE_LABEL_PREFIX, CACHE_REVISIONS_DIR
from warmpool.contract.pods import LABEL_MODEL
from warmpool_bench.stats import median, ratio

POOL = "cached"
SECRET = "models-s3"
#: Pods added one at a time while the revision is on one node only: each must land there.
CACHED_PLACEMENTS = 2
#: The chart's operator and agents on this 2-core machine: small requests, quick passes.
CHART_TIMEOUT_S = 300
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "warmpool"
CRD_NAME = f"{PLURAL}.warmpool.dev"
SAMPLE_S = 0.2
#: Keeps the scene's next pod off the node that holds the revision.
HOLD_TAINT = "warmpool.dev/bench-hold=true:NoSchedule"


def _say(message: str) -> None:
    print(f"[bench nodes] {message}", file=sys.stderr, flush=True)


def _conditions(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list((pod.get("status") or {}).get("conditions") or [])


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in _conditions(pod))


class CacheScene:
    """The chart, the store and the pool of the scene; :meth:`close` removes them all."""

    def __init__(self, cluster: Any, work: Path, namespace: str, tiny: bool, timeout_s: float) -> None:
        self.cluster, self.work, self.ns, self.tiny, self.timeout_s = cluster, work, namespace, tiny, timeout_s
        self.release = namespace
        #: Under /var/lib/warmpool, which each node has of its own.
        self.cache_root = Path("/var/lib/warmpool") / namespace / "cache"
        self.store: Any = None
        self.installed = False

    # -- the cluster side -------------------------------------------------------------------------
    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        proc: subprocess.CompletedProcess[str] = self.cluster.kubectl(*args, check=check, input=stdin,
                                                                     timeout=CHART_TIMEOUT_S)
        return proc

    def helm(self, *args: str) -> str:
        from warmpool_dev.demo_install import helm

        return helm(self.cluster.kubeconfig, *args, timeout=CHART_TIMEOUT_S + 60)

    def pods(self) -> list[dict[str, Any]]:
        out = self.kubectl("-n", self.ns, "get", "pods", "-l", f"{LABEL_MODEL}={POOL}", "-o", "json").stdout
        return list(json.loads(out)["items"])

    def warmmodel(self) -> dict[str, Any]:
        return dict(json.loads(self.kubectl("-n", self.ns, "get", PLURAL, POOL, "-o", "json").stdout))

    def wait(self, check: Any, what: str) -> Any:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(SAMPLE_S)
        pods = "\n".join(f"{p['metadata']['name']} on {p['spec'].get('nodeName')}: {p['status'].get('phase')}, "
                         f"{[(c['type'], c['status'], c.get('message', '')) for c in _conditions(p)]}"
                         for p in self.pods())
        logs = {component: self.kubectl("-n", self.ns, "logs", "-l", f"app.kubernetes.io/component={component}",
                                        "--tail=20", check=False).stdout[-2500:]
                for component in ("node-agent", "operator")}
        raise RuntimeError(f"timed out waiting for {what}; the pool's pods:\n{pods}\nthe agents' last lines:\n"
                           f"{logs['node-agent']}\nthe operator's:\n{logs['operator']}")

    # -- set-up -----------------------------------------------------------------------------------
    def start(self, model: Path) -> None:
        from warmpool_devcluster.seaweedfs import start_seaweedfs

        self.store = start_seaweedfs(self.work / "seaweedfs", address=self.cluster.node.gateway)
        digest = self._push(model)
        _say(f"cache: pushed {model.name} to {self.store.endpoint} as {digest}")
        self.kubectl("create", "namespace", self.ns)
        self._install()
        self._secret()
        self.kubectl("apply", "-n", self.ns, "-f", "-", stdin=json.dumps(self._manifest()))

    def _push(self, model: Path) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "warmpool", "model", "push", str(model), f"s3://{self.store.bucket}/{POOL}",
             "--endpoint", self.store.endpoint, "--credentials-file", str(self.store.credentials_file)],
            capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"`warmpool model push` failed ({done.returncode}): {done.stderr[-1500:]}")
        return done.stdout.strip()

    def _values(self) -> dict[str, Any]:
        from warmpool_devcluster.chart_values import local_values
        from warmpool_devcluster.node_network import SERVICE_CIDR

        cidrs = list(self.cluster.pod_cidrs)
        values = local_values(self.cluster.images, cidrs[0])
        values["watch"] = {"namespaces": [self.ns]}
        values["operator"] = {**values["operator"], "replicas": 1, "scrapeInterval": 2, "scrapeNetworks": cidrs,
                              "allowedHostPaths": [str(self.cache_root)]}
        values["resources"] = {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
        values["activator"] = {"enabled": False}
        values["nodeAgent"] = {"enabled": True, "cacheRoot": str(self.cache_root), "interval": 2,
                               "leaseDuration": 5, "clusterNetworks": [*cidrs, SERVICE_CIDR],
                               "sourceAllowNetworks": [f"{self.cluster.node.gateway}/32"],
                               "secretNamespaces": [self.ns]}
        return values

    def _install(self) -> None:
        # The CRD applied earlier with kubectl is handed to this release, as Helm adopts an object
        # (docs/runbooks/upgrading.md); the chart keeps it at uninstall.
        if self.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0:
            self.kubectl("label", "crd", CRD_NAME, "app.kubernetes.io/managed-by=Helm", "--overwrite")
            self.kubectl("annotate", "crd", CRD_NAME, f"meta.helm.sh/release-name={self.release}",
                         f"meta.helm.sh/release-namespace={self.ns}", "--overwrite")
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="bench-nodes-values-") as handle:
            yaml.safe_dump(self._values(), handle)
            handle.flush()
            self.helm("install", self.release, str(CHART), "-n", self.ns, "-f", handle.name, "--wait",
                      "--timeout", f"{CHART_TIMEOUT_S}s")
        self.installed = True

        def agents_ready() -> bool:
            out = self.kubectl("-n", self.ns, "get", "pods", "-l", "app.kubernetes.io/component=node-agent",
                               "-o", "json").stdout
            pods = json.loads(out)["items"]
            return len(pods) == len(self.cluster.pod_cidrs) and all(_ready(p) for p in pods)

        # (helm's --wait does not wait for a DaemonSet's pods to be Ready)
        self.wait(agents_ready, "a Ready node agent on every node")

    def _secret(self) -> None:
        def encode(text: str) -> str:
            return base64.b64encode(text.encode()).decode()

        body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": self.ns},
                "type": "Opaque", "data": {S3_SECRET_ACCESS_KEY_ID_KEY: encode(self.store.access_key_id),
                                           S3_SECRET_SECRET_ACCESS_KEY_KEY: encode(self.store.secret_access_key)}}
        self.kubectl("apply", "-f", "-", stdin=json.dumps(body))  # stdin: never on a command line

    def _manifest(self) -> dict[str, Any]:
        args = ["--device=cpu", *(["--prompts-per-bucket=1", "--decode-tokens=2"] if self.tiny else [])]
        return {"apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": POOL, "namespace": self.ns},
                "spec": {"model": {"s3": {"endpoint": self.store.endpoint, "bucket": self.store.bucket,
                                          "prefix": POOL, "secretRef": {"name": SECRET}}, "revision": "r1"},
                         "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": CACHED_PLACEMENTS + 2},
                         "warmup": {"buckets": [16, 32], "timeoutSeconds": 300},
                         "pod": {"workerArgs": args, "drainSeconds": 0}}}

    # -- the placements ---------------------------------------------------------------------------
    def grow_to(self, count: int) -> dict[str, Any]:
        """Scale the pool to ``count`` pods: the new pod's node, and seconds until it is Ready."""
        before = {p["metadata"]["uid"] for p in self.pods()}
        started = time.monotonic()
        patch = {"spec": {"pool": {"replicas": count, "minWarm": count}}}
        self.kubectl("-n", self.ns, "patch", PLURAL, POOL, "--type=merge", "-p", json.dumps(patch))

        def new_ready() -> dict[str, Any] | None:
            fresh = [p for p in self.pods() if p["metadata"]["uid"] not in before and _ready(p)]
            return fresh[0] if fresh else None

        pod = self.wait(new_ready, f"a new Ready pod of the pool at {count}")
        seconds = time.monotonic() - started
        return {"pod": pod["metadata"]["name"], "node": pod["spec"]["nodeName"], "seconds": round(seconds, 2)}

    def first_pod(self) -> dict[str, Any]:
        started = time.monotonic()
        pod = self.wait(lambda: next((p for p in self.pods() if _ready(p)), None), "the pool's first Ready pod")
        return {"pod": pod["metadata"]["name"], "node": pod["spec"]["nodeName"],
                "seconds": round(time.monotonic() - started, 2)}

    def cache_nodes(self) -> list[dict[str, Any]]:
        entries = (self.warmmodel().get("status") or {}).get("cacheNodes") or []
        return [{k: e.get(k) for k in ("node", "revision", "published", "bytesCached", "bytesTotal", "path")}
                for e in entries]

    def node_copy(self, node_name: str, revision: str) -> Path:
        """Where ``node_name``'s own cache holds ``revision``, as this machine sees that directory."""
        from warmpool_devcluster import cluster, node

        hex_digest = revision.removeprefix("sha256:")
        relative = self.cache_root.relative_to("/var/lib/warmpool") / CACHE_REVISIONS_DIR / hex_digest
        root = cluster.state_dir(self.cluster.name)
        for further in node.NodeState.from_json(json.loads((root / "cluster.json").read_text())["node"]).extra:
            if further.name == node_name:
                return further.cache_dir(root) / relative
        return self.cache_root / CACHE_REVISIONS_DIR / hex_digest

    # -- clean-up ---------------------------------------------------------------------------------
    def close(self) -> None:
        """The WarmModel while the chart's operator runs (it holds the finalizer), the release, the
        namespace, the nodes' labels and cache directories, the store."""
        try:
            if self.installed:
                self.kubectl("-n", self.ns, "delete", PLURAL, "--all", "--timeout=120s", check=False)
                with_timeout = ("uninstall", self.release, "-n", self.ns, "--wait", "--timeout", "120s")
                try:
                    self.helm(*with_timeout)
                except RuntimeError as error:
                    _say(f"cache: helm uninstall: {error}")
            self.kubectl("delete", "namespace", self.ns, "--ignore-not-found", "--timeout=120s", check=False)
            for name, labels in _real_nodes(self).items():
                for key in labels:
                    if key.startswith(CACHE_NODE_LABEL_PREFIX):
                        self.kubectl("label", "node", name, f"{key}-", check=False)
            self._remove_cache_dirs()
        finally:
            if self.store is not None:
                self.store.stop()

    def _remove_cache_dirs(self) -> None:
        from warmpool_devcluster import cluster, node

        top = self.cache_root.parent  # /var/lib/warmpool/<namespace>
        dirs = [top]
        root = cluster.state_dir(self.cluster.name)
        if (root / "cluster.json").is_file():
            state = node.NodeState.from_json(json.loads((root / "cluster.json").read_text())["node"])
            dirs += [f.cache_dir(root) / top.relative_to("/var/lib/warmpool") for f in state.extra]
        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)


def cache_scene(bench: Any, settings: Any, model: Path) -> dict[str, Any]:
    """The scene's figures (see the module's docstring); everything it made is removed after."""
    scene = CacheScene(bench.cluster, settings.work_dir / f"{bench.namespace}-cache", f"{bench.namespace}-cache",
                       settings.model == "tiny", settings.timeout_s)
    try:
        scene.start(model)
        first = scene.first_pod()
        _say(f"cache: first pod on {first['node']} in {first['seconds']}s (S3 fill included)")
        cached = [scene.grow_to(2 + i) for i in range(CACHED_PLACEMENTS)]
        _say(f"cache: cached placements {json.dumps(cached)}")
        holder = first["node"]
        other = next(n for n in _real_nodes(scene) if n != holder)
        # A taint of the scene's own, not a cordon: the operator starts replacements for the pods of
        # a cordoned node (a drain's first step), which would take the pod this step measures.
        scene.kubectl("taint", "node", holder, HOLD_TAINT)
        try:
            uncached = scene.grow_to(2 + CACHED_PLACEMENTS)
        finally:
            scene.kubectl("taint", "node", holder, f"{HOLD_TAINT}-", check=False)
        _say(f"cache: on the other node {json.dumps(uncached)}")
        entries = scene.wait(lambda: (e := scene.cache_nodes()) and len(e) >= 2 and all(x["published"] for x in e)
                             and e, "both nodes' cacheNodes entries published")
        revision = str(entries[0]["revision"])
        copies = {n: scene.node_copy(n, revision) for n in (holder, other)}
        return {
            "first_pod": first, "cached": cached, "other_node": uncached, "holder": holder,
            "placed_on_cached_node": [c["node"] == holder for c in cached],
            "uncached_on_other_node": uncached["node"] == other,
            "cached_over_uncached": ratio(median([c["seconds"] for c in cached]), uncached["seconds"]),
            "cache_nodes": entries,
            "own_copies": {n: {"path": str(p), "files": sorted(f.name for f in p.iterdir()) if p.is_dir() else []}
                           for n, p in copies.items()},
        }
    finally:
        scene.close()


def _real_nodes(scene: CacheScene) -> dict[str, dict[str, str]]:
    """The real nodes' names and labels (not the suite's kwok node)."""
    out = scene.kubectl("get", "nodes", "-o", "json").stdout
    return {n["metadata"]["name"]: dict(n["metadata"].get("labels") or {}) for n in json.loads(out)["items"]
            if n["metadata"]["name"].startswith("warmpool-node-")}
