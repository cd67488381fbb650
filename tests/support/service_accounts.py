"""A kubeconfig that is nothing but a ServiceAccount's token: a test's client that the API server
authorises as that account (its RBAC alone, no admin certificate)."""

from __future__ import annotations

import json
from pathlib import Path

from warmpool_devcluster.testing import ClusterHandle


def token_kubeconfig(cluster: ClusterHandle, account: str, namespace: str, path: Path) -> Path:
    """A kubeconfig at ``path`` with a 10-minute token of ``namespace``/``account`` (TokenRequest, which
    the API server serves itself: no controller needed) and the cluster's address and CA."""
    admin = json.loads(cluster.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
    token = cluster.kubectl("-n", namespace, "create", "token", account, "--duration=10m").stdout.strip()
    entry = admin["clusters"][0]
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "clusters": [entry], "current-context": account,
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": {"cluster": entry["name"], "user": account}}],
    }))
    path.chmod(0o600)
    return path
