"""The chart's ValidatingAdmissionPolicies on the real API server, as the chart's own service
accounts (their RBAC from the chart too): the node agent may patch only the Node its pod runs
on, and there only its cache labels; the operator may patch only its own worker pods, and there
only the awake label and the tier and deletion-cost annotations, and write only its WarmModels'
control Secrets; the activator may change only its own held-requests annotation on WarmModels.

On an API server alone (the api_server fixture, no node): every policy type-checks clean (the
controller manager's policy status controller run beside it); the operator writes and deletes only the
EndpointSlices of its WarmModels' Services, and its own writes (its real code, as its service
account) pass every policy; none of the three service accounts changes an owner reference or
makes an object owned other than as the operator's children are; the activator's held value has
the contract's format, count bound and a time no later than the API server's clock plus the skew.

The service accounts act with tokens the API server issues: the agent's bound to a pod on the
session's second real node (the token then carries that node's name, as a DaemonSet pod's does), the
operator's a plain one.  Nothing of theirs runs: the pods name an image no registry serves."""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import json
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from kubernetes_asyncio import config
from warmpool_devcluster import build, node_kubelet
from warmpool_devcluster.chart_values import render_only_values
from warmpool_devcluster.testing import SPARE_NODE_TAINT, ClusterHandle
from warmpool_operator.api.types import parse_spec
from warmpool_operator.control import children
from warmpool_operator.control import zero as zero_control
from warmpool_operator.control.status_patch import write_status
from warmpool_operator.io import control_key
from warmpool_operator.io.kube import Kube
from warmpool_operator.model import Target
from warmpool_operator.rules import builders
from warmpool_operator.rules import zero as zero_rules

from tests.integration.test_helm_chart import CHART, helm
from tests.support.api_world import ApiCluster, RecordingKube
from tests.support.node_agent import Agent, agent_processes
from tests.support.procs import free_port, stop
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
    WORKER_POLICY_SUFFIX,
)
from warmpool.contract.zero import (
    ACTIVATOR_SLICE_SUFFIX,
    HELD_CLOCK_SKEW_SECONDS,
    HELD_COUNT_MAX,
    LABEL_ENDPOINTSLICE_MANAGED_BY,
    LABEL_SERVICE_NAME,
    held_annotation,
    held_value,
)

pytestmark = pytest.mark.integration

#: The kinds installed from the rendered chart: identities, their RBAC and the policies; nothing that runs.
KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
         "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
CLUSTER_SCOPED = ("ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
OWN_NODE = node_kubelet.node_name(1)
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
    values_file.write_text(yaml.safe_dump(render_only_values(values)))
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

    def create_in(self, group_version: str, plural: str, obj: dict[str, Any], namespace: str) -> tuple[bool, str]:
        """A create of a kind outside the core group (``group_version`` like networking.k8s.io/v1)."""
        return self._send("POST", f"/apis/{group_version}/namespaces/{namespace}/{plural}", obj, "application/json")

    def patch_in(self, group_version: str, plural: str, name: str, patch: dict[str, Any],
                 namespace: str) -> tuple[bool, str]:
        return self._send("PATCH", f"/apis/{group_version}/namespaces/{namespace}/{plural}/{name}", patch,
                          "application/merge-patch+json")

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


def pod_on_the_second_node(cluster: ClusterHandle, namespace: str, name: str, sa: str = "default",
                         labels: dict[str, str] | None = None) -> dict[str, Any]:
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace,
                                                                "labels": labels or {}},
                "spec": {"nodeName": OWN_NODE, "serviceAccountName": sa, "automountServiceAccountToken": False,
                         "tolerations": [{"key": SPARE_NODE_TAINT["key"], "operator": "Exists"}],
                         "containers": [{"name": "c", "image": "warmpool.invalid/none:0"}]}}
    created: dict[str, Any] = json.loads(cluster.kubectl("create", "-f", "-", "-o", "json",
                                                        input=json.dumps(manifest)).stdout)
    return created


def active(check: Any, what: str, cluster: ClusterHandle) -> tuple[bool, str]:
    """A newly made policy is enforced a moment later: retry a write it must refuse (one that is
    harmless should it go through, and then undone by the admin: ``undo_as_admin``) until it is
    refused, within a bound.  The bound is wide: a release whose policies take parameters (Services)
    makes the API server start an informer for them first, and in the full suite on two cores one
    activation took longer than 30 s.  A failure prints what the server had of policies, bindings and
    policy refreshes."""
    start = time.monotonic()
    while True:
        allowed, out = check()
        if not allowed:
            return allowed, out
        waited = time.monotonic() - start
        assert waited < ACTIVATION_TIMEOUT_S, f"{what} was never refused: {out}\n{policy_refreshes(cluster)}"
        time.sleep(0.5)


#: How long a new policy may take to be enforced (see ``active``).
ACTIVATION_TIMEOUT_S = 90.0


def undo_as_admin(cluster: ClusterHandle, resource: str, name: str, namespace: str, patch: dict[str, Any]) -> None:
    """Undo a probe write that went through, as the admin.  Undone as the identity under test, the
    undo itself was refused when the policy became enforced between the two writes: the probe's change
    stayed, every later probe was then a no-op the policy allows (it compares old and new), and the
    policy looked unenforced for the whole bound (a CI failure)."""
    cluster.kubectl("patch", resource, name, "-n", namespace, "--type", "merge", "-p", json.dumps(patch))


