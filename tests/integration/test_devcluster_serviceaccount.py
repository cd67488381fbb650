"""In-cluster API access from pods of the local cluster, as the pod's own ServiceAccount.

The local kubelet requests a bound token for the pod's ServiceAccount and points in-cluster
clients at it (``KUBERNETES_SERVICE_HOST``/``_PORT`` and a ``KUBECONFIG`` using the token).
A pod here runs three clients the way an operator pod would log in — kubernetes_asyncio
(in-cluster, falling back to the kubeconfig, like warmpool's operator), kopf's own login
handlers, and kubectl — against a Role that allows configmaps and nothing else: the
identity must be the ServiceAccount's, configmaps allowed, secrets refused with 403.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from typing import Any

import pytest
import yaml
from warmpool_devcluster.build import ensure_binaries
from warmpool_devcluster.testing import ClusterHandle

pytestmark = pytest.mark.integration

SA = "reader"

#: kubernetes_asyncio login as warmpool's operator does it, then kopf's login handlers.
CLIENT_CHECK = textwrap.dedent(
    """
    import asyncio, os, ssl, sys
    import aiohttp, kopf
    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.client.exceptions import ApiException

    NS = os.environ["POD_NAMESPACE"]
    WANT_USER = f"system:serviceaccount:{NS}:reader"

    async def main() -> bool:
        try:
            config.load_incluster_config()
            api = client.ApiClient()
            print("login: in-cluster")
        except config.ConfigException as error:
            print("login: in-cluster unavailable here:", error)
            api = await config.new_client_from_config()
            print("login: kubeconfig", os.environ.get("KUBECONFIG"))
        ok = True
        async with api:
            review = await client.AuthenticationV1Api(api).create_self_subject_review(
                client.V1SelfSubjectReview())
            user = review.status.user_info.username
            print("user:", user)
            ok &= user == WANT_USER
            cms = await client.CoreV1Api(api).list_namespaced_config_map(NS)
            print("configmaps: allowed", len(cms.items))
            try:
                await client.CoreV1Api(api).list_namespaced_secret(NS)
                print("secrets: ALLOWED")
                ok = False
            except ApiException as error:
                print("secrets: refused", error.status)
                ok &= error.status == 403
        settings = kopf.OperatorSettings()
        info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
        assert info is not None and info.token, "kopf found no credentials"
        context = ssl.create_default_context(cafile=info.ca_path)
        headers = {"Authorization": f"Bearer {info.token}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            for kind, want in (("configmaps", 200), ("secrets", 403)):
                url = f"{info.server}/api/v1/namespaces/{NS}/{kind}"
                async with session.get(url, ssl=context) as response:
                    print(f"kopf login: {kind} ->", response.status)
                    ok &= response.status == want
        return ok

    ok = asyncio.run(main())
    print("RESULT", "ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)
    """
)

#: kubectl reads KUBECONFIG (tokenFile + CA); $1 is the kubectl binary.
KUBECTL_CHECK = textwrap.dedent(
    """
    K="$1"
    user=$("$K" auth whoami -o jsonpath='{.status.userInfo.username}')
    echo "user: $user"
    [ "$user" = "system:serviceaccount:$POD_NAMESPACE:reader" ] || exit 1
    "$K" get configmaps -n "$POD_NAMESPACE" -o name || exit 1
    out=$("$K" get secrets -n "$POD_NAMESPACE" 2>&1)
    echo "secrets: $out"
    echo "$out" | grep -q Forbidden || exit 1
    echo "RESULT ok"
    """
)

#: No token mounted: the API server's address is there, credentials are not.
NO_TOKEN_CHECK = textwrap.dedent(
    """
    echo "host=$KUBERNETES_SERVICE_HOST port=$KUBERNETES_SERVICE_PORT kubeconfig=${KUBECONFIG:-}"
    [ "$KUBERNETES_SERVICE_HOST" = 127.0.0.1 ] && [ -n "$KUBERNETES_SERVICE_PORT" ] && [ -z "${KUBECONFIG:-}" ] \\
      && [ ! -e /var/run/secrets/kubernetes.io/serviceaccount/token ] && echo "RESULT ok"
    """
)


def _container(name: str, command: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "image": "python:3.11-slim",  # never pulled: the local kubelet runs the command itself
        "command": command,
        "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "volumeMounts": [{"name": "scripts", "mountPath": "/scripts"}],
    }


def _pod(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "containers": containers,
                 "volumes": [{"name": "scripts", "configMap": {"name": "scripts"}}], **spec},
    }


def _wait_finished(cluster: ClusterHandle, namespace: str, pod: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    phase = ""
    while time.monotonic() < deadline:
        out = cluster.kubectl("get", "pod", pod, "-n", namespace, "-o", "json").stdout
        phase = str((json.loads(out).get("status") or {}).get("phase") or "")
        if phase in ("Succeeded", "Failed"):
            return phase
        time.sleep(0.5)
    return phase


def _log(cluster: ClusterHandle, namespace: str, pod: str, container: str) -> str:
    log_dir = cluster.pod_log_dir(namespace, pod)
    assert log_dir is not None
    path = log_dir / f"{container}.log"
    return path.read_text(errors="replace") if path.is_file() else "(no log)"


def test_pod_talks_to_the_api_as_its_service_account(cluster: ClusterHandle, namespace: str) -> None:
    if cluster.work_dir is None:
        pytest.skip("runs pods as local processes: needs our own cluster, not WARMPOOL_KUBECONFIG")
    kubectl = str(ensure_binaries(["kubectl"])["kubectl"].resolve())
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SA}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "configmap-reader"},
         "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "reader"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmap-reader"},
         "subjects": [{"kind": "ServiceAccount", "name": SA, "namespace": namespace}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "scripts"},
         "data": {"client.py": CLIENT_CHECK, "kubectl.sh": KUBECTL_CHECK, "no-token.sh": NO_TOKEN_CHECK}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hidden"}, "stringData": {"k": "v"}},
        _pod("sa-client", [
            _container("client", [sys.executable, "/scripts/client.py"]),
            _container("kubectl", ["/bin/sh", "/scripts/kubectl.sh", kubectl]),
        ], serviceAccountName=SA),
        _pod("no-token", [_container("check", ["/bin/sh", "/scripts/no-token.sh"])],
             serviceAccountName=SA, automountServiceAccountToken=False),
    ]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objects))

    phase = _wait_finished(cluster, namespace, "sa-client")
    logs = {c: _log(cluster, namespace, "sa-client", c) for c in ("client", "kubectl")}
    report = "\n".join(f"--- {c}\n{text}" for c, text in logs.items())
    assert phase == "Succeeded", f"phase {phase!r}\n{report}"
    user = f"system:serviceaccount:{namespace}:{SA}"
    assert f"user: {user}" in logs["client"] and f"user: {user}" in logs["kubectl"], report
    assert "secrets: refused 403" in logs["client"], report
    assert "kopf login: secrets -> 403" in logs["client"], report
    assert "Forbidden" in logs["kubectl"], report

    no_token = _wait_finished(cluster, namespace, "no-token")
    assert no_token == "Succeeded", _log(cluster, namespace, "no-token", "check")
