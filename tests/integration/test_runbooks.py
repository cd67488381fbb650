"""Every command block of docs/runbooks/*.md and every command of the chart's NOTES.txt, run against
the chart installed on the local cluster's real node (the convention: docs/runbooks/README.md,
"Commands in these pages run"; the parsing: tests/support/runbook_blocks.py).

Two installs for the whole module, release names ``warmpool`` (the documented one, whose objects
are named ``warmpool``) and ``wp-ops`` (named ``wp-ops-warmpool``), each in a namespace of its own
and watching a model namespace of its own; the CRD is the test modules' shared one
(``crds.install=false``), as in test_promql.py.  Each runs the node agent too (the fill-failure
runbook reads it), on a cache folder of its own.  The model namespaces enforce Pod Security
"restricted", the level NOTES.txt advises for a PVC model, so the API server refuses a debug pod
that would break it; the release namespaces "privileged", which NOTES.txt says a hostPath needs
(the node agent's cache).  ``warmpool``'s model namespace holds a WarmModel of a tiny real model read
from a PersistentVolumeClaim (a static PersistentVolume over the node's test model folder): blocks
that name a WarmModel, its pods or its claim run against it; the others run against both releases.

A block that changes the release (a restart, a scale, an upgrade, a rollback) is followed by a
bounded wait until the release is back as it was: operator and activator rolled out, the Lease
held by a running pod, the WarmModel's spec re-applied and the pool Ready with a warm pod.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_devcluster import build
from warmpool_devcluster.chart_values import local_values
from warmpool_devcluster.node_files import node_data_root
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import delete_warmmodels, model_root, pod_ready, tiny_model, warmmodel
from tests.support.runbook_blocks import REPO, Block, Mark, notes_commands, runbook_blocks, substitute
from warmpool.contract.api import CONDITION_READY, CRD_NAME
from warmpool.contract.pods import LABEL_MODEL

pytestmark = pytest.mark.integration

CHART = REPO / "helm" / "warmpool"
NOTES = CHART / "templates" / "NOTES.txt"
#: The documented release name first: it gets the WarmModel.
PRIMARY = "warmpool"
RELEASES = (PRIMARY, "wp-ops")
MODEL = "tiny"
CLAIM = "weights"
PSA_LABEL = "pod-security.kubernetes.io/enforce"
PSA_LEVEL = "restricted"
#: The release namespace's level: the node agent mounts its cache from the node (a hostPath).
RELEASE_PSA_LEVEL = "privileged"
#: Bounds: one block (a rollout restart or an upgrade inside it waits for itself), an install,
#: the pool turning warm, the release back as it was after a block that changed it.
BLOCK_TIMEOUT_S = 420
INSTALL_TIMEOUT_S = 300
WARM_TIMEOUT_S = 240.0
RESTORE_TIMEOUT_S = 240.0
#: Demand prediction's history step (the default 60 s writes the history ConfigMap after 5 min).
PREDICT_STEP_S = 4
#: A block that may change the release or the pool: the test puts them back after it.
CHANGES_STATE = re.compile(r"\b(rollout restart|scale|patch|delete|upgrade|rollback|label|annotate|apply|run)\b")
#: What the runner puts before each block; the ERR trap names the failing line (LINENO counts from 1).
PRELUDE = ("set -eEuo pipefail\n"
           "trap 'echo \"RUNBOOK-FAILED-AT $LINENO: $BASH_COMMAND\" >&2' ERR\n")
PRELUDE_LINES = PRELUDE.count("\n")
#: Stands in for kubectl on the blocks' PATH: a watch runs for a few seconds (cut, not failed), and
#: a kubectl that finds nothing fails (a wrong selector or namespace) unless it lists Events or
#: deletes --all (README: "Every command must exit 0").
KUBECTL_WRAPPER = """#!/bin/bash
watch=0; empty_ok=0
for arg in "$@"; do
  case "$arg" in -w|--watch) watch=1 ;; events|delete) empty_ok=1 ;; esac
done
err=$(mktemp); trap 'rm -f "$err"' EXIT
if [ "$watch" = 1 ]; then
  timeout 5 {real} "$@" 2>"$err"; rc=$?; [ "$rc" = 124 ] && rc=0