def policy_refreshes(cluster: ClusterHandle) -> str:
    """The policies and bindings the server has, and its last policy refreshes (its log, when ours)."""
    listed = cluster.kubectl("get", "validatingadmissionpolicies,validatingadmissionpolicybindings",
                             "-o", "name", check=False).stdout
    log = Path(cluster.kubeconfig).parent / "logs" / "kube-apiserver.log"
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if "policy_source" in line or "syncing policies" in line] if log.is_file() else []
    return f"policies and bindings:\n{listed}\nthe API server's policy refreshes (last 20):\n" + "\n".join(lines[-20:])


@contextlib.contextmanager
def policy_status_controller(cluster: ClusterHandle, log: Path) -> Iterator[None]:
    """The controller manager's ValidatingAdmissionPolicy status controller alone (it writes each
    policy's type check into its status), for an API server that runs no controllers."""
    binary = build.ensure_binaries(["kube-controller-manager"])["kube-controller-manager"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(binary), "--kubeconfig", str(cluster.kubeconfig), "--leader-elect=false",
             "--controllers=validatingadmissionpolicy-status-controller",
             "--bind-address=127.0.0.1", f"--secure-port={free_port()}"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        stop(proc)


def test_the_policies_type_check_clean(api_server: ClusterHandle, api_release: Release, tmp_path: Path) -> None:
    """CEL type errors in a policy are warnings, not failures: the API server's type check must find
    none, for every policy of a release with every service account."""
    with policy_status_controller(api_server, tmp_path / "controller-manager.log"):
        for obj in api_release.objects:
            if obj["kind"] != "ValidatingAdmissionPolicy":
                continue
            name = obj["metadata"]["name"]
            deadline = time.monotonic() + 60
            while True:
                live = json.loads(api_server.kubectl("get", "validatingadmissionpolicy", name, "-o", "json").stdout)
                status = live.get("status") or {}
                if status.get("observedGeneration") == live["metadata"]["generation"]:
                    break
                assert time.monotonic() < deadline, f"policy {name} was never type-checked: {status}"
                time.sleep(0.5)
            assert not (status.get("typeChecking") or {}).get("expressionWarnings"), (name, status)


def test_the_node_agent_patches_only_its_own_nodes_cache_labels(cluster: ClusterHandle, namespace: str,
                                                                 release: Release) -> None:
    sa = release.sa("-node-agent")
    pod = pod_on_the_second_node(cluster, namespace, "agent", sa)
    agent = As(cluster, token(cluster, namespace, sa, pod))

    def foreign_label_on_own_node() -> tuple[bool, str]:
        allowed, out = agent.patch("node", OWN_NODE, {"metadata": {"labels": {"warmpool-test-probe": "x"}}})
        if allowed:  # not enforced yet: undone
            cluster.kubectl("label", "node", OWN_NODE, "warmpool-test-probe-")
        return allowed, out

    _, refused = active(foreign_label_on_own_node, "a label outside cache.warmpool.dev/ on the agent's own node",
                        cluster)
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

    # Another node (node 0, in the session's cluster), even with the very label it may set at
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
    pod_on_the_second_node(cluster, namespace, "worker", labels=worker_labels)
    pod_on_the_second_node(cluster, namespace, "stranger", labels={"team": "a"})
    operator = As(cluster, token(cluster, release.namespace, release.sa("")))

    def someone_elses_pod() -> tuple[bool, str]:
        return operator.patch("pod", "stranger", {"metadata": {"annotations": {ANNOTATION_TIER: "full"}}},
                              namespace)

    _, refused = active(someone_elses_pod, "a tier annotation on a pod that is not the operator's", cluster)
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


def test_the_operator_writes_only_its_warmmodels_worker_network_policies(cluster: ClusterHandle, namespace: str,
                                                                         release: Release) -> None:
    """Cluster-wide, RBAC lets the operator write every namespace's NetworkPolicies (it makes each
    pool's worker policy): the policy keeps it to its own, so a stolen token opens no team's policy."""
    operator = As(cluster, token(cluster, release.namespace, release.sa("")))
    owner = {"apiVersion": API_GROUP_VERSION, "kind": KIND, "name": "m",
             "uid": "00000000-0000-0000-0000-000000000002", "controller": True}
    ours: dict[str, Any] = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"m{WORKER_POLICY_SUFFIX}", "labels": {LABEL_MANAGED_BY: MANAGED_BY},
                     "ownerReferences": [owner]},
        "spec": {"podSelector": {"matchLabels": {"app": "m"}}, "policyTypes": ["Ingress"], "ingress": []}}
    group = "networking.k8s.io/v1"

    def a_teams_policy() -> tuple[bool, str]:
        allowed, out = operator.create_in(group, "networkpolicies", {
            **ours, "metadata": {"name": "allow-all-to-db"}, "spec": {"podSelector": {}, "ingress": [{}]}}, namespace)
        if allowed:  # not enforced yet: undone
            cluster.kubectl("delete", "networkpolicy", "allow-all-to-db", "-n", namespace)
        return allowed, out

    _, refused = active(a_teams_policy, "a NetworkPolicy of another name, unlabelled and owned by nobody", cluster)
    assert "may write only its WarmModels' worker NetworkPolicies" in refused, refused
    # Named after another WarmModel than the one owning it: refused too.
    allowed, out = operator.create_in(group, "networkpolicies", {
        **ours, "metadata": {**ours["metadata"], "name": f"other{WORKER_POLICY_SUFFIX}"}}, namespace)
    assert not allowed and "Forbidden" in out, out
    # Its own: made, and its rules rewritten (as a pass restores a hand edit).
    allowed, out = operator.create_in(group, "networkpolicies", ours, namespace)
    assert allowed, out
    allowed, out = operator.patch_in(group, "networkpolicies", ours["metadata"]["name"],
                                     {"spec": {"ingress": [{"ports": [{"port": 8080}]}]}}, namespace)
    assert allowed or "NotFound" in out or "404" in out, out
    # A team's own policy holding a worker-policy name: neither taken over nor opened.
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"theirs{WORKER_POLICY_SUFFIX}"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}))
    patches: list[dict[str, Any]] = [
        {"metadata": {"labels": {LABEL_MANAGED_BY: MANAGED_BY}, "ownerReferences": [{**owner, "name": "theirs"}]}},
        {"spec": {"ingress": [{}]}}]
    for patch in patches:
        allowed, out = operator.patch_in(group, "networkpolicies", f"theirs{WORKER_POLICY_SUFFIX}", patch, namespace)
        assert not allowed and "Forbidden" in out, (patch, out)
    live = json.loads(cluster.kubectl("get", "networkpolicy", f"theirs{WORKER_POLICY_SUFFIX}", "-n", namespace,
                                      "-o", "json").stdout)
    assert "ingress" not in live["spec"] and "labels" not in live["metadata"], live


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

    _, refused = active(someone_elses_secret, "a Secret of another name, unlabelled and owned by nobody", cluster)
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


