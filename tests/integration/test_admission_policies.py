"""The chart's ValidatingAdmissionPolicies on the real API server, as the chart's own service
accounts (their RBAC from the chart too): the node agent may patch only the Node its pod runs
on, and there only its cache labels; the operator may patch only its own worker pods, and there
only the awake label and the tier and deletion-cost annotations, and write only its WarmModels'
control Secrets; the activator may change only its own held-requests annotation on WarmModels.

The service accounts act with tokens the API server issues: the agent's bound to a pod on the
session's kwok node (the token then carries that node's name, as a DaemonSet pod's does), the
operator's a plain one.  Nothing runs: kwok plays the pods' kubelet."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import ssl
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_devcluster import kwok
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.io import control_key

from tests.integration.test_helm_chart import CHART, helm
from tests.support.node_agent import Agent, agent_processes
from warmpool.contract.api import API_GROUP_VERSION, KIND, PLURAL
from warmpool.contract.nodecache import CACHE_NODE_LABEL_HEX, CACHE_NODE_LABEL_PREFIX, CACHE_NODE_LABEL_VALUE
from warmpool.contract.pods import (
    ANNOTATION_POD_DELETION_COST,
    ANNOTATION_TIER,
    AWAKE_FALSE,
    AWAKE_TRUE,
    CONTROL_SECRET_KEY,
    CONTROL_SECRET_SUFFIX,
    LABEL_AWAKE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
)
from warmpool.contract.zero import held_annotation, held_value

pytestmark = pytest.mark.integration

#: The kinds installed from the rendered chart: identities, their RBAC and the policies; nothing that runs.
KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
         "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
CLUSTER_SCOPED = ("ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
OWN_NODE = kwok.node_name(0)
#: A label the agent would publish (a revision digest's label key).
CACHE_LABEL = f"{CACHE_NODE_LABEL_PREFIX}/{'ab' * (CACHE_NODE_LABEL_HEX // 2)}"


@dataclass
class Release:
    namespace: str
    name: str
    objects: list[dict[str, Any]]

    def sa(self, suffix: str) -> str:
        return f"{self.name}-warmpool{suffix}"


@contextlib.contextmanager
def installed(cluster: ClusterHandle, namespace: str, tmp_path: Path, values: dict[str, Any]) -> Iterator[Release]:
    """The chart's identities, RBAC and admission policies for ``values``, under a release name of
    this test's own; the cluster-scoped ones deleted afterwards."""
    name = f"ap{uuid.uuid4().hex[:6]}"
    values_file = tmp_path / f"values-{name}.yaml"
    values_file.write_text(yaml.safe_dump(values))
    rendered = helm("template", name, str(CHART), "--namespace", namespace, "-f", str(values_file)).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o and o["kind"] in KINDS]
    try:
        cluster.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(o) for o in objects))
        yield Release(namespace, name, objects)
    finally:
        for obj in objects:
            if obj["kind"] in CLUSTER_SCOPED:
                cluster.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "--ignore-not-found",
                                "--wait=false", check=False)


