"""`helm install` into the local cluster: the operator runs from its image in two pods on the real
node as its ServiceAccount (one holds the leader Lease), its RBAC is enough (a WarmModel goes warm
from the worker image, no 403 in its log) and no more (`kubectl auth can-i` refuses what it was not
given), the worker runs as the chart says (non-root, read-only root filesystem), and
`helm uninstall` removes it all.

The release namespace enforces Pod Security "restricted", so the API server itself checks
the operator pod.  The WarmModel lives in a second watched namespace without that label:
its weights come from a hostPath (the local cluster has no PersistentVolumes), and
"restricted" forbids hostPath volumes.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_devcluster import build
from warmpool_devcluster.chart_values import local_values
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import model_root, tiny_model
from warmpool.contract.api import API_GROUP_VERSION, CONDITION_READY, CRD_NAME, KIND
from warmpool.contract.pods import ANNOTATION_TIER, LABEL_MODEL, WORKER_CONTAINER

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "warmpool"


def helm(
    cluster: ClusterHandle, *args: str, check: bool = True, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    binary = str(build.ensure_binaries(["helm"])["helm"])
    proc = subprocess.run([binary, "--kubeconfig", str(cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def can_i(cluster: ClusterHandle, sa: str, verb: str, resource: str, namespace: str | None,
          subresource: str | None = None) -> bool:
    args = ["auth", "can-i", verb, resource, f"--as={sa}"]
    args += ["-n", namespace] if namespace else []
    args += [f"--subresource={subresource}"] if subresource else []
    answer = cluster.kubectl(*args, check=False).stdout.strip()
    assert answer in ("yes", "no"), answer
    return answer == "yes"


#: An HTTP 403 in a log line: the status alone (a client error, "code": 403, "403 Forbidden"),
#: never the milliseconds of a timestamp ("06:09:15,403" once failed this test on a clean log).
STATUS_403 = re.compile(r"(?<![,.:\d])403(?!\d)")


def permission_denied(line: str) -> bool:
    return "Forbidden" in line or " is forbidden" in line or STATUS_403.search(line) is not None


def wait_for(what: str, probe: Any, timeout: float, interval: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


def adopt_existing_crd(cluster: ClusterHandle, release: str, namespace: str) -> None:
    """A CRD applied earlier with kubectl (other tests do) is handed to this release the way
    Helm adopts existing objects: its ownership label and annotations (docs/runbooks/upgrading.md)."""
    if cluster.kubectl("get", "crd", CRD_NAME, check=False).returncode != 0:
        return
    cluster.kubectl("label", "crd", CRD_NAME, "app.kubernetes.io/managed-by=Helm", "--overwrite")
    cluster.kubectl("annotate", "crd", CRD_NAME, f"meta.helm.sh/release-name={release}",
                    f"meta.helm.sh/release-namespace={namespace}", "--overwrite")


def sa_kubeconfig(cluster: ClusterHandle, account: str, namespace: str, tmp_path: Path) -> Path:
    """A kubeconfig with nothing but the ServiceAccount's token (no admin client certificate)."""
    admin = json.loads(cluster.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration=10m").stdout.strip()
    entry = admin["clusters"][0]
    config = {
        "apiVersion": "v1", "kind": "Config", "clusters": [entry],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": {"cluster": entry["name"], "user": account}}],
        "current-context": account,
    }
    path = tmp_path / "sa.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@pytest.fixture()
def models_namespace(cluster: ClusterHandle) -> Iterator[str]:
    name = f"t-helm-models-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def warm_model_manifest(name: str, model_dir: Path) -> str:
    return yaml.safe_dump({
        "apiVersion": API_GROUP_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "spec": {
            "model": {"hostPath": {"path": str(model_dir)}},
            "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": 2},
            "warmup": {"buckets": [8, 16], "timeoutSeconds": 120},
        },
    })


def operator_log(cluster: ClusterHandle, namespace: str, pod: str) -> str:
    proc = cluster.kubectl("logs", "-n", namespace, pod, "--all-containers", check=False)
    return proc.stdout + proc.stderr


