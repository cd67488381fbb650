"""A pod's own ServiceAccount identity for the local kubelet's processes.

A real kubelet asks the TokenRequest API for a token bound to the pod and projects it at
``/var/run/secrets/kubernetes.io/serviceaccount/token`` inside the container's mount
namespace. Local processes have no mount namespace, and client libraries read that path
(and find the API server through ``KUBERNETES_SERVICE_HOST``/``_PORT``) from code that
our mount-path rewriting cannot reach. So:

- the token is still requested and written into the volume (``token``, beside the
  ``ca.crt`` and ``namespace`` the other projected sources give), and re-requested once
  80 % of its lifetime has passed, as the kubelet's token manager does;
- every container gets ``KUBERNETES_SERVICE_HOST``/``_PORT`` pointing at the real API
  server on loopback;
- a container that mounts a token volume at the standard path gets ``KUBECONFIG`` set to
  a kubeconfig that uses that token. In-cluster config then fails (no file at the
  hard-coded path) and kopf, kubernetes(-asyncio) and kubectl fall back to ``KUBECONFIG``,
  so the process talks to the API server as its ServiceAccount and RBAC applies for real.

Everything here except ``PodTokens.fetch`` is pure.
"""

from __future__ import annotations

import datetime
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

log = logging.getLogger("warmpool.kubelet")
Obj = Mapping[str, Any]

#: Where every client library looks for the service-account token, CA and namespace.
SA_MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
#: The file names inside that directory that the libraries read.
TOKEN_FILE = "token"
CA_FILE = "ca.crt"
#: The API's default for a projected serviceAccountToken source's expirationSeconds.
DEFAULT_EXPIRATION_SECONDS = 3600
#: Re-request a token once this share of its lifetime has passed (the kubelet's 80 %) ...
REFRESH_FRACTION = 0.8
#: ... or once it is a day old, whichever comes first (also the kubelet's rule).
MAX_TOKEN_AGE = 24 * 3600.0
#: Inherited from the kubelet's own environment, it would hand every pod the identity of
#: whoever started the cluster (often cluster-admin) and bypass RBAC; pods get their own.
NOT_INHERITED = frozenset({"KUBECONFIG"})


# --------------------------------------------------------------------------- token sources


@dataclass(frozen=True)
class TokenSpec:
    """What distinguishes one requested token from another within a pod."""

    audience: str
    expiration_seconds: int

    @classmethod
    def from_source(cls, source: Obj) -> TokenSpec:
        """From a projected ``serviceAccountToken`` source."""
        seconds = source.get("expirationSeconds")
        return cls(str(source.get("audience") or ""),
                   int(DEFAULT_EXPIRATION_SECONDS if seconds is None else seconds))

    @property
    def key(self) -> str:
        """The key under which the volume code looks the token up."""
        return f"{self.audience}|{self.expiration_seconds}"


def token_key(source: Obj) -> str:
    return TokenSpec.from_source(source).key


def token_specs(pod: Obj) -> set[TokenSpec]:
    """Every distinct token the pod's projected volumes ask for."""
    specs: set[TokenSpec] = set()
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "serviceAccountToken" in source:
                specs.add(TokenSpec.from_source(source["serviceAccountToken"]))
    return specs


def service_account_name(pod: Obj) -> str:
    spec = pod.get("spec") or {}
    return str(spec.get("serviceAccountName") or spec.get("serviceAccount") or "default")


def token_request(pod: Obj, spec: TokenSpec) -> dict[str, Any]:
    """A TokenRequest bound to the pod, so the token dies with it (as a kubelet's does)."""
    meta = pod.get("metadata") or {}
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            # Empty audiences means the API server's own (its issuer), as for the kubelet.
            "audiences": [spec.audience] if spec.audience else [],
            "expirationSeconds": spec.expiration_seconds,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                               "name": str(meta.get("name")), "uid": str(meta.get("uid"))},
        },
    }


@dataclass(frozen=True)
class IssuedToken:
    token: bytes
    issued_at: float
    expires_at: float

    @property
    def refresh_at(self) -> float:
        lifetime = max(0.0, self.expires_at - self.issued_at)
        return self.issued_at + min(REFRESH_FRACTION * lifetime, MAX_TOKEN_AGE)