# --------------------------------------------------------------------------- on an API server alone
#
# The rules below need no node: the chart's identities, RBAC and policies on a private API server
# (the api_server fixture), the service accounts acting with tokens it issues, and the operator's
# own code (control/children.py, control/zero.py) making its real writes as its service account.

#: Cluster-wide, every service account of the chart present.
API_VALUES: dict[str, Any] = {"watch": {"allNamespaces": True}, "nodeAgent": {"enabled": True},
                              "activator": {"enabled": True}}
#: A node of the API server's own (it runs no kubelet): the node agent's pod is bound to it.
AGENT_NODE = "node-a"
SCALE_TO_ZERO_SPEC: dict[str, Any] = {"model": {"hostPath": {"path": "/models/m"}},
                                      "pool": {"replicas": 1, "minWarm": 0, "scaleToZero": {"afterIdleSeconds": 60}}}
REFUSED_OWNER_CHANGE = "may not change an object's ownerReferences"
REFUSED_OWNER_SHAPE = "makes objects owned by one WarmModel"
REFUSED_SLICE = "may write only the EndpointSlices of its WarmModels' Services"
REFUSED_SLICE_CHANGE = "may change or delete only the EndpointSlices it made"
REFUSED_SLICE_SERVICE = "may write an EndpointSlice only for a Service its WarmModel owns"


@pytest.fixture()
def api_release(api_server: ClusterHandle, tmp_path: Path) -> Iterator[Release]:
    """The chart installed on the API server alone, its release namespace the test's own (with the
    default ServiceAccount the controller would make: pods are admitted only with one)."""
    namespace = f"ap-{uuid.uuid4().hex[:8]}"
    api_server.kubectl("create", "namespace", namespace)
    api_server.kubectl("create", "serviceaccount", "default", "-n", namespace)
    # Namespaces stay: deleting one needs the namespace controller, which this server lacks.
    with installed(api_server, namespace, tmp_path, API_VALUES) as made:
        assert {o["kind"] for o in made.objects} == set(KINDS), sorted({o["kind"] for o in made.objects})
        yield made


def plain_pod(cluster: ClusterHandle, namespace: str, name: str, sa: str = "default",
              labels: dict[str, str] | None = None, node: str | None = None) -> dict[str, Any]:
    """A pod nothing runs, as the admin makes it."""
    spec: dict[str, Any] = {"serviceAccountName": sa, "automountServiceAccountToken": False,
                            "containers": [{"name": "c", "image": "warmpool.invalid/none:0"}]}
    if node is not None:
        spec["nodeName"] = node
    manifest = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "labels": labels or {}}, "spec": spec}
    made: dict[str, Any] = json.loads(cluster.kubectl("create", "-f", "-", "-o", "json",
                                                     input=json.dumps(manifest)).stdout)
    return made


def admin_create(cluster: ClusterHandle, obj: dict[str, Any]) -> dict[str, Any]:
    made: dict[str, Any] = json.loads(cluster.kubectl("create", "-f", "-", "-o", "json",
                                                     input=json.dumps(obj)).stdout)
    return made