else
  {real} "$@" 2>"$err"; rc=$?
fi
cat "$err" >&2
if [ "$rc" = 0 ] && [ "$empty_ok" = 0 ] && grep -q "No resources found" "$err"; then
  echo "runbook check: 'kubectl $*' found nothing" >&2; exit 3
fi
exit "$rc"
"""


def _fullname(release: str) -> str:
    """The chart's fullname helper (helm/warmpool/templates/_helpers.tpl), without overrides."""
    return release if "warmpool" in release else f"{release}-warmpool"


@dataclass
class Install:
    release: str
    namespace: str
    model_namespace: str
    values_file: Path
    cache_root: Path
    notes: str = ""
    #: The WarmModel as applied (None: this install has none).
    model: dict[str, Any] | None = None
    model_path: str = ""
    installed: bool = field(default=False)

    @property
    def fullname(self) -> str:
        return _fullname(self.release)


@dataclass
class Runner:
    cluster: ClusterHandle
    env: dict[str, str]
    installs: dict[str, Install]

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, check=check, input=input)


def _wait_for(what: str, probe: Callable[[], Any], timeout: float, interval: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


def _helm_binary() -> str:
    return str(build.ensure_binaries(["helm"])["helm"])


def _block_env(cluster: ClusterHandle, scratch: Path) -> dict[str, str]:
    """The blocks' environment: the cluster's kubeconfig, helm, and the checking kubectl first on PATH."""
    real = build.ensure_binaries(["kubectl"])["kubectl"]
    bin_dir = scratch / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "kubectl"
    wrapper.write_text(KUBECTL_WRAPPER.replace("{real}", str(real)))
    wrapper.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(_helm_binary()).parent), os.environ.get("PATH", "")])
    return {"PATH": path, "KUBECONFIG": str(cluster.kubeconfig), "HOME": os.environ.get("HOME", str(scratch)),
            "TMPDIR": str(scratch), "LANG": "C.UTF-8"}


def _values(cluster: ClusterHandle, install: Install) -> dict[str, Any]:
    assert cluster.node is not None
    values = local_values(cluster.images, cluster.node.pod_cidr)
    operator = {**values["operator"], "scrapeInterval": 2, "allowedHostPaths": [str(model_root())]}
    if install.release == PRIMARY:
        operator["extraArgs"] = [f"--predict-step-seconds={PREDICT_STEP_S}"]
    else:
        operator["replicas"] = 1  # the Lease is held all the same; one pod less on two cores
    values |= {
        "crds": {"install": False},
        "watch": {"namespaces": [install.model_namespace]},
        "operator": operator,
        "nodeAgent": {"enabled": True, "cacheRoot": str(install.cache_root)},
        "probes": {"readiness": {"initialDelaySeconds": 1, "periodSeconds": 2, "timeoutSeconds": 5,
                                 "failureThreshold": 3}},
    }
    if install.release != PRIMARY:
        values["activator"] = {"replicas": 1}
    return values


def _persistent_volume(name: str, install: Install) -> dict[str, Any]:
    """A static volume over the node's test model folder, bound to the model namespace's claim
    (the local cluster has no provisioner)."""
    return {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                 "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                 "hostPath": {"path": str(model_root()), "type": "Directory"},
                 "claimRef": {"namespace": install.model_namespace, "name": CLAIM}},
    }


def _claim(volume: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": volume,
                 "resources": {"requests": {"storage": "1Gi"}}},
    }


def _warm(runner: Runner, install: Install) -> bool:
    got = runner.kubectl("get", "wm", MODEL, "-n", install.model_namespace, "-o", "json", check=False)
    if got.returncode != 0:
        return False
    status = json.loads(got.stdout).get("status") or {}
    ready = {c["type"]: c for c in status.get("conditions") or []}.get(CONDITION_READY) or {}
    warm = ready.get("status") == "True" and status.get("warmReplicas", 0) >= 1
    return warm and _worker_pod(runner, install) is not None


