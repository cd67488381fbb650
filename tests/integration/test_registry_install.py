"""Install on a cluster we did not build: the chart README's "Images" block, run as written.

A real registry (CNCF distribution, built from the Go module proxy) listens on 127.0.0.1;
`warmpool images build --registry R --push` pushes both images there; `helm install` takes its
image repositories from R with pullPolicy Always; and the real node's kubelet pulls the operator
image and, for a WarmModel, the worker image from it.  Those pulls move only manifests and configs
(the node's preloaded images have the very same layers, unpacked, and containerd skips a layer
it has), so the node's containerd then fetches every blob of the operator image from the registry
too (the worker's 2.9 GiB of compressed layers would add most of a minute to the suite for no
other path: its push and its kubelet pull went through the same registry).
This is the one place the suite expects a pull: everywhere else the images are preloaded
(``warmpool.local/...``, never pulled).

The node's containerd (1.6, CRI, ``config_path = ""``) runs in the host's network namespace and
speaks plain HTTP to a loopback registry and to no other (its default scheme for ``localhost``
and 127.0.0.0/8 is ``http``), so no registry config is needed for this and none is added.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_dev.paths import cache_root
from warmpool_devcluster import build, node_containerd, registry
from warmpool_devcluster.chart_values import local_values
from warmpool_devcluster.images_push import chart_app_version
from warmpool_devcluster.testing import ClusterHandle

from tests.integration.test_helm_install import CHART, REPO, wait_for, warm_model_manifest
from tests.support.e2e import model_root, tiny_model
from warmpool.contract.pods import LABEL_MODEL, WORKER_CONTAINER

pytestmark = pytest.mark.integration

README = CHART / "README.md"
#: The README's placeholders, and what this test puts in their place.
PLACEHOLDER_REGISTRY = "REGISTRY"
DOCUMENTED_NAMESPACE = "warmpool-system"
#: The registry's storage outlives a run (with the registry's fixed port, Docker then pushes only
#: the layers a new revision changed); past this size it starts empty again.
STORAGE_LIMIT_BYTES = 12 * 2**30


def images_block() -> list[list[str]]:
    """The commands of the first ``sh`` block under "## Images", continuation lines joined."""
    section = README.read_text().split("\n## Images\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert block, "helm/warmpool/README.md's Images section has no sh block"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture()
def loopback_registry() -> Iterator[registry.RegistryHandle]:
    workdir = cache_root() / "registry-test"
    if (workdir / "storage").is_dir() and _size(workdir / "storage") > STORAGE_LIMIT_BYTES:
        shutil.rmtree(workdir / "storage")
    handle = registry.start_registry(workdir, port=registry.DEFAULT_PORT)
    try:
        yield handle
    finally:
        handle.stop()


def node_references(cluster: ClusterHandle, address: str) -> list[str]:
    assert cluster.node is not None
    return sorted(ref for ref in node_containerd.images(cluster.node.state) if ref.startswith(f"{address}/"))


def forget_pulled_images(cluster: ClusterHandle, address: str) -> None:
    """Remove the registry's images from the node (its own preloaded ones stay): the node holds
    what this test pulled only while it runs, and the next run pulls again."""
    assert cluster.node is not None
    references = node_references(cluster, address)
    if references:
        node_containerd.ctr(cluster.node.state, "images", "rm", "--sync", *references)


def fetch_in_full(cluster: ClusterHandle, references: list[str]) -> dict[str, float]:
    """Every blob of each image, fetched from the registry by the node's containerd into a scratch
    namespace of its own, then removed: reference -> seconds.  (The kubelet's pull fetches only
    the manifest and config: the node already has the layers, unpacked, from its preloaded images,
    which are the same ones, so containerd skips them.)"""
    assert cluster.node is not None
    scratch = f"warmpool-registry-test-{uuid.uuid4().hex[:6]}"
    ctr = [str(node_containerd.CTR), "--address", str(node_containerd.socket_path(cluster.node.state)),
           "--namespace", scratch]
    took: dict[str, float] = {}
    try:
        for reference in references:
            started = time.monotonic()
            fetched = subprocess.run([*ctr, "content", "fetch", "--plain-http", reference],
                                     capture_output=True, text=True, timeout=600)
            assert fetched.returncode == 0, fetched.stderr[-2000:]
            took[reference] = time.monotonic() - started
    finally:
        held = subprocess.run([*ctr, "images", "ls", "-q"], capture_output=True, text=True, timeout=60).stdout.split()
        if held:
            subprocess.run([*ctr, "images", "rm", "--sync", *held], capture_output=True, timeout=300)
        blobs = subprocess.run([*ctr, "content", "ls", "-q"], capture_output=True, text=True, timeout=60).stdout.split()
        if blobs:
            subprocess.run([*ctr, "content", "rm", *blobs], capture_output=True, timeout=300)
        subprocess.run([*ctr[:-2], "namespaces", "rm", scratch], capture_output=True, timeout=60)
    return took


def pull_events(cluster: ClusterHandle, namespace: str, pod: str) -> dict[str, str]:
    """reason -> message of the kubelet's image events for one pod."""
    got = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                          f"involvedObject.kind=Pod,involvedObject.name={pod}", "-o", "json")
    return {e["reason"]: e["message"] for e in json.loads(got.stdout)["items"]
            if e["reason"] in ("Pulling", "Pulled", "Failed", "BackOff", "ErrImagePull")}


