"""In-cluster API access from pods on the real node, as the pod's own ServiceAccount.

The kubelet mounts a bound token for the pod's ServiceAccount and sets ``KUBERNETES_SERVICE_HOST``
and ``_PORT`` to the ``kubernetes`` Service, which kube-proxy sends to the API server.  A pod of
the operator image runs two clients the way the operator logs in -- kubernetes_asyncio
(in-cluster, falling back to a kubeconfig, like warmpool's operator) and the operator's kopf
login handler (the service account, at the address the kubelet gives; no cluster DNS here) --
against a Role that allows configmaps and nothing else: the identity must be the
ServiceAccount's, configmaps allowed, secrets refused with 403.
"""

from __future__ import annotations

import json
import textwrap
import time
from typing import Any

import pytest
import yaml
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
        from warmpool_operator.app.handlers import login  # the operator's own kopf login handler

        info = login(settings=kopf.OperatorSettings())
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

#: No token mounted: the API server's address is there, credentials are not.
NO_TOKEN_CHECK = textwrap.dedent(
    """
    echo "host=$KUBERNETES_SERVICE_HOST port=$KUBERNETES_SERVICE_PORT kubeconfig=${KUBECONFIG:-}"
    [ "$KUBERNETES_SERVICE_HOST" = 10.96.0.1 ] && [ -n "$KUBERNETES_SERVICE_PORT" ] && [ -z "${KUBECONFIG:-}" ] \\
      && [ ! -e /var/run/secrets/kubernetes.io/serviceaccount/token ] && echo "RESULT ok"
    """
)


def _container(name: str, image: str, command: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
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
    proc = cluster.kubectl("logs", "-n", namespace, pod, "-c", container, check=False)
    return proc.stdout + proc.stderr


def test_pod_talks_to_the_api_as_its_service_account(cluster: ClusterHandle, namespace: str) -> None:
    if "operator" not in cluster.images:
        pytest.skip("runs the checkout's operator image: needs our own cluster, not WARMPOOL_KUBECONFIG")
    image = cluster.images["operator"]
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SA}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "configmap-reader"},
         "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "reader"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmap-reader"},
         "subjects": [{"kind": "ServiceAccount", "name": SA, "namespace": namespace}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "scripts"},
         "data": {"client.py": CLIENT_CHECK, "no-token.sh": NO_TOKEN_CHECK}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hidden"}, "stringData": {"k": "v"}},
        _pod("sa-client", [_container("client", image, ["python", "/scripts/client.py"])], serviceAccountName=SA),
        _pod("no-token", [_container("check", image, ["/bin/sh", "/scripts/no-token.sh"])],
             serviceAccountName=SA, automountServiceAccountToken=False),
    ]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objects))

    phase = _wait_finished(cluster, namespace, "sa-client")
    report = _log(cluster, namespace, "sa-client", "client")
    assert phase == "Succeeded", f"phase {phase!r}\n{report}"
    assert "login: in-cluster" in report, report
    assert f"user: system:serviceaccount:{namespace}:{SA}" in report, report
    assert "secrets: refused 403" in report, report
    assert "kopf login: secrets -> 403" in report, report

    no_token = _wait_finished(cluster, namespace, "no-token")
    assert no_token == "Succeeded", _log(cluster, namespace, "no-token", "check")
