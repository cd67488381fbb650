"""The chart's admission policy on a WarmModel's spec.pod.extraVolumes hostPaths, on a real API server
(the `api_server` fixture): a hostPath outside operator.allowedHostPaths, or on the node's block
cache, is refused at admission whoever writes it, naming the path; one inside is admitted; the
policy follows the release's values; a write that leaves the spec alone is not checked."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.testing import ClusterHandle

from tests.integration.test_admission_policies import API_VALUES, Release, active, installed
from warmpool.contract.api import API_GROUP_VERSION, KIND

pytestmark = pytest.mark.integration

ALLOWED = ["/models", "/var/lib/warmpool/", "/data/../scratch"]  # cleaned as the operator cleans its flags
CACHE_ROOT = "/var/lib/warmpool/cache"


@pytest.fixture(scope="module")
def release(api_server: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    """One release for the module (its policy's activation is paid once)."""
    tmp_path = tmp_path_factory.mktemp("release")
    namespace = f"hp-{uuid.uuid4().hex[:8]}"
    api_server.kubectl("create", "namespace", namespace)
    values = {**API_VALUES, "operator": {"allowedHostPaths": ALLOWED},
              "nodeAgent": {**API_VALUES["nodeAgent"], "cacheRoot": CACHE_ROOT}}
    with installed(api_server, namespace, tmp_path, values) as made:
        assert any(o["metadata"]["name"].endswith("-warmmodel-host-paths") for o in made.objects)
        yield made


def warmmodel(name: str, host_paths: list[str], model_path: str = "/models/m") -> dict[str, Any]:
    volumes = [{"name": f"v{i}", "hostPath": {"path": path}} for i, path in enumerate(host_paths)]
    return {"apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": name},
            "spec": {"model": {"hostPath": {"path": model_path}},
                     "pod": {"extraVolumes": [*volumes, {"name": "scratch", "emptyDir": {}}]}}}


def try_create(cluster: ClusterHandle, namespace: str, body: dict[str, Any]) -> tuple[bool, str]:
    """Create as the admin; (admitted, the API server's answer). An admitted one is deleted again."""
    proc = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(body), check=False)
    if proc.returncode == 0:
        cluster.kubectl("delete", "wm", body["metadata"]["name"], "-n", namespace, "--wait=false")
        return True, proc.stdout
    return False, proc.stderr


def test_an_extra_host_path_outside_the_allowed_ones_is_refused_at_admission(api_server: ClusterHandle,
                                                                            release: Release) -> None:
    ns = release.namespace
    admitted, out = active(lambda: try_create(api_server, ns, warmmodel("etc", ["/etc"])), "an extra hostPath /etc",
                           api_server)
    assert "spec.pod.extraVolumes: hostPath /etc is outside the directories the warmpool operator may mount" in out
    assert "operator.allowedHostPaths" in out and "/models" in out
    for path in ("/modelsX/a", "/var/lib/kubelet", "/data/x", "/scratchy"):  # by whole segments
        admitted, out = try_create(api_server, ns, warmmodel("outside", ["/models/ok", path]))
        assert not admitted and f"hostPath {path} is outside" in out, (path, out)
    for paths in (["/models/compile-cache"], ["/scratch"], ["/var/lib/warmpool/other", "/models"]):
        admitted, out = try_create(api_server, ns, warmmodel("inside", paths))
        assert admitted, (paths, out)


@pytest.mark.parametrize("path", [CACHE_ROOT, f"{CACHE_ROOT}/revisions", "/var/lib/warmpool"])
def test_an_extra_host_path_on_the_block_cache_is_refused(api_server: ClusterHandle, release: Release,
                                                          path: str) -> None:
    """/var/lib/warmpool is allowed, but it holds the cache (every tenant's models)."""
    _, out = active(lambda: try_create(api_server, release.namespace, warmmodel("cache", [path])),
                           f"an extra hostPath {path}", api_server)
    assert f"a hostPath may not be, lie in or hold the node's block cache ({CACHE_ROOT})" in out, out


def test_an_update_that_adds_one_is_refused_and_one_that_leaves_the_spec_is_not(api_server: ClusterHandle,
                                                                                release: Release) -> None:
    ns = release.namespace
    active(lambda: try_create(api_server, ns, warmmodel("probe", ["/etc"])), "an extra hostPath /etc", api_server)
    api_server.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(warmmodel("pool", ["/models/c"])))
    patch = json.dumps({"spec": {"pod": {"extraVolumes": [{"name": "root", "hostPath": {"path": "/root"}}]}}})
    refused = api_server.kubectl("patch", "wm", "pool", "-n", ns, "--type=merge", "-p", patch, check=False)
    assert refused.returncode != 0 and "hostPath /root is outside" in refused.stderr, refused.stderr
    label = api_server.kubectl("label", "wm", "pool", "-n", ns, "team=llm", check=False)
    assert label.returncode == 0, label.stderr


def test_the_models_own_host_path_is_left_to_the_operator(api_server: ClusterHandle, release: Release) -> None:
    """spec.model.hostPath outside the prefixes is admitted: the operator refuses it (Degraded,
    HostPathNotAllowed, and the alert on it), as before; only extra volumes are checked here."""
    ns = release.namespace
    active(lambda: try_create(api_server, ns, warmmodel("probe", ["/etc"])), "an extra hostPath /etc", api_server)
    admitted, out = try_create(api_server, ns, warmmodel("model-etc", [], model_path="/etc/models"))
    assert admitted, out


def test_a_namespaced_release_checks_only_the_namespaces_it_watches(api_server: ClusterHandle,
                                                                    tmp_path: Path) -> None:
    """Two releases watching different namespaces each have their own allowedHostPaths: one's policy
    never refuses a WarmModel the other watches (it used to apply to every namespace)."""
    watched, other = (f"hp-{uuid.uuid4().hex[:8]}" for _ in range(2))
    for ns in (watched, other):
        api_server.kubectl("create", "namespace", ns)
    # /models/x: allowed by this module's cluster-wide release (if it is installed), not by this one.
    values = {"watch": {"namespaces": [watched]}, "operator": {"allowedHostPaths": ["/data"]}}
    with installed(api_server, watched, tmp_path, values):
        _, out = active(lambda: try_create(api_server, watched, warmmodel("x", ["/models/x"], "/data/m")),
                        "an extra hostPath /models/x in the watched namespace", api_server)
        assert "hostPath /models/x is outside" in out and "(/data;" in out, out
        admitted, out = try_create(api_server, other, warmmodel("x", ["/models/x"], "/data/m"))
        assert admitted, out