def _worker_pod(runner: Runner, install: Install) -> dict[str, Any] | None:
    pods = json.loads(runner.kubectl("get", "pods", "-n", install.model_namespace, "-l", f"{LABEL_MODEL}={MODEL}",
                                     "-o", "json").stdout)["items"]
    ready = [p for p in pods if pod_ready(p) and not p["metadata"].get("deletionTimestamp")]
    return min(ready, key=lambda p: p["metadata"]["name"]) if ready else None


def _apply_model(runner: Runner, install: Install) -> None:
    assert install.model is not None
    runner.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=runbook-test",
                   "-n", install.model_namespace, "-f", "-", input=yaml.safe_dump(install.model))


def _install(runner: Runner, install: Install) -> subprocess.Popen[str]:
    return subprocess.Popen([_helm_binary(), "--kubeconfig", str(runner.cluster.kubeconfig), "install", install.release,
                             str(CHART), "-n", install.namespace, "-f", str(install.values_file), "--wait",
                             "--timeout", f"{INSTALL_TIMEOUT_S - 30}s"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lease_held(runner: Runner, install: Install) -> bool:
    got = runner.kubectl("get", "lease", install.fullname, "-n", install.namespace,
                         "-o", "jsonpath={.spec.holderIdentity}", check=False)
    holder = got.stdout.strip()
    if got.returncode != 0 or not holder:
        return False
    listed = runner.kubectl("get", "pods", "-n", install.namespace, "-l",
                            f"app.kubernetes.io/instance={install.release},app.kubernetes.io/component=operator",
                            "-o", "json").stdout
    # A terminating pod does not count: after a rollout the old leader holds the Lease until it exits,
    # then gives it up, and a block run in that gap would find no holder.
    pods = [pod["metadata"]["name"] for pod in json.loads(listed)["items"]
            if "deletionTimestamp" not in pod["metadata"] and pod["status"].get("phase") == "Running"]
    return any(holder.startswith(pod + "-") for pod in pods)


def _restore(runner: Runner, install: Install) -> None:
    """Put the release back as the module installed it, within RESTORE_TIMEOUT_S."""
    if not install.installed:
        return
    for workload in (f"deployment/{install.fullname}", f"deployment/{install.fullname}-activator",
                     f"daemonset/{install.fullname}-node-agent"):
        runner.kubectl("rollout", "status", workload, "-n", install.namespace, f"--timeout={int(RESTORE_TIMEOUT_S)}s")
    _wait_for(f"{install.release}'s Lease held by a running operator pod",
              lambda: _lease_held(runner, install), 60.0)
    runner.kubectl("label", "namespace", install.model_namespace, f"{PSA_LABEL}={PSA_LEVEL}", "--overwrite")
    if install.model is not None:
        _apply_model(runner, install)
        _wait_for(f"WarmModel {MODEL} Ready with a warm pod again", lambda: _warm(runner, install), RESTORE_TIMEOUT_S)


def _placeholders(runner: Runner, install: Install) -> dict[str, str]:
    values = {
        "release": install.release, "namespace": install.namespace, "fullname": install.fullname,
        "model-namespace": install.model_namespace, "chart": str(CHART),
        "values-file": str(install.values_file), "revision": "1",
    }
    if install.model is not None:
        pod = _worker_pod(runner, install)
        assert pod is not None, "the WarmModel has no Ready worker pod"
        values |= {"name": MODEL, "pod": pod["metadata"]["name"], "node": pod["spec"]["nodeName"],
                   "claim": CLAIM, "path": install.model_path}
    return values


def run_block(runner: Runner, install: Install, block: Block) -> None:
    """Run one block as its page shows it, placeholders substituted; fail with its file and line."""
    script = substitute(block, _placeholders(runner, install))
    proc = subprocess.run(["bash", "-c", PRELUDE + script], cwd=REPO, env=runner.env, capture_output=True,
                          text=True, timeout=BLOCK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    failed = re.search(r"RUNBOOK-FAILED-AT (\d+): (.*)", proc.stderr)
    if block.mark is Mark.EXPECT_FAIL:
        assert proc.returncode != 0, f"{block.where} ({install.release}): expected to fail ({block.reason}), " \
                                     f"exited 0:\n{proc.stdout[-2000:]}"
        return
    if proc.returncode != 0:
        line = block.line + int(failed[1]) - PRELUDE_LINES - 1 if failed else block.line
        command = failed[2] if failed else script.strip().splitlines()[0]
        pytest.fail(f"{block.source.relative_to(REPO)}:{line} ({install.release}): `{command}` exited "
                    f"{proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}",
                    pytrace=False)


def _cases(marks: frozenset[Mark]) -> list[Any]:
    return [pytest.param(release, block, id=f"{release}:{block.where.removeprefix('docs/runbooks/')}")
            for block in runbook_blocks() if block.mark in marks
            for release in RELEASES if release == PRIMARY or not block.needs_model()]


@pytest.fixture(scope="module")
def runner(cluster: ClusterHandle, crd: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runner]:
    """Both releases installed (concurrently), the WarmModel warm; everything removed afterwards."""
    if cluster.node is None:
        pytest.skip("installs the checkout's images: needs the local cluster's real node")
    scratch = tmp_path_factory.mktemp("runbooks")
    tag = uuid.uuid4().hex[:6]
    installs = {release: Install(release, f"t-rb-{release}-{tag}", f"t-rb-{release}-m-{tag}",
                                 scratch / f"{release}-values.yaml", node_data_root() / f"t-rb-cache-{release}-{tag}")
                for release in RELEASES}
    run = Runner(cluster, _block_env(cluster, scratch), installs)
    volume = f"t-rb-weights-{tag}"
    try:
        for install in installs.values():
            for namespace, level in ((install.namespace, RELEASE_PSA_LEVEL), (install.model_namespace, PSA_LEVEL)):
                cluster.kubectl("create", "namespace", namespace)
                cluster.kubectl("label", "namespace", namespace, f"{PSA_LABEL}={level}")
            install.values_file.write_text(yaml.safe_dump(_values(cluster, install)))
        primary = installs[PRIMARY]
        model = tiny_model(layers=2, name="tiny-llama-2l")
        primary.model_path = model.name
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(_persistent_volume(volume, primary)))
        cluster.kubectl("apply", "-n", primary.model_namespace, "-f", "-", input=yaml.safe_dump(_claim(volume)))
        started = {release: _install(run, install) for release, install in installs.items()}
        for release, proc in started.items():
            out, err = proc.communicate(timeout=INSTALL_TIMEOUT_S)
            assert proc.returncode == 0, f"helm install {release}:\n{out}\n{err}"
            installs[release].installed = True
            installs[release].notes = out.partition("NOTES:\n")[2]
        obj = warmmodel(MODEL, model)
        obj["spec"]["model"] = {"pvc": {"claimName": CLAIM, "path": primary.model_path}, "revision": "r1"}
        # the README's history ConfigMap: a pool with demand prediction in shadow mode keeps one
        obj["spec"]["pool"]["predictive"] = {"enabled": False}
        primary.model = obj
        _apply_model(run, primary)
        try:
            _wait_for("the WarmModel Ready with a warm pod", lambda: _warm(run, primary), WARM_TIMEOUT_S, 2.0)
        except AssertionError:
            print(cluster.kubectl("get", "wm,pods,pvc,events", "-n", primary.model_namespace, check=False).stdout)
            raise
        _wait_for("the WarmModel's history ConfigMap", lambda: cluster.kubectl(
            "get", "configmap", f"{MODEL}-history", "-n", primary.model_namespace, check=False).returncode == 0,
            60.0, 2.0)
        yield run
    finally:
        _teardown(cluster, installs, volume)


def _teardown(cluster: ClusterHandle, installs: dict[str, Install], volume: str) -> None:
    for install in installs.values():
        delete_warmmodels(cluster, install.model_namespace)
    with ThreadPoolExecutor(len(installs)) as pool:
        list(pool.map(lambda i: subprocess.run(
            [_helm_binary(), "--kubeconfig", str(cluster.kubeconfig), "uninstall", i.release, "-n", i.namespace,
             "--wait", "--timeout", "90s", "--ignore-not-found"], capture_output=True, timeout=150),
            installs.values()))
    for install in installs.values():
        for namespace in (install.model_namespace, install.namespace):
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found", check=False)
    cluster.kubectl("delete", "persistentvolume", volume, "--wait=false", "--ignore-not-found", check=False)
    for install in installs.values():
        shutil.rmtree(install.cache_root, ignore_errors=True)
    # upgrading.md hands the shared CRD to a release (Helm's ownership metadata): take it back
    annotations = json.loads(cluster.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)["metadata"].get(
        "annotations") or {}
    if annotations.get("meta.helm.sh/release-namespace") in {i.namespace for i in installs.values()}:
        cluster.kubectl("annotate", "crd", CRD_NAME, "meta.helm.sh/release-name-", "meta.helm.sh/release-namespace-")
        cluster.kubectl("label", "crd", CRD_NAME, "app.kubernetes.io/managed-by-", check=False)


@pytest.mark.parametrize(("release", "block"), _cases(frozenset({Mark.RUN, Mark.EXPECT_FAIL})))
def test_runbook_block_runs(runner: Runner, release: str, block: Block) -> None:
    install = runner.installs[release]
    try:
        run_block(runner, install, block)
    finally:
        if CHANGES_STATE.search(block.text):
            _restore(runner, install)


@pytest.mark.parametrize("release", RELEASES)
def test_notes_commands_run(runner: Runner, release: str) -> None:
    """NOTES.txt as `helm install` printed it: every command runs (the example WarmModel it applies is
    removed again, and the model namespace's Pod Security level put back)."""
    install = runner.installs[release]
    commands = notes_commands(install.notes, NOTES)
    assert any("logs" in c.text and "lease" in c.text for c in commands), install.notes
    try:
        for command in commands:
            if install.model is None and command.needs_model():
                continue
            run_block(runner, install, command)
    finally:
        runner.kubectl("delete", "wm", "smollm2", "-n", install.model_namespace, "--ignore-not-found",
                       "--timeout=60s", check=False)
        _restore(runner, install)


def test_notes_log_commands_name_the_namespace_and_the_leader(runner: Runner) -> None:
    """Every NOTES command carries -n (it works from any current namespace), and its log command reads
    the Lease holder's pod, not whichever replica `deployment/` picks."""
    for install in runner.installs.values():
        for command in notes_commands(install.notes, NOTES):
            cluster_wide = any(word in command.text for word in (" -A", " namespace ", " crd "))
            if command.text.startswith("kubectl") and not cluster_wide:
                assert re.search(r"\s-n\s", command.text), f"{command.where}: no -n: {command.text}"
        logs = [c.text for c in notes_commands(install.notes, NOTES) if " logs " in c.text]
        assert logs and all("get lease " + install.fullname in text for text in logs), logs


def test_notes_pod_security_advice_fits_host_path_models(runner: Runner) -> None:
    """NOTES.txt advises "restricted" only for PVC models and says hostPath, nodeCache and object-store
    models need "privileged" (both "restricted" and "baseline" refuse a hostPath volume); the PVC
    half is what this module's model namespace enforces while its WarmModel warms."""
    notes = " ".join(runner.installs[PRIMARY].notes.split())
    restricted, _, rest = notes.partition("enforce=restricted")
    assert "PersistentVolumeClaim" in restricted[-300:], restricted[-300:]
    for source in ("hostPath", "nodeCache", "object-store"):
        assert source in rest.partition("enforce=privileged")[0], rest[:600]


@pytest.mark.parametrize(("release", "block"), _cases(frozenset({Mark.TEARDOWN})))
def test_runbook_teardown_block_runs(runner: Runner, release: str, block: Block) -> None:
    """Last: the blocks that uninstall the release (the module's teardown then finds it gone)."""
    install = runner.installs[release]
    run_block(runner, install, block)
    install.installed = False
    left = runner.kubectl("get", "deployments", "-n", install.namespace, "-l",
                          f"app.kubernetes.io/instance={install.release}", "-o", "name").stdout.split()
    assert not left, f"{block.where}: left behind {left}"