def pods(cluster: ClusterHandle, namespace: str, selector: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = json.loads(
        cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)["items"]
    return found


def pulled_and_started(cluster: ClusterHandle, namespace: str, selector: str, container: str,
                       image: str) -> tuple[dict[str, Any], str] | None:
    """The pod's ``container`` runs ``image`` and the kubelet says it pulled it: (pod, its Pulled message)."""
    for pod in pods(cluster, namespace, selector):
        for status in pod["status"].get("containerStatuses") or []:
            if status["name"] != container or status["image"] != image:
                continue
            if "running" in status["state"] or "terminated" in status["state"] or status.get("lastState"):
                events = pull_events(cluster, namespace, pod["metadata"]["name"])
                if f'Pulling image "{image}"' in events.get("Pulling", "") and \
                        f'Successfully pulled image "{image}"' in events.get("Pulled", ""):
                    return pod, events["Pulled"]
    return None


def test_the_chart_installs_from_a_registry_and_the_node_pulls_both_images(
    cluster: ClusterHandle, namespace: str, crd: str, loopback_registry: registry.RegistryHandle, tmp_path: Path
) -> None:
    if cluster.node is None:
        pytest.skip("pulls into the local cluster's real node")
    address = loopback_registry.address
    forget_pulled_images(cluster, address)  # left by a run that died: this one must really pull
    push, install = images_block()
    assert push[:3] == ["warmpool", "images", "build"] and install[:2] == ["helm", "install"], (push, install)
    models_namespace = f"t-registry-models-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", models_namespace)
    release = install[2]
    installed = False
    try:
        # --- push: the README's command, as written, with the registry's address
        started = time.monotonic()
        argv = [str(Path(sys.executable).parent / "warmpool"),
                *(arg.replace(PLACEHOLDER_REGISTRY, address) for arg in push[1:])]
        pushed = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
        push_s = time.monotonic() - started
        assert pushed.returncode == 0, pushed.stderr[-3000:]
        print(f"push of both images took {push_s:.0f}s:\n{pushed.stderr}")
        printed = dict(line.split("\t") for line in pushed.stdout.splitlines())
        app_version = chart_app_version(REPO)
        for name in ("operator", "worker"):
            repository, _, content_tag = printed[name].rpartition(":")
            assert repository == f"{address}/warmpool-{name}", printed
            assert {content_tag, app_version} <= set(loopback_registry.tags(f"warmpool-{name}")), name
        assert "pushed" in pushed.stderr and "install the chart from there" in pushed.stderr, pushed.stderr

        # --- install: the README's command, with this test's namespace and what makes it a test
        values = local_values(cluster.images, cluster.node.pod_cidr)
        test_values = {
            "crds": {"install": False},  # the `crd` fixture's, shared with the other tests
            "watch": {"namespaces": [namespace, models_namespace]},
            # Always: the kubelet asks the registry even for a reference it holds
            "image": {"pullPolicy": "Always"},
            "operator": {**values["operator"], "replicas": 1, "scrapeInterval": 2,
                         "allowedHostPaths": [str(model_root())]},
            "activator": {"enabled": False},
        }
        values_file = tmp_path / "values.yaml"
        values_file.write_text(yaml.safe_dump(test_values))
        helm = str(build.ensure_binaries(["helm"])["helm"])
        argv = [helm, *(arg.replace(PLACEHOLDER_REGISTRY, address).replace(DOCUMENTED_NAMESPACE, namespace)
                        for arg in install[1:]),
                "--kubeconfig", str(cluster.kubeconfig), "-f", str(values_file), "--wait", "--timeout", "300s"]
        started = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
        installed = True

        operator_image = f"{address}/warmpool-operator:{app_version}"
        selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator"
        pod, pulled = wait_for("the operator pod running from the image it pulled", lambda: pulled_and_started(
            cluster, namespace, selector, "operator", operator_image), timeout=120)
        assert pod["status"]["phase"] == "Running", pod["status"]
        print(f"operator: {pulled} (install to running: {time.monotonic() - started:.0f}s)")

        # --- the worker image: a WarmModel's pod pulls it from the registry too
        manifest = yaml.safe_load(warm_model_manifest("tiny", tiny_model()))
        manifest["spec"]["pool"] = {"replicas": 1, "minWarm": 1, "maxReplicas": 1}
        manifest["spec"]["pod"] = {"imagePullPolicy": "Always"}
        cluster.kubectl("apply", "-n", models_namespace, "-f", "-", input=yaml.safe_dump(manifest))
        worker_image = f"{address}/warmpool-worker:{app_version}"
        started = time.monotonic()
        try:
            _, pulled = wait_for("the worker pod running from the image it pulled", lambda: pulled_and_started(
                cluster, models_namespace, f"{LABEL_MODEL}=tiny", WORKER_CONTAINER, worker_image), timeout=420)
        except AssertionError:
            print(cluster.kubectl("get", "wm,pods,events", "-n", models_namespace, check=False).stdout)
            raise
        print(f"worker: {pulled} (WarmModel applied to container started: {time.monotonic() - started:.0f}s)")
        assert set(node_references(cluster, address)) >= {operator_image, worker_image}
        cluster.kubectl("delete", "wm", "tiny", "-n", models_namespace, "--timeout=120s")

        # --- and every byte of an image comes from the registry to the node (the operator's: see the docstring)
        for reference, seconds in fetch_in_full(cluster, [operator_image]).items():
            print(f"{reference}: every blob fetched by the node's containerd in {seconds:.1f}s")
    finally:
        if installed:
            subprocess.run([str(build.ensure_binaries(["helm"])["helm"]), "--kubeconfig", str(cluster.kubeconfig),
                            "uninstall", release, "-n", namespace, "--wait", "--timeout", "120s"],
                           capture_output=True, text=True, timeout=200)
        cluster.kubectl("delete", "namespace", models_namespace, "--wait=false", "--ignore-not-found", check=False)
        # A container still running from an image keeps its snapshot until it stops: wait for the pods.
        for ns in (namespace, models_namespace):
            try:
                wait_for(f"the pods in {ns} to go", lambda ns=ns: not cluster.kubectl(
                    "get", "pods", "-n", ns, "-o", "name", check=False).stdout.strip(), timeout=120)
            except AssertionError as error:
                print(error)
        forget_pulled_images(cluster, address)


def test_a_push_the_registry_refuses_fails_saying_so(tmp_path: Path) -> None:
    """A registry that takes no writes (distribution in read-only mode answers 405 UNSUPPORTED):
    the command fails in one line that names the registry and what to check."""
    refusing = registry.start_registry(tmp_path / "read-only", read_only=True)
    try:
        argv = [str(Path(sys.executable).parent / "warmpool"), "images", "build", "operator",
                "--registry", refusing.address, "--push"]
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
        assert refusing.tags("warmpool-operator") == []
    finally:
        refusing.stop()
    assert proc.returncode == 1, proc.stderr[-2000:]
    (last,) = [line for line in proc.stderr.splitlines() if line.startswith("warmpool images build:")]
    assert f"the registry {refusing.address} refused the push of {refusing.address}/warmpool-operator:" in last, last
    assert "accepts writes" in last, last