@pytest.fixture()
def release(cluster: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[Release]:
    """Cluster-wide mode, node agent on."""
    with installed(cluster, namespace, tmp_path, {"watch": {"allNamespaces": True},
                                                  "nodeAgent": {"enabled": True}}) as made:
        assert {o["kind"] for o in made.objects} == set(KINDS), sorted({o["kind"] for o in made.objects})
        yield made


class As:
    """The API as one service account, by its token only (never the admin's certificate): a merge
    patch, and nothing read first (the operator may patch pods it may not get)."""

    def __init__(self, cluster: ClusterHandle, token: str) -> None:
        config = yaml.safe_load(Path(cluster.kubeconfig).read_text())["clusters"][0]["cluster"]
        self.server = str(config["server"])
        # No proxy from the environment: the API server is dialled directly.
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(
            context=ssl.create_default_context(cafile=config["certificate-authority"])))
        self.token = token

    def patch(self, kind: str, name: str, patch: dict[str, Any], namespace: str | None = None) -> tuple[bool, str]:
        path = f"/api/v1/namespaces/{namespace}/{kind}s/{name}" if namespace else f"/api/v1/{kind}s/{name}"
        return self._send("PATCH", path, patch, "application/merge-patch+json")

    def create(self, kind: str, obj: dict[str, Any], namespace: str) -> tuple[bool, str]:
        return self._send("POST", f"/api/v1/namespaces/{namespace}/{kind}s", obj, "application/json")

    def get(self, kind: str, name: str, namespace: str) -> tuple[bool, str]:
        return self._send("GET", f"/api/v1/namespaces/{namespace}/{kind}s/{name}", None, "application/json")

    def _send(self, method: str, path: str, body: dict[str, Any] | None, content_type: str) -> tuple[bool, str]:
        request = urllib.request.Request(
            self.server + path, data=None if body is None else json.dumps(body).encode(), method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": content_type})
        try:
            with self.opener.open(request, timeout=30) as response:
                return True, response.read().decode()
        except urllib.error.HTTPError as error:
            return False, f"{error.code}: {error.read().decode()}"


def token(cluster: ClusterHandle, namespace: str, sa: str, pod: dict[str, Any] | None = None) -> str:
    args = ["create", "token", sa, "-n", namespace, "--duration=10m"]
    if pod is not None:
        args += ["--bound-object-kind=Pod", f"--bound-object-name={pod['metadata']['name']}",
                 f"--bound-object-uid={pod['metadata']['uid']}"]
    return cluster.kubectl(*args).stdout.strip()


def pod_on_the_kwok_node(cluster: ClusterHandle, namespace: str, name: str, sa: str = "default",
                         labels: dict[str, str] | None = None) -> dict[str, Any]:
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace,
                                                                "labels": labels or {}},
                "spec": {"nodeName": OWN_NODE, "serviceAccountName": sa, "automountServiceAccountToken": False,
                         "tolerations": [{"key": kwok.FAKE_NODE_TAINT["key"], "operator": "Exists"}],
                         "containers": [{"name": "c", "image": "warmpool.invalid/none:0"}]}}
    created: dict[str, Any] = json.loads(cluster.kubectl("create", "-f", "-", "-o", "json",
                                                        input=json.dumps(manifest)).stdout)
    return created


def active(check: Any, what: str) -> tuple[bool, str]:
    """A newly made policy is enforced a moment later: retry a write it must refuse (one that is
    harmless should it go through, and undone) until it is refused, within a bound."""
    deadline = time.monotonic() + 30
    while True:
        allowed, out = check()
        if not allowed:
            return allowed, out
        assert time.monotonic() < deadline, f"{what} was never refused: {out}"
        time.sleep(0.5)


def test_the_policies_type_check_clean(cluster: ClusterHandle, release: Release) -> None:
    """CEL type errors in a policy are warnings, not failures: the API server's type check must find none."""
    for obj in release.objects:
        if obj["kind"] != "ValidatingAdmissionPolicy":
            continue
        name = obj["metadata"]["name"]
        deadline = time.monotonic() + 30
        while True:
            live = json.loads(cluster.kubectl("get", "validatingadmissionpolicy", name, "-o", "json").stdout)
            status = live.get("status") or {}
            if status.get("observedGeneration") == live["metadata"]["generation"]:
                break
            assert time.monotonic() < deadline, f"policy {name} was never type-checked: {status}"
            time.sleep(0.5)
        assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status