def _parse_time(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def issued_token(response: Obj, spec: TokenSpec, now: float) -> IssuedToken:
    """Read a TokenRequest response; the lifetime counts from ``now`` (our clock, not the server's)."""
    status = response.get("status") or {}
    token = str(status.get("token") or "")
    if not token:
        raise ValueError("TokenRequest response carries no token")
    expiry = status.get("expirationTimestamp")
    expires_at = _parse_time(str(expiry)) if expiry else now + spec.expiration_seconds
    # Never trust a server clock ahead of ours to stretch the lifetime past what was asked.
    return IssuedToken(token.encode(), now, min(expires_at, now + spec.expiration_seconds))


#: (service account, namespace, TokenRequest body) -> the TokenRequest the API server returned.
RequestToken = Callable[[str, str, dict[str, Any]], Awaitable[Obj]]


class PodTokens:
    """One pod's tokens: requested on first use, re-requested after 80 % of their lifetime.

    A failed refresh keeps the old token while it is still valid, so a blip of the API
    server does not take files away from a running container.
    """

    def __init__(self, request: RequestToken, clock: Callable[[], float] = time.time) -> None:
        self._request = request
        self._clock = clock
        self._issued: dict[TokenSpec, IssuedToken] = {}

    async def fetch(self, pod: Obj) -> dict[str, bytes]:
        """Token bytes by ``TokenSpec.key`` for every token the pod needs and we hold."""
        meta = pod.get("metadata") or {}
        account = service_account_name(pod)
        namespace = str(meta.get("namespace"))
        wanted = token_specs(pod)
        for spec in wanted:
            now = self._clock()
            current = self._issued.get(spec)
            if current is not None and now < current.refresh_at:
                continue
            try:
                response = await self._request(account, namespace, token_request(pod, spec))
                self._issued[spec] = issued_token(response, spec, now)
                log.info("%s/%s: token for service account %s issued (audience %r, %ds)", namespace,
                         meta.get("name"), account, spec.audience or "<api>", spec.expiration_seconds)
            except (ApiException, aiohttp.ClientError, OSError, TimeoutError, ValueError) as error:
                detail = f"{error.status} {error.reason}" if isinstance(error, ApiException) else str(error)
                log.warning("%s/%s: token request for service account %s failed: %s",
                            namespace, meta.get("name"), account, detail)
        now = self._clock()
        return {spec.key: issued.token for spec, issued in self._issued.items()
                if spec in wanted and now < issued.expires_at}


# --------------------------------------------------------------------------- environment


def api_server_env(server: str) -> dict[str, str]:
    """The service env vars in-cluster clients read, naming the real API server on loopback.

    A kubelet would name the ``kubernetes`` Service's ClusterIP; we never dial one.
    """
    url = urllib.parse.urlsplit(server)
    host = url.hostname or "127.0.0.1"
    port = str(url.port or 443)
    return {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port}


def inherited_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The kubelet's own environment as the base of a container's, less its credentials."""
    return {k: v for k, v in environ.items() if k not in NOT_INHERITED}


def sa_volume(container: Obj) -> str | None:
    """The volume the container mounts whole at the service-account path, if any."""
    for mount in container.get("volumeMounts") or []:
        if str(mount.get("mountPath", "")).rstrip("/") == SA_MOUNT_PATH and not mount.get("subPath"):
            return str(mount.get("name"))
    return None


def sa_kubeconfig_path(pod_dir: Path, volume: str) -> Path:
    # Beside the volume dirs, so it is removed with them (it holds the token); volume
    # names are DNS labels without dots, so no volume can be called "<x>.kubeconfig".
    return pod_dir / "volumes" / f"{volume}.kubeconfig"


def sa_kubeconfig(server: str, volume_dir: Path, token: bytes, namespace: str,
                  has_ca: bool) -> dict[str, Any]:
    """A kubeconfig that authenticates with the volume's token.

    ``tokenFile`` lets client-go (kubectl) pick up refreshed tokens by itself; the inline
    ``token`` (rewritten on each refresh) is for kopf's kubeconfig login, which reads
    only ``token`` and logs in again after a 401.
    """
    cluster: dict[str, Any] = {"server": server}
    if has_ca:
        cluster["certificate-authority"] = str(volume_dir / CA_FILE)
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "in-cluster", "cluster": cluster}],
        "users": [{"name": "service-account", "user": {
            "token": token.decode(), "tokenFile": str(volume_dir / TOKEN_FILE)}}],
        "contexts": [{"name": "in-cluster", "context": {
            "cluster": "in-cluster", "user": "service-account", "namespace": namespace}}],
        "current-context": "in-cluster",
    }


def container_sa_env(container: Obj, server: str, pod_dir: Path,
                     written: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Env for the container: the API server's address, and KUBECONFIG when it mounts a token.

    ``written`` is the files last written per volume (relative path -> ...). The pod's own
    env is laid over this, so a pod that sets any of these keeps its value.
    """
    env = api_server_env(server)
    volume = sa_volume(container)
    if volume is not None and TOKEN_FILE in (written.get(volume) or {}):
        env["KUBECONFIG"] = str(sa_kubeconfig_path(pod_dir, volume))
    return env