def warmmodel(cluster: ClusterHandle, namespace: str, name: str) -> dict[str, Any]:
    return admin_create(cluster, {"apiVersion": API_GROUP_VERSION, "kind": KIND,
                                  "metadata": {"name": name, "namespace": namespace},
                                  "spec": SCALE_TO_ZERO_SPEC})


def owner_ref(kind: str, name: str, uid: str | None = None, controller: bool | None = True,
              api_version: str = API_GROUP_VERSION) -> dict[str, Any]:
    ref: dict[str, Any] = {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid or str(uuid.uuid4())}
    if controller is not None:
        ref["controller"] = controller
    return ref


class AsApi(As):
    """:class:`As` with any API path and the verbs the rules here need; a refusal reads
    "<code>: <the Status's message>" (its JSON escapes the policies' < and >)."""

    def send(self, method: str, path: str, body: Any = None,
             content_type: str = "application/merge-patch+json") -> tuple[bool, str]:
        allowed, out = self._send(method, path, body, content_type)
        if allowed:
            return allowed, out
        code, _, text = out.partition(": ")
        with contextlib.suppress(ValueError, TypeError):
            text = str(json.loads(text)["message"])
        return allowed, f"{code}: {text}"


def slices_path(namespace: str, name: str | None = None) -> str:
    return f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices" + (f"/{name}" if name else "")