def test_the_node_agent_patches_only_its_own_nodes_cache_labels(cluster: ClusterHandle, namespace: str,
                                                                 release: Release) -> None:
    sa = release.sa("-node-agent")
    pod = pod_on_the_kwok_node(cluster, namespace, "agent", sa)
    agent = As(cluster, token(cluster, namespace, sa, pod))

    def foreign_label_on_own_node() -> tuple[bool, str]:
        allowed, out = agent.patch("node", OWN_NODE, {"metadata": {"labels": {"warmpool-test-probe": "x"}}})
        if allowed:  # not enforced yet: undone
            cluster.kubectl("label", "node", OWN_NODE, "warmpool-test-probe-")
        return allowed, out

    _, refused = active(foreign_label_on_own_node, "a label outside cache.warmpool.dev/ on the agent's own node")
    assert "may change only the node labels under cache.warmpool.dev/" in refused, refused

    # Its own node's cache label: published and withdrawn.
    publish = {"metadata": {"labels": {CACHE_LABEL: CACHE_NODE_LABEL_VALUE}}}
    allowed, out = agent.patch("node", OWN_NODE, publish)
    assert allowed, out
    try:
        node = json.loads(cluster.kubectl("get", "node", OWN_NODE, "-o", "json").stdout)
        assert node["metadata"]["labels"][CACHE_LABEL] == CACHE_NODE_LABEL_VALUE
    finally:
        allowed, out = agent.patch("node", OWN_NODE, {"metadata": {"labels": {CACHE_LABEL: None}}})
        assert allowed, out

    # Another node (the real one, in the session's cluster), even with the very label it may set at
    # home: refused, untouched.
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    (other, *_) = [n["metadata"]["name"] for n in nodes if n["metadata"]["name"] != OWN_NODE]
    before = json.loads(cluster.kubectl("get", "node", other, "-o", "json").stdout)["metadata"]["labels"]
    allowed, out = agent.patch("node", other, publish)
    assert not allowed and "may patch only the Node its pod runs on" in out, out
    after = json.loads(cluster.kubectl("get", "node", other, "-o", "json").stdout)["metadata"]["labels"]
    assert after == before
    # Its own node's spec or annotations: refused.
    allowed, out = agent.patch("node", OWN_NODE, {"spec": {"unschedulable": True}})
    assert not allowed and "may not change a Node's spec or annotations" in out, out
    # A token of the same service account bound to no pod carries no node: refused everywhere.
    unbound = As(cluster, token(cluster, namespace, sa))
    allowed, out = unbound.patch("node", OWN_NODE, publish)
    assert not allowed and "may patch only the Node its pod runs on" in out, out


def test_the_operator_patches_only_its_own_pods_tier_cost_and_awake(cluster: ClusterHandle, namespace: str,
                                                                    release: Release) -> None:
    worker_labels = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_AWAKE: AWAKE_TRUE,
                     "team": "a"}
    pod_on_the_kwok_node(cluster, namespace, "worker", labels=worker_labels)
    pod_on_the_kwok_node(cluster, namespace, "stranger", labels={"team": "a"})
    operator = As(cluster, token(cluster, release.namespace, release.sa("")))

    def someone_elses_pod() -> tuple[bool, str]:
        return operator.patch("pod", "stranger", {"metadata": {"annotations": {ANNOTATION_TIER: "full"}}},
                              namespace)

    _, refused = active(someone_elses_pod, "a tier annotation on a pod that is not the operator's")
    assert "may patch only its own worker pods" in refused, refused

    allowed, out = operator.patch("pod", "worker", {"metadata": {
        "annotations": {ANNOTATION_TIER: "full", ANNOTATION_POD_DELETION_COST: "1000"},
        "labels": {LABEL_AWAKE: AWAKE_FALSE}}}, namespace)
    assert allowed, out
    for patch, message in (
        ({"metadata": {"labels": {"team": "b"}}}, "may change only the pod label warmpool.dev/awake"),
        ({"metadata": {"labels": {LABEL_MANAGED_BY: None}}}, "may change only the pod label"),
        ({"metadata": {"annotations": {"other": "x"}}}, "may change only the pod annotations"),
        ({"spec": {"activeDeadlineSeconds": 5}}, "may not change a pod's spec"),
    ):
        allowed, out = operator.patch("pod", "worker", patch, namespace)
        assert not allowed and message in out, (patch, out)
    live = json.loads(cluster.kubectl("get", "pod", "worker", "-n", namespace, "-o", "json").stdout)
    assert live["metadata"]["labels"] == {**worker_labels, LABEL_AWAKE: AWAKE_FALSE}
    assert live["metadata"]["annotations"] == {ANNOTATION_TIER: "full",
                                               ANNOTATION_POD_DELETION_COST: "1000"}
    assert "activeDeadlineSeconds" not in live["spec"]


