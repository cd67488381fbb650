"""The demo's installer: the project's Helm chart, `helm upgrade --install`, with the checkout's
images as loaded on the demo cluster's real node (what a user does with their registry's tags).

The release is ``warmpool`` in ``warmpool-system``; it watches the demo's namespace only, may mount
the node's model directory, and owns the WarmModel CRD (the chart installs it).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

RELEASE = "warmpool"
RELEASE_NAMESPACE = "warmpool-system"
OPERATOR_SELECTOR = "app.kubernetes.io/name=warmpool,app.kubernetes.io/component=operator"
INSTALL_TIMEOUT_S = 300


class InstallError(RuntimeError):
    """helm refused or timed out; the message has its output."""


def values(images: dict[str, str], pod_cidr: str, watch_namespace: str, model_root: Path) -> dict[str, Any]:
    from warmpool_devcluster.chart_values import local_values

    chosen = local_values(images, pod_cidr)
    chosen["watch"] = {"namespaces": [watch_namespace]}
    chosen["operator"] = {**chosen["operator"], "allowedHostPaths": [str(model_root)]}
    # A 2-core machine: the operator's two replicas ask for little CPU, so the workers fit beside them.
    chosen["resources"] = {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
    return chosen


def helm(kubeconfig: Path, *args: str, timeout: float = INSTALL_TIMEOUT_S + 60) -> str:
    from warmpool_devcluster import build

    binary = str(build.ensure_binaries(["helm"])["helm"])
    proc = subprocess.run([binary, "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise InstallError(f"helm {' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    return proc.stdout


def install(kubeconfig: Path, chart: Path, chosen: dict[str, Any]) -> None:
    """Install, or upgrade in place (a rerun with new images rolls the operator), and wait for Ready."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="warmpool-demo-values-") as handle:
        yaml.safe_dump(chosen, handle)
        handle.flush()
        helm(kubeconfig, "upgrade", "--install", RELEASE, str(chart), "-n", RELEASE_NAMESPACE,
             "--create-namespace", "-f", handle.name, "--wait", "--timeout", f"{INSTALL_TIMEOUT_S}s")