def test_the_operator_writes_and_deletes_only_its_warmmodels_endpointslices(api_server: ClusterHandle,
                                                                             api_release: Release) -> None:
    """A stolen operator token cannot redirect a Service that is not a WarmModel's: no slice that is
    not labelled, named and owned as the operator's own, and none of someone else's changed or deleted."""
    ns = api_release.namespace
    wm = warmmodel(api_server, ns, "m")
    operator = AsApi(api_server, token(api_server, ns, api_release.sa("")))
    # What the operator itself would write for WarmModel m (control/zero.py's desired slice, adopted).
    ours = operator_slice(ns, wm)
    # Someone else's Service and its slice (the EndpointSlice controller's).
    admin_create(api_server, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "victim", "namespace": ns},
                              "spec": {"selector": {"app": "victim"}, "ports": [{"name": "http", "port": 80}]}})
    theirs = admin_create(api_server, {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": "victim-abcde", "namespace": ns,
                     "labels": {LABEL_SERVICE_NAME: "victim",
                                LABEL_ENDPOINTSLICE_MANAGED_BY: "endpointslice-controller.k8s.io"}},
        "endpoints": [{"addresses": ["10.0.0.9"]}], "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]})

    def victim_slice() -> tuple[bool, str]:
        return undone_slice(operator, api_server, retarget(ours, "victim", owner_name="victim"))

    # Labelled, named and owned as the operator's, by a WarmModel "victim" (of a uid that does not
    # exist): the Service of that name is not that WarmModel's.
    _, refused = active(victim_slice, "an EndpointSlice for a Service that is not a WarmModel's", api_server)
    assert REFUSED_SLICE_SERVICE in refused, refused
    # Another WarmModel's Service, with that WarmModel's name but not its uid: refused alike.
    other = warmmodel(api_server, ns, "m2")
    admin_create(api_server, {"apiVersion": "v1", "kind": "Service", "metadata": {
        "name": "m2", "namespace": ns, "ownerReferences": [owner_ref(KIND, "m2", uid=other["metadata"]["uid"])]},
        "spec": {"ports": [{"name": "http", "port": 80}]}})
    allowed, out = active(lambda: undone_slice(operator, api_server, retarget(ours, "m2", owner_name="m2")),
                          "a slice of WarmModel m2's Service owned by another uid", api_server)
    assert REFUSED_SLICE_SERVICE in out, out
    # Owned by WarmModel m, but for Service victim: refused (by the slice rule and the Service rule).
    allowed, out = operator.send("POST", slices_path(ns), retarget(ours, "victim"), "application/json")
    assert not allowed and refused_by(out, REFUSED_SLICE, REFUSED_SLICE_SERVICE), out
    for tampered in (
        without_label(ours, LABEL_ENDPOINTSLICE_MANAGED_BY),  # the EndpointSlice controller would manage it
        renamed(ours, "m-extra"),  # a third slice of m's Service
        with_owners(ours, [owner_ref("Service", "m")]),
        with_owners(ours, [*ours["metadata"]["ownerReferences"], owner_ref(KIND, "m2", controller=False)]),
        with_owners(ours, []),
    ):
        allowed, out = operator.send("POST", slices_path(ns), tampered, "application/json")
        # (an owner that is not one WarmModel controlling it: the owner rule refuses that too)
        assert not allowed and refused_by(out, REFUSED_SLICE, REFUSED_OWNER_SHAPE), (tampered["metadata"], out)
    # Someone else's slice: not changed, not taken over (the owner rule refuses that too), not deleted.
    for patch in ({"endpoints": [{"addresses": ["10.0.0.66"]}]},
                  {"metadata": {"labels": ours["metadata"]["labels"],
                                "ownerReferences": ours["metadata"]["ownerReferences"]}}):
        allowed, out = operator.send("PATCH", slices_path(ns, "victim-abcde"), patch)
        assert not allowed and refused_by(out, REFUSED_SLICE_CHANGE, REFUSED_OWNER_CHANGE, REFUSED_SLICE_SERVICE), (
            patch, out)
    allowed, out = operator.send("DELETE", slices_path(ns, "victim-abcde"))
    assert not allowed and REFUSED_SLICE_CHANGE in out, out
    live = json.loads(api_server.kubectl("get", "endpointslice", "victim-abcde", "-n", ns, "-o", "json").stdout)
    assert live["endpoints"] == theirs["endpoints"] and live["metadata"]["labels"] == theirs["metadata"]["labels"]

    # Its own slice, made: it may not be pointed at another Service nor given another owner.
    allowed, out = operator.send("POST", slices_path(ns), ours, "application/json")
    assert allowed, out
    allowed, out = operator.send("PATCH", slices_path(ns, ours["metadata"]["name"]),
                                 {"metadata": {"labels": {LABEL_SERVICE_NAME: "victim"}}})
    assert not allowed and refused_by(out, REFUSED_SLICE, REFUSED_SLICE_SERVICE), out
    allowed, out = operator.send("PATCH", slices_path(ns, ours["metadata"]["name"]),
                                 {"metadata": {"labels": {LABEL_ENDPOINTSLICE_MANAGED_BY: None}}})
    assert not allowed and REFUSED_SLICE in out, out


def refused_by(answer: str, *rules: str) -> bool:
    """Whether ``answer`` is a refusal by one of ``rules`` (the API server names the first policy
    that denies, in an order of its own, when several do)."""
    return answer.startswith("403") and any(rule in answer for rule in rules)


def undone_slice(operator: AsApi, cluster: ClusterHandle, slice_obj: dict[str, Any]) -> tuple[bool, str]:
    """Create ``slice_obj`` as the operator; one that went through (a policy not enforced yet) is deleted."""
    meta = slice_obj["metadata"]
    allowed, out = operator.send("POST", slices_path(meta["namespace"]), slice_obj, "application/json")
    if allowed:
        cluster.kubectl("delete", "endpointslice", meta["name"], "-n", meta["namespace"])
    return allowed, out


def operator_slice(namespace: str, wm: dict[str, Any]) -> dict[str, Any]:
    """The activator's slice of WarmModel ``wm``'s Service, as control/zero.py writes it."""
    target = Target(wm["metadata"]["name"], namespace, parse_spec(wm["spec"]))
    _, activator_slice = zero_rules.build_slices(target, [], [zero_rules.Endpoint("10.1.0.5", "act-0", namespace,
                                                                                   str(uuid.uuid4()))], 8012)
    kopf.adopt(activator_slice, owner=wm)  # type: ignore[arg-type]
    return activator_slice


def retarget(slice_obj: dict[str, Any], service: str, owner_name: str | None = None) -> dict[str, Any]:
    out = copy.deepcopy(slice_obj)
    out["metadata"]["labels"][LABEL_SERVICE_NAME] = service
    out["metadata"]["name"] = service + ACTIVATOR_SLICE_SUFFIX
    if owner_name is not None:
        out["metadata"]["ownerReferences"][0]["name"] = owner_name
    return out


def without_label(slice_obj: dict[str, Any], key: str) -> dict[str, Any]:
    out = copy.deepcopy(slice_obj)
    del out["metadata"]["labels"][key]
    return out


def renamed(slice_obj: dict[str, Any], name: str) -> dict[str, Any]:
    out = copy.deepcopy(slice_obj)
    out["metadata"]["name"] = name
    return out


def with_owners(obj: dict[str, Any], refs: list[dict[str, Any]]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["ownerReferences"] = refs
    return out


async def test_the_operators_own_writes_pass_every_policy(api_server: ClusterHandle, api_release: Release,
                                                         tmp_path: Path) -> None:
    """The operator's code, as its service account: a scale-to-zero WarmModel's children made, one
    drifted and applied back, its Service's two slices written, switched (server-side apply),
    replaced whole and deleted when the pool drops scaleToZero."""
    ns = api_release.namespace
    operator_token = token(api_server, ns, api_release.sa(""))
    tester = AsApi(api_server, operator_token)
    wm = warmmodel(api_server, ns, "m")

    def foreign_owner() -> tuple[bool, str]:
        return tester.send("POST", f"/api/v1/namespaces/{ns}/configmaps", {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"probe-{uuid.uuid4().hex[:6]}", "ownerReferences": [owner_ref("Deployment", "x")]}},
            "application/json")

    # Both policies enforced before anything is written: what passes below passed them.
    active(foreign_owner, "an object owned by a Deployment", api_server)
    active(lambda: undone_slice(tester, api_server, without_label(operator_slice(ns, wm),
                                                                  LABEL_ENDPOINTSLICE_MANAGED_BY)),
           "an unlabelled EndpointSlice", api_server)

    kubeconfig = _token_kubeconfig(api_server, operator_token, tmp_path / "operator.kubeconfig")
    operator = Kube(await config.new_client_from_config(config_file=str(kubeconfig)))
    harness = ApiCluster(RecordingKube(await config.new_client_from_config(config_file=str(api_server.kubeconfig))),
                         ns)
    try:
        target = Target("m", ns, parse_spec(wm["spec"]))
        settled = children.Settled()
        # Cluster-wide, the chart has the operator make the pool's worker NetworkPolicy too (its RBAC).
        ingress = ({"ports": [{"port": "http", "protocol": "TCP"}], "from": [{"podSelector": {}}]},)
        made = await children.ensure_supporting(operator, harness.cache, target, wm, settled, b"k" * 32, "",
                                                ingress)
        assert not made.conflicts and made.token
        policy_name = builders.network_policy_name("m")
        opened = await harness.kube.get_obj("networkpolicies", ns, policy_name)
        assert opened is not None
        await harness.kube.put("networkpolicies", {**opened, "spec": {**opened["spec"], "ingress": [{}]}})
        await harness.watch()
        await children.ensure(operator, harness.cache, builders.build_network_policy(target, ingress), wm, settled)
        restored = await harness.kube.get_obj("networkpolicies", ns, policy_name)
        assert restored is not None and restored["spec"]["ingress"] == list(ingress)
        await children.ensure(operator, harness.cache, builders.build_deployment(target, replicas=1), wm, settled)
        await harness.watch()
        # A field of ours edited by hand: applied back (an UPDATE keeping the owner).
        live = await harness.kube.get_obj("services", ns, "m")
        assert live is not None and live["metadata"]["ownerReferences"][0]["uid"] == wm["metadata"]["uid"]
        await harness.kube.put("services", {**live, "spec": {**live["spec"], "publishNotReadyAddresses": True}})
        await harness.watch()
        fixed = await children.ensure(operator, harness.cache, builders.build_service(target), wm, settled)
        assert not fixed["spec"].get("publishNotReadyAddresses")

        board = zero_control.ActivatorBoard()
        board.update("ADDED", {"metadata": {"uid": "a"}, "ports": [{"name": "http", "port": 8012}],
                               "endpoints": [{"addresses": ["10.1.0.5"], "conditions": {"ready": True},
                                              "targetRef": {"name": "act-0", "namespace": ns, "uid": "u"}}]})
        assert await zero_control.route(operator, harness.cache, target, wm, settled, [], board) == []
        await harness.watch()
        pod = zero_rules.Endpoint("10.0.0.1", "m-0", ns, str(uuid.uuid4()))
        assert await zero_control.route(operator, harness.cache, target, wm, settled, [pod], board) == []
        await harness.watch()
        pods_slice = await harness.kube.get_obj("endpointslices", ns, zero_rules.pods_slice_name("m"))
        assert pods_slice is not None and [e["addresses"] for e in pods_slice["endpoints"]] == [["10.0.0.1"]]
        # Replaced whole (control/children.py's last resort): a PUT of the live object, owners kept.
        replaced = await operator.replace({**pods_slice, "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                           "endpoints": []})
        assert replaced["metadata"]["ownerReferences"] == pods_slice["metadata"]["ownerReferences"]
        await harness.watch()
        await zero_control.unroute(operator, harness.cache, target)
        for name in zero_rules.slice_names("m"):
            assert await harness.kube.get_obj("endpointslices", ns, name) is None, name
        # The pass's last step: its status (RBAC: a patch of the status subresource, nothing more).
        await write_status(operator, wm, {"observedGeneration": wm["metadata"]["generation"], "replicas": 0})
        written = await harness.kube.get_obj(PLURAL, ns, "m")
        assert written is not None and written["status"]["observedGeneration"] == wm["metadata"]["generation"]
    finally:
        await operator.close()
        await harness.close()


def test_no_service_account_of_the_chart_changes_an_owner_reference(api_server: ClusterHandle,
                                                                    api_release: Release) -> None:
    """An owner reference pointed at a uid that does not exist gets the object deleted by the garbage
    collector: the operator, the node agent and the activator change none, and make objects owned
    only as the operator's children are (one WarmModel, their controller) or not at all."""
    ns = api_release.namespace
    operator = AsApi(api_server, token(api_server, ns, api_release.sa("")))
    wm = warmmodel(api_server, ns, "m")
    missing = [owner_ref(KIND, "m", uid=str(uuid.uuid4()))]
    admin_create(api_server, {"apiVersion": "v1", "kind": "ConfigMap",
                              "metadata": {"name": "theirs", "namespace": ns}, "data": {"k": "v"}})

    def point_theirs_at_a_missing_owner() -> tuple[bool, str]:
        allowed, out = operator.send("PATCH", f"/api/v1/namespaces/{ns}/configmaps/theirs",
                                     {"metadata": {"ownerReferences": missing}})
        if allowed:  # not enforced yet: undone by the admin (see undo_as_admin)
            undo_as_admin(api_server, "configmap", "theirs", ns, {"metadata": {"ownerReferences": None}})
        return allowed, out

    _, refused = active(point_theirs_at_a_missing_owner, "an owner reference put on someone else's ConfigMap",
                        api_server)
    assert REFUSED_OWNER_CHANGE in refused, refused
    # Someone else's Deployment, and the operator's own worker pod (the pod policy allows its
    # awake label and tier annotations, not this): refused alike.
    template = {"metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "warmpool.invalid/none:0"}]}}
    admin_create(api_server, {"apiVersion": "apps/v1", "kind": "Deployment",
                              "metadata": {"name": "app", "namespace": ns},
                              "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": template}})
    plain_pod(api_server, ns, "worker", labels={LABEL_MANAGED_BY: MANAGED_BY, LABEL_AWAKE: AWAKE_TRUE})
    for path in (f"/apis/apps/v1/namespaces/{ns}/deployments/app", f"/api/v1/namespaces/{ns}/pods/worker"):
        allowed, out = operator.send("PATCH", path, {"metadata": {"ownerReferences": missing}})
        assert not allowed and REFUSED_OWNER_CHANGE in out, (path, out)
    # A child of its own made, then orphaned or re-owned: refused.
    child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "m-warmup", "labels": {LABEL_MANAGED_BY: MANAGED_BY},
        "ownerReferences": [owner_ref(KIND, "m", uid=wm["metadata"]["uid"])]}}
    allowed, out = operator.send("POST", f"/api/v1/namespaces/{ns}/configmaps", child, "application/json")
    assert allowed, out
    for refs in (None, missing):
        allowed, out = operator.send("PATCH", f"/api/v1/namespaces/{ns}/configmaps/m-warmup",
                                     {"metadata": {"ownerReferences": refs}})
        assert not allowed and REFUSED_OWNER_CHANGE in out, (refs, out)
    # Made with an owner that is not one WarmModel controlling it: refused; with none: allowed.
    for refs in ([owner_ref("Deployment", "app", api_version="apps/v1")],
                 [owner_ref(KIND, "m", uid=wm["metadata"]["uid"], controller=None)],
                 [owner_ref(KIND, "m", uid=wm["metadata"]["uid"]), owner_ref(KIND, "n", controller=False)],
                 [owner_ref(KIND, "m", api_version="evil.example/v1")]):
        made = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": f"c-{uuid.uuid4().hex[:6]}", "ownerReferences": refs}}
        allowed, out = operator.send("POST", f"/api/v1/namespaces/{ns}/configmaps", made, "application/json")
        assert not allowed and REFUSED_OWNER_SHAPE in out, (refs, out)

    # The activator (its token bound to its pod): the held-annotation policy lets this patch through
    # (no annotation, spec, label or finalizer changed); the owner rule does not.
    activator_pod = plain_pod(api_server, ns, "activator-0", sa=api_release.sa("-activator"))
    activator = AsApi(api_server, token(api_server, ns, api_release.sa("-activator"), activator_pod))
    allowed, out = activator.send("PATCH", f"/apis/{API_GROUP_VERSION}/namespaces/{ns}/{PLURAL}/m",
                                  {"metadata": {"ownerReferences": missing}})
    assert not allowed and REFUSED_OWNER_CHANGE in out, out

    # The node agent (its token bound to its pod on a node): its own Node's owners, and a Lease
    # of its own made with one.
    node = admin_create(api_server, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": AGENT_NODE}})
    try:
        agent_pod = plain_pod(api_server, ns, "agent-0", sa=api_release.sa("-node-agent"), node=AGENT_NODE)
        agent = AsApi(api_server, token(api_server, ns, api_release.sa("-node-agent"), agent_pod))
        allowed, out = agent.send("PATCH", f"/api/v1/nodes/{AGENT_NODE}", {"metadata": {"ownerReferences": [
            owner_ref("Node", AGENT_NODE, api_version="v1")]}})
        assert not allowed and REFUSED_OWNER_CHANGE in out, out
        allowed, out = agent.send("PATCH", f"/api/v1/nodes/{AGENT_NODE}",
                                  {"metadata": {"labels": {CACHE_LABEL: CACHE_NODE_LABEL_VALUE}}})
        assert allowed, out  # what it does write, still allowed
        node_owner = owner_ref("Node", AGENT_NODE, node["metadata"]["uid"], api_version="v1")
        lease: dict[str, Any] = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                 "metadata": {"name": "fill-x", "ownerReferences": [node_owner]},
                                 "spec": {"holderIdentity": AGENT_NODE}}
        allowed, out = agent.send("POST", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases", lease,
                                  "application/json")
        assert not allowed and REFUSED_OWNER_SHAPE in out, out
        del lease["metadata"]["ownerReferences"]
        allowed, out = agent.send("POST", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases", lease,
                                  "application/json")
        assert allowed, out
    finally:
        api_server.kubectl("delete", "node", AGENT_NODE, "--wait=false", check=False)
    live = json.loads(api_server.kubectl("get", "configmap", "theirs", "-n", ns, "-o", "json").stdout)
    assert "ownerReferences" not in live["metadata"]


def test_the_activator_changes_only_its_own_held_annotation(api_server: ClusterHandle, api_release: Release) -> None:
    """Its token is bound to its pod (as a Deployment pod's is): the policy reads the pod's name
    from it, so one replica cannot touch another's count, nor anything else of the WarmModel."""
    ns = api_release.namespace
    warmmodel(api_server, ns, "m")
    pod = plain_pod(api_server, ns, "activator-0", sa=api_release.sa("-activator"))
    activator = AsApi(api_server, token(api_server, ns, api_release.sa("-activator"), pod))
    path = f"/apis/{API_GROUP_VERSION}/namespaces/{ns}/{PLURAL}/m"

    def patch(body: dict[str, Any]) -> tuple[bool, str]:
        return activator.send("PATCH", path, body)

    def anothers_count() -> tuple[bool, str]:
        allowed, out = patch({"metadata": {"annotations": {held_annotation("activator-1"): "1 1"}}})
        if allowed:  # not enforced yet: undone by the admin (see undo_as_admin)
            undo_as_admin(api_server, PLURAL, "m", ns,
                          {"metadata": {"annotations": {held_annotation("activator-1"): None}}})
        return allowed, out

    _, refused = active(anothers_count, "another replica's held annotation", api_server)
    assert "may change only its own annotation" in refused, refused
    allowed, out = patch({"metadata": {"annotations": {held_annotation("activator-0"): held_value(3, time.time())}}})
    assert allowed, out
    allowed, out = patch({"metadata": {"annotations": {held_annotation("activator-0"): None}}})
    assert allowed, out
    allowed, out = patch({"spec": {"pool": {"replicas": 3}}})
    assert not allowed and "may not change a WarmModel's spec" in out, out
    allowed, out = patch({"metadata": {"labels": {"team": "x"}}})
    assert not allowed, out
    live = json.loads(api_server.kubectl("get", PLURAL, "m", "-n", ns, "-o", "json").stdout)
    assert live["spec"]["pool"]["replicas"] == 1 and not (live["metadata"].get("annotations") or {})


def test_the_activators_held_value_is_well_formed_bounded_and_not_ahead_of_the_api_server(
        api_server: ClusterHandle, api_release: Release) -> None:
    """A stolen activator token cannot hold a pool up for ever: its count has the contract's format
    and bound, and its time is no later than the API server's clock plus the contract's skew (read
    from the managedFields entry the API server stamps on the write, which a client cannot forge)."""
    ns = api_release.namespace
    warmmodel(api_server, ns, "m")
    pod = plain_pod(api_server, ns, "activator-0", sa=api_release.sa("-activator"))
    activator = AsApi(api_server, token(api_server, ns, api_release.sa("-activator"), pod))
    own = held_annotation("activator-0")
    path = f"/apis/{API_GROUP_VERSION}/namespaces/{ns}/{PLURAL}/m"

    def write(value: str | None, **meta: Any) -> tuple[bool, str]:
        return activator.send("PATCH", path, {"metadata": {"annotations": {own: value}, **meta}})

    def far_future() -> tuple[bool, str]:
        allowed, out = write(held_value(1, time.time() + 3600))
        if allowed:  # not enforced yet: undone by the admin (see undo_as_admin)
            undo_as_admin(api_server, PLURAL, "m", ns, {"metadata": {"annotations": {own: None}}})
        return allowed, out

    _, refused = active(far_future, "a held time an hour ahead", api_server)
    assert f"at most {HELD_CLOCK_SKEW_SECONDS} s past the clock of the API server" in refused, refused
    trace = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    for value in (held_value(3, time.time()), held_value(3, time.time(), trace),
                  held_value(HELD_COUNT_MAX, time.time()), held_value(2, 1_700_000_000),
                  held_value(1, time.time() + HELD_CLOCK_SKEW_SECONDS - 10)):
        allowed, out = write(value)
        assert allowed, (value, out)
    for value in ("3", "3 abc", "-1 1700000000", "3  1700000000", f"3 {int(time.time())} not-a-trace",
                  "1234567 1700000000", "3 17000000000", f"3 {int(time.time())} {trace} x", " 3 1700000000"):
        allowed, out = write(value)
        assert not allowed and "must be '<requests held> <unix seconds>'" in out, (value, out)
    allowed, out = write(held_value(HELD_COUNT_MAX + 1, time.time()))
    assert not allowed and f"at most {HELD_COUNT_MAX} held requests" in out, out
    allowed, out = write(held_value(1, time.time() + HELD_CLOCK_SKEW_SECONDS + 30))
    assert not allowed and "past the clock of the API server" in out, out
    # A managedFields entry of the client's own, stamped far ahead and owning the annotation, does
    # not move the API server's clock: the write takes the field from it and stamps its own time.
    forged = [{"manager": "forger", "operation": "Update", "apiVersion": API_GROUP_VERSION,
               "time": "2100-01-01T00:00:00Z", "fieldsType": "FieldsV1",
               "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{own}": {}}}}}]
    allowed, out = write(held_value(1, time.time() + 3600), managedFields=forged)
    assert not allowed and "past the clock of the API server" in out, out
    # Nor does a reset of them ([{}] strips every entry): no stamp to read, refused.
    allowed, out = write(held_value(1, time.time() + 3600), managedFields=[{}])
    assert not allowed and "past the clock of the API server" in out, out
    allowed, out = write(None)
    assert allowed, out
    live = json.loads(api_server.kubectl("get", PLURAL, "m", "-n", ns, "-o", "json").stdout)
    assert own not in (live["metadata"].get("annotations") or {})