def test_the_operator_writes_only_its_warmmodels_control_secrets(cluster: ClusterHandle, namespace: str,
                                                                 release: Release) -> None:
    operator = As(cluster, token(cluster, release.namespace, release.sa("")))
    owner = {"apiVersion": API_GROUP_VERSION, "kind": KIND, "name": "m",
             "uid": "00000000-0000-0000-0000-000000000001", "controller": True}
    ours: dict[str, Any] = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": f"m{CONTROL_SECRET_SUFFIX}",
                         "labels": {LABEL_MANAGED_BY: MANAGED_BY}, "ownerReferences": [owner]},
            "data": {CONTROL_SECRET_KEY: "dG9rZW4="}}

    def someone_elses_secret() -> tuple[bool, str]:
        allowed, out = operator.create("secret", {**ours, "metadata": {"name": "db-password"}}, namespace)
        if allowed:  # not enforced yet: undone
            cluster.kubectl("delete", "secret", "db-password", "-n", namespace)
        return allowed, out

    _, refused = active(someone_elses_secret, "a Secret of another name, unlabelled and owned by nobody")
    assert "may write only its WarmModels' control Secrets" in refused, refused
    # Its own control Secret, made and its token rewritten.  (A WarmModel of that uid does not exist:
    # the garbage collector may remove the Secret soon after, which this test does not wait for.)
    allowed, out = operator.create("secret", ours, namespace)
    assert allowed, out
    allowed, out = operator.patch("secret", ours["metadata"]["name"],
                                  {"data": {CONTROL_SECRET_KEY: "bmV3"}}, namespace)
    assert allowed or "NotFound" in out or "404" in out, out
    # A control-looking name on a Secret the operator did not make: not taken over by a patch that
    # adds the label, and not writable as it is.
    cluster.kubectl("create", "secret", "generic", f"theirs{CONTROL_SECRET_SUFFIX}", "-n", namespace,
                    "--from-literal=k=v")
    for patch in ({"metadata": {"labels": {LABEL_MANAGED_BY: MANAGED_BY},
                                "ownerReferences": [owner]}},
                  {"data": {"k": "bmV3"}}):
        allowed, out = operator.patch("secret", f"theirs{CONTROL_SECRET_SUFFIX}", patch, namespace)
        assert not allowed and "Forbidden" in out, (patch, out)
    data = json.loads(cluster.kubectl("get", "secret", f"theirs{CONTROL_SECRET_SUFFIX}", "-n", namespace,
                                      "-o", "json").stdout)
    assert data["data"] == {"k": "dg=="} and "labels" not in data["metadata"]

    # It reads no Secret (its workers' tokens are derived from its key), not even its own control
    # Secret; only its control key, by name, which the first replica may make.
    for name in (f"theirs{CONTROL_SECRET_SUFFIX}", ours["metadata"]["name"]):
        allowed, out = operator.get("secret", name, namespace)
        assert not allowed and out.startswith("403"), (name, out)
    key_name = f"{release.sa('')}-control-key"
    allowed, out = operator.create("secret", control_key.key_secret(namespace, key_name, b"k" * 32), namespace)
    assert allowed, out
    allowed, out = operator.get("secret", key_name, namespace)
    assert allowed and json.loads(out)["data"][control_key.KEY_FIELD] == base64.b64encode(b"k" * 32).decode(), out
    # Another name beside it is refused (the policy allows that one name only, and there).
    stray = control_key.key_secret(namespace, "other-control-key", b"k" * 32)
    allowed, out = operator.create("secret", stray, namespace)
    assert not allowed and "may write only its WarmModels' control Secrets" in out, out


def _token_kubeconfig(cluster: ClusterHandle, bearer: str, path: Path) -> Path:
    """A kubeconfig that is the service account's token and nothing else."""
    entry = yaml.safe_load(Path(cluster.kubeconfig).read_text())["clusters"][0]
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": [entry], "current-context": "sa",
        "users": [{"name": "sa", "user": {"token": bearer}}],
        "contexts": [{"name": "sa", "context": {"cluster": entry["name"], "user": "sa"}}]}))
    return path