def test_install_run_rbac_warm_uninstall(
    cluster: ClusterHandle, namespace: str, models_namespace: str, tmp_path: Path
) -> None:
    release = f"wp{uuid.uuid4().hex[:6]}"
    fullname = f"{release}-warmpool"
    sa = f"system:serviceaccount:{namespace}:{fullname}"
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    adopt_existing_crd(cluster, release, namespace)

    if cluster.node is None:
        pytest.skip("installs the checkout's images: needs the local cluster's real node")
    values = local_values(cluster.images, cluster.node.pod_cidr)  # the checkout's images, the node's pods
    values |= {
        "watch": {"namespaces": [namespace, models_namespace]},
        # fast ticks keep the test short; the tiny model's directory is the one node directory allowed
        "operator": {**values["operator"], "scrapeInterval": 2, "logLevel": "INFO",
                     "allowedHostPaths": [str(model_root())]},
        "probes": {"readiness": {"initialDelaySeconds": 1, "periodSeconds": 2, "timeoutSeconds": 5,
                                 "failureThreshold": 3}},
    }
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    installed = False
    try:
        helm(cluster, "install", release, str(CHART), "-n", namespace, "-f", str(values_file),
             "--wait", "--timeout", "180s")
        installed = True

        # --- the operator pod runs, Ready, as its ServiceAccount, under "restricted"
        operator_pods = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator"
        pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", operator_pods,
                                          "-o", "json").stdout)["items"]
        # Two replicas; the one acting holds the leader Lease ("<pod name>-<pid>-<6 hex>").
        assert len(pods) == 2, [p["metadata"]["name"] for p in pods]

        def holder() -> str | None:
            got = cluster.kubectl("get", "lease", fullname, "-n", namespace, "-o", "json", check=False)
            return json.loads(got.stdout)["spec"].get("holderIdentity") if got.returncode == 0 else None

        held = wait_for("the leader Lease to be held", holder, timeout=60)
        (pod,) = [p for p in pods if held.startswith(p["metadata"]["name"] + "-")]
        assert pod["spec"]["serviceAccountName"] == fullname
        assert pod["status"]["phase"] == "Running"

        def both_ready(selector: str) -> list[dict[str, Any]] | None:
            # helm's --wait needs only the Deployment's minimum availability: one of the two may lag
            found = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", selector,
                                               "-o", "json").stdout)["items"]
            statuses = [s for p in found for s in (p["status"].get("containerStatuses") or [])]
            return found if len(statuses) == 2 and all(s["ready"] for s in statuses) else None

        # The operator's two replicas, and the activator's two (from the same image, its own
        # ServiceAccount and RBAC, ready once its watches listed).
        for selector, what in ((operator_pods, "operator"),
                               (f"app.kubernetes.io/instance={release},app.kubernetes.io/component=activator",
                                "activator")):
            for each in wait_for(f"both {what} pods Ready", functools.partial(both_ready, selector), timeout=120):
                (container,) = each["status"]["containerStatuses"]  # the checkout's operator image
                assert container["image"] == cluster.images["operator"] and container["ready"], container

        # --- RBAC: enough ...
        allowed = [
            ("list", "warmmodels.warmpool.dev", models_namespace, None),
            ("watch", "warmmodels.warmpool.dev", namespace, None),
            ("patch", "warmmodels.warmpool.dev", models_namespace, None),
            ("patch", "warmmodels.warmpool.dev", models_namespace, "status"),
            ("create", "deployments.apps", models_namespace, None),
            ("update", "deployments.apps", models_namespace, None),
            ("update", "services", models_namespace, None),
            ("create", "poddisruptionbudgets.policy", models_namespace, None),
            ("patch", "configmaps", models_namespace, None),
            ("create", "secrets", models_namespace, None),
            ("patch", "secrets", models_namespace, None),
            ("list", "pods", models_namespace, None),
            ("patch", "pods", models_namespace, None),
            ("create", "events", models_namespace, None),
            ("watch", "customresourcedefinitions.apiextensions.k8s.io", None, None),
            ("watch", "nodes", None, None),  # node loss and drains (control/nodes.py)
        ]
        # ... and no more.
        refused = [
            ("get", "secrets", models_namespace, None),  # written, never read: the tokens are derived
            ("list", "secrets", models_namespace, None),
            ("watch", "secrets", models_namespace, None),
            ("delete", "deployments.apps", models_namespace, None),  # owner references do that
            ("delete", "pods", models_namespace, None),
            ("create", "pods", models_namespace, None),
            ("create", "pods", models_namespace, "exec"),
            ("delete", "warmmodels.warmpool.dev", models_namespace, None),
            ("list", "warmmodels.warmpool.dev", "default", None),  # not a watched namespace
            ("get", "secrets", "kube-system", None),
            ("create", "deployments.apps", "default", None),
            ("patch", "nodes", None, None),  # read, never written
            ("create", "clusterroles.rbac.authorization.k8s.io", None, None),
            ("create", "rolebindings.rbac.authorization.k8s.io", models_namespace, None),
            ("delete", "customresourcedefinitions.apiextensions.k8s.io", None, None),
            ("update", "customresourcedefinitions.apiextensions.k8s.io", None, None),
        ]
        wrong = [f"not allowed: {a}" for a in allowed if not can_i(cluster, sa, *a)]
        wrong += [f"not refused: {r}" for r in refused if can_i(cluster, sa, *r)]
        assert not wrong, wrong
        # What the API server says to the ServiceAccount itself, not just what can-i predicts.
        sa_config = sa_kubeconfig(cluster, fullname, namespace, tmp_path)
        forbidden = cluster.kubectl("--kubeconfig", str(sa_config), "get", "secrets", "-n", models_namespace,
                                    check=False)
        assert forbidden.returncode != 0 and "Forbidden" in forbidden.stderr, forbidden.stderr
        listed = cluster.kubectl("--kubeconfig", str(sa_config), "get", "wm", "-n", models_namespace)
        assert listed.returncode == 0

        # --- a WarmModel applied afterwards goes warm
        model_dir = tiny_model()
        cluster.kubectl("apply", "-n", models_namespace, "-f", "-", input=warm_model_manifest("tiny", model_dir))

        def warm() -> dict[str, Any] | None:
            status = json.loads(cluster.kubectl("get", "wm", "tiny", "-n", models_namespace, "-o", "json").stdout
                                ).get("status") or {}
            ready = {c["type"]: c for c in status.get("conditions") or []}.get(CONDITION_READY) or {}
            return status if ready.get("status") == "True" and status.get("warmReplicas", 0) >= 1 else None

        try:
            status = wait_for("WarmModel tiny to be Ready with a warm replica", warm, timeout=240)
        except AssertionError:
            print(cluster.kubectl("get", "wm,pods,events", "-n", models_namespace, check=False).stdout)
            print(operator_log(cluster, namespace, pod["metadata"]["name"])[-5000:])
            raise
        assert status["observedGeneration"] >= 1
        worker_pods = json.loads(cluster.kubectl("get", "pods", "-n", models_namespace, "-l",
                                                 f"{LABEL_MODEL}=tiny", "-o", "json").stdout)["items"]
        assert any((p["metadata"].get("annotations") or {}).get(ANNOTATION_TIER) == "full"
                   for p in worker_pods), "the operator did not annotate the worker pod's tier"
        # The worker container: the chart's worker image, non-root, a read-only root filesystem.
        worker = worker_pods[0]
        (status,) = [c for c in worker["status"]["containerStatuses"] if c["name"] == WORKER_CONTAINER]
        assert status["image"] == cluster.images["worker"], status
        probe = ("import os; print('uid', os.getuid())\n"
                 "try:\n    open('/probe', 'w')\nexcept OSError as e:\n    print('root fs', e.strerror)")
        seen = cluster.kubectl("exec", "-n", models_namespace, worker["metadata"]["name"], "-c",
                               WORKER_CONTAINER, "--", "python", "-c", probe).stdout
        assert "uid 65532" in seen and "root fs Read-only file system" in seen, seen
        log = operator_log(cluster, namespace, pod["metadata"]["name"])
        denied = [line for line in log.splitlines() if permission_denied(line)]
        assert not denied, "the operator hit a permission it lacks:\n" + "\n".join(denied)[:3000]

        # The WarmModel goes before the operator, so the operator sees it go and stops its pass (it holds no
        # finalizer: its children go with it by their owner references).
        cluster.kubectl("delete", "wm", "tiny", "-n", models_namespace, "--timeout=120s")
    finally:
        if installed:
            helm(cluster, "uninstall", release, "-n", namespace, "--wait", "--timeout", "120s")

    # --- helm uninstall removed everything it installed (the CRD stays by design: crds.keep)
    selector = f"app.kubernetes.io/instance={release}"
    for ns in (namespace, models_namespace):
        left = cluster.kubectl("get", "deployments,services,serviceaccounts,configmaps,roles,rolebindings",
                               "-n", ns, "-l", selector, "-o", "name").stdout.split()
        assert not left, f"left behind in {ns}: {left}"
    left = cluster.kubectl("get", "clusterroles,clusterrolebindings", "-l", selector, "-o", "name").stdout.split()
    assert not left, f"left behind: {left}"
    wait_for("the operator pod to go", lambda: not cluster.kubectl(
        "get", "pods", "-n", namespace, "-l", selector, "-o", "name").stdout.strip(), timeout=60)
    crd = json.loads(cluster.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
    assert crd["metadata"]["annotations"].get("helm.sh/resource-policy") == "keep"
    assert release not in helm(cluster, "list", "-n", namespace, "-q").stdout
