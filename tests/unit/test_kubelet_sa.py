"""The local kubelet's service-account pieces: token requests and refresh, env, kubeconfig."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from warmpool_devcluster.kubelet_sa import (
    SA_MOUNT_PATH,
    IssuedToken,
    PodTokens,
    TokenSpec,
    api_server_env,
    container_sa_env,
    inherited_env,
    issued_token,
    sa_kubeconfig,
    sa_kubeconfig_path,
    sa_volume,
    service_account_name,
    token_request,
    token_specs,
)

pytestmark = pytest.mark.unit

SERVER = "https://127.0.0.1:6443"


def _pod(**spec: Any) -> dict[str, Any]:
    volumes = [
        {"name": "kube-api-access-x", "projected": {"sources": [
            {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        ]}},
        {"name": "vault", "projected": {"sources": [
            {"serviceAccountToken": {"path": "vault-token", "audience": "vault", "expirationSeconds": 600}},
        ]}},
        {"name": "data", "emptyDir": {}},
    ]
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1"},
            "spec": {"serviceAccountName": "op", "containers": [], "volumes": volumes, **spec}}


def test_token_specs_and_request_body() -> None:
    pod = _pod()
    assert token_specs(pod) == {TokenSpec("", 3607), TokenSpec("vault", 600)}
    assert TokenSpec.from_source({"path": "t"}) == TokenSpec("", 3600)  # the API's default
    assert service_account_name(pod) == "op"
    assert service_account_name({"spec": {}}) == "default"
    body = token_request(pod, TokenSpec("vault", 600))
    assert body["spec"] == {
        "audiences": ["vault"], "expirationSeconds": 600,
        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u-1"},
    }
    assert token_request(pod, TokenSpec("", 3607))["spec"]["audiences"] == []


def test_issued_token_lifetime_and_refresh_point() -> None:
    now = 1_700_000_000.0
    response = {"status": {"token": "abc", "expirationTimestamp": "2023-11-14T22:30:00Z"}}  # now + 1000 s
    issued = issued_token(response, TokenSpec("", 3600), now)
    assert issued == IssuedToken(b"abc", now, now + 1000)
    assert issued.refresh_at == pytest.approx(now + 800)
    # A server clock far ahead cannot stretch the lifetime beyond what was asked.
    assert issued_token(response, TokenSpec("", 600), now).expires_at == now + 600
    # Refresh no later than a day, even for a year-long token.
    assert IssuedToken(b"x", 0.0, 365 * 86400.0).refresh_at == 86400.0
    with pytest.raises(ValueError):
        issued_token({"status": {}}, TokenSpec("", 600), now)


class _FakeApi:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.fail = False

    async def __call__(self, account: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((account, namespace, body))
        if self.fail:
            raise ApiException(status=503, reason="unavailable")
        return {"status": {"token": f"t{len(self.calls)}"}}


def test_pod_tokens_cache_refresh_and_keep_on_failure() -> None:
    clock = [1000.0]
    api = _FakeApi()
    tokens = PodTokens(api, clock=lambda: clock[0])
    pod = _pod(volumes=[_pod()["spec"]["volumes"][0]])  # one token, 3607 s
    key = TokenSpec("", 3607).key

    got = asyncio.run(tokens.fetch(pod))
    assert got == {key: b"t1"}
    assert api.calls[0][:2] == ("op", "ns")
    clock[0] += 0.79 * 3607
    assert asyncio.run(tokens.fetch(pod)) == {key: b"t1"} and len(api.calls) == 1
    clock[0] += 0.02 * 3607  # past 80 %: re-requested
    assert asyncio.run(tokens.fetch(pod)) == {key: b"t2"}
    # A failed refresh keeps the old token while it is valid, then drops it.
    api.fail = True
    clock[0] += 0.85 * 3607
    assert asyncio.run(tokens.fetch(pod)) == {key: b"t2"}
    clock[0] += 0.2 * 3607
    assert asyncio.run(tokens.fetch(pod)) == {}


def test_env_kubeconfig_and_inherited() -> None:
    assert api_server_env(SERVER) == {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443",
                                      "KUBERNETES_SERVICE_PORT_HTTPS": "6443"}
    assert inherited_env({"PATH": "/bin", "KUBECONFIG": "/admin"}) == {"PATH": "/bin"}

    mounted = {"name": "c", "volumeMounts": [{"name": "kube-api-access-x", "mountPath": SA_MOUNT_PATH + "/"}]}
    sub = {"name": "c", "volumeMounts": [{"name": "v", "mountPath": SA_MOUNT_PATH, "subPath": "x"}]}
    assert sa_volume(mounted) == "kube-api-access-x"
    assert sa_volume(sub) is None and sa_volume({"name": "c"}) is None

    pod_dir = Path("/w/pods/ns/p")
    written = {"kube-api-access-x": {"token": (b"T", 0o600), "ca.crt": (b"CA", 0o644)}}
    env = container_sa_env(mounted, SERVER, pod_dir, written)
    assert env["KUBECONFIG"] == str(pod_dir / "volumes" / "kube-api-access-x.kubeconfig")
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    # No token mounted (automountServiceAccountToken: false, or no token written): no KUBECONFIG.
    assert "KUBECONFIG" not in container_sa_env({"name": "c"}, SERVER, pod_dir, written)
    assert "KUBECONFIG" not in container_sa_env(mounted, SERVER, pod_dir, {"kube-api-access-x": {}})

    volume_dir = pod_dir / "volumes" / "kube-api-access-x"
    config = sa_kubeconfig(SERVER, volume_dir, b"T", "ns", has_ca=True)
    assert sa_kubeconfig_path(pod_dir, "kube-api-access-x").parent == volume_dir.parent
    assert config["clusters"][0]["cluster"] == {"server": SERVER,
                                                "certificate-authority": str(volume_dir / "ca.crt")}
    assert config["users"][0]["user"] == {"token": "T", "tokenFile": str(volume_dir / "token")}
    assert config["contexts"][0]["context"]["namespace"] == "ns"
    assert "certificate-authority" not in sa_kubeconfig(SERVER, volume_dir, b"T", "ns", False)["clusters"][0]["cluster"]