def test_an_agent_kept_out_of_a_namespaces_secrets_says_so_in_the_warmmodels_status(
        cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> None:
    """Cluster-wide, with nodeAgent.secretNamespaces naming another namespace: the agent, running as
    its own service account, cannot read an S3 WarmModel's Secret here, and the WarmModel's status
    names the Secret and the value that would let it."""
    values = {"watch": {"allNamespaces": True}, "nodeAgent": {"enabled": True, "secretNamespaces": ["kube-public"]}}
    with installed(cluster, namespace, tmp_path, values) as made, agent_processes(tmp_path) as agents:
        cluster.kubectl("create", "secret", "generic", "s3-creds", "-n", namespace,
                        "--from-literal=accessKeyId=a", "--from-literal=secretAccessKey=b")
        wm = {"apiVersion": API_GROUP_VERSION, "kind": KIND,
              "metadata": {"name": "from-s3", "namespace": namespace},
              "spec": {"model": {"s3": {"endpoint": "http://127.0.0.1:9", "bucket": "models", "prefix": "m",
                                        "secretRef": {"name": "s3-creds"}}}}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(wm))
        kubeconfig = _token_kubeconfig(cluster, token(cluster, namespace, made.sa("-node-agent")),
                                       tmp_path / "agent.kubeconfig")
        agents.append(Agent(dataclasses.replace(cluster, kubeconfig=kubeconfig), namespace, OWN_NODE,
                            tmp_path / "cache", tmp_path / "agent-0.log", interval_s=1))

        def message() -> str | None:
            status = json.loads(cluster.kubectl("get", PLURAL, "from-s3", "-n", namespace,
                                                "-o", "json").stdout).get("status") or {}
            texts = [str(e.get("message")) for e in status.get("cacheNodes") or [] if e.get("node") == OWN_NODE]
            return texts[0] if texts and texts[0] != "None" else None

        deadline = time.monotonic() + 60
        while (text := message()) is None and time.monotonic() < deadline:
            time.sleep(1)
        assert text is not None, "no status entry from the agent within 60 s"
        assert f"may not read Secret {namespace}/s3-creds" in text and "nodeAgent.secretNamespaces" in text, text
        cluster.kubectl("delete", PLURAL, "from-s3", "-n", namespace, "--wait=false", check=False)


def test_the_activator_changes_only_its_own_held_annotation(cluster: ClusterHandle, namespace: str, crd: str,
                                                            release: Release) -> None:
    """Its token is bound to its pod (as a Deployment pod's is): the policy reads the pod's name
    from it, so one replica cannot touch another's count, nor anything else of the WarmModel."""
    sa = release.sa("-activator")
    pod = pod_on_the_kwok_node(cluster, namespace, "activator-0", sa)
    activator = As(cluster, token(cluster, namespace, sa, pod))
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps({
        "apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": "m"},
        "spec": {"model": {"hostPath": {"path": "/models/m"}}, "pool": {"replicas": 0, "minWarm": 0,
                                                                        "scaleToZero": {"afterIdleSeconds": 60}}}}))
    path = f"/apis/{API_GROUP_VERSION}/namespaces/{namespace}/{PLURAL}/m"

    def patch(body: dict[str, Any]) -> tuple[bool, str]:
        return activator._send("PATCH", path, body, "application/merge-patch+json")

    def anothers_count() -> tuple[bool, str]:
        allowed, out = patch({"metadata": {"annotations": {held_annotation("activator-1"): "1 1"}}})
        if allowed:  # not enforced yet: undone
            patch({"metadata": {"annotations": {held_annotation("activator-1"): None}}})
        return allowed, out

    _, refused = active(anothers_count, "another replica's held annotation")
    assert "may change only its own annotation" in refused, refused
    allowed, out = patch({"metadata": {"annotations": {held_annotation("activator-0"): held_value(3, time.time())}}})
    assert allowed, out
    allowed, out = patch({"metadata": {"annotations": {held_annotation("activator-0"): None}}})
    assert allowed, out
    allowed, out = patch({"spec": {"pool": {"replicas": 3}}})
    assert not allowed and "may not change a WarmModel's spec" in out, out
    allowed, out = patch({"metadata": {"labels": {"team": "x"}}})
    assert not allowed, out
    live = json.loads(cluster.kubectl("get", PLURAL, "m", "-n", namespace, "-o", "json").stdout)
    assert live["spec"]["pool"]["replicas"] == 0 and not (live["metadata"].get("annotations") or {})
