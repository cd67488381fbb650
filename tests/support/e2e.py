"""Helpers of the end-to-end suite (`tests/e2e/`): one user story on a real cluster.

The operator's and the CRD's integration tests (`tests/integration/`) use the same CRD
install, operator subprocess, World and waits, so that each is written once.

The suite runs unchanged against the local development cluster or any cluster given by
``WARMPOOL_KUBECONFIG`` (a kind cluster with the Helm chart installed, say):

* the operator: a local subprocess of the test (``python -m warmpool operator``), or the
  one already installed in the cluster when ``WARMPOOL_E2E_OPERATOR=installed`` (found by
  its labels in ``WARMPOOL_E2E_OPERATOR_NAMESPACE``, default ``warmpool-system``);
* worker pods: real containers from the checkout's worker image on the local cluster's real
  node (its tag is the operator's default worker image);
* HTTP to worker pods: straight to the pod IP on the real node's bridge (asserted to be one),
  through ``kubectl port-forward`` (loopback) elsewhere;
* logs: the kubelet's pod log files on the local node, or ``kubectl logs`` elsewhere.

Every wait here is bounded by an explicit deadline and ends in an AssertionError that
says what was awaited and carries the diagnostics (operator log, worker logs, objects).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import yaml

from warmpool.contract.api import API_GROUP_VERSION, CONDITION_READY, CRD_NAME, KIND, PLURAL
from warmpool.contract.http import DEFAULT_WORKER_PORT, PATH_READYZ, STAGE_READY
from warmpool.contract.pods import ANNOTATION_POD_DELETION_COST, LABEL_MODEL, WORKER_CONTAINER

T = TypeVar("T")

#: "installed": the operator already runs in the cluster (Helm); anything else: start one.
ENV_OPERATOR = "WARMPOOL_E2E_OPERATOR"
ENV_OPERATOR_NAMESPACE = "WARMPOOL_E2E_OPERATOR_NAMESPACE"
#: Where the suite writes its tiny models (default: under the dev node's data directory, which
#: the worker containers' UID 65532 can read); on a remote cluster this directory must be
#: mounted into every node at the same path (kind: extraMounts), readable by uid 65532.
ENV_MODEL_ROOT = "WARMPOOL_E2E_MODEL_ROOT"
OPERATOR_SELECTOR = "app.kubernetes.io/name=warmpool,app.kubernetes.io/component=operator"
REPO = Path(__file__).resolve().parents[2]  # tests/support/e2e.py -> the repository root
CRD_PATH = REPO / "crds" / f"{CRD_NAME}.yaml"
GiB = 1024**3


class NodeLike(Protocol):
    """What the suite needs of the local cluster's real node (warmpool_devcluster.testing.RealNode)."""

    @property
    def pod_cidr(self) -> str: ...

    def holds(self, ip: str) -> bool: ...

    def container_pid(self, container_id: str) -> int: ...


class ClusterLike(Protocol):
    """What the suite needs of a cluster (warmpool_devcluster.testing.ClusterHandle)."""

    kubeconfig: Path
    #: the local cluster's real node; None for an external cluster
    @property
    def node(self) -> NodeLike | None: ...
    images: dict[str, str]

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120.0) -> subprocess.CompletedProcess[str]: ...

    def pod_log_dir(self, namespace: str, pod: str) -> Path | None: ...


def operator_installed() -> bool:
    return os.environ.get(ENV_OPERATOR, "").strip().lower() == "installed"


def install_crd(cluster: ClusterLike, *, field_manager: str, apply: bool = True,
                discovery: tuple[str, ...] = ("get", PLURAL, "-A")) -> str:
    """Install (or update) the WarmModel CRD and wait until it serves; its name.

    Server-side apply: idempotent when other test modules install the same CRD; ``apply=False``
    when someone else (the chart) owns it.  Established is not yet discoverable: wait until
    ``kubectl <discovery>`` answers too (``explain`` also needs the published OpenAPI).
    """
    if apply:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={field_manager}",
                        "-f", str(CRD_PATH))
    deadline = time.monotonic() + 60
    # A CRD created a moment ago may have no status yet, and `kubectl wait` then fails at once
    # ("status.conditions accessor error") instead of waiting: retried, within the same bound.
    wait = ("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=10s")
    while cluster.kubectl(*wait, check=False).returncode != 0:
        assert time.monotonic() < deadline, "the WarmModel CRD never became Established"
        time.sleep(0.5)
    while cluster.kubectl(*discovery, check=False).returncode != 0:
        assert time.monotonic() < deadline, "the WarmModel API never showed up in discovery"
        time.sleep(0.5)
    return CRD_NAME


def model_root() -> Path:
    from warmpool_devcluster.node_files import node_models_root

    root = Path(os.environ.get(ENV_MODEL_ROOT) or node_models_root() / "e2e")
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    return root


def local_model_dirs() -> tuple[str, ...]:
    """The node directories a local test operator may mount (--allowed-host-path): where the
    tests write their models (model_root()) and where published models live (node_files)."""
    from warmpool_devcluster.node_files import node_models_root

    return (str(model_root()), str(node_models_root()))


def tiny_model(name: str = "tiny-llama-4l", layers: int = 4) -> Path:
    """A tiny random Llama checkpoint under the model root (made once, reused)."""
    from warmpool_dev.testing_models import make_tiny_llama

    dest = model_root() / name
    if not (dest / "model.safetensors").exists():
        scratch = dest.with_name(dest.name + f".tmp{os.getpid()}")
        shutil.rmtree(scratch, ignore_errors=True)
        make_tiny_llama(scratch, layers=layers)
        readable_by_pods(scratch)
        shutil.rmtree(dest, ignore_errors=True)
        scratch.rename(dest)
    return dest


def readable_by_pods(directory: Path) -> Path:
    """Every folder 0755 and file 0644 under ``directory``: worker containers run as UID 65532."""
    for folder, _, files in os.walk(directory):
        Path(folder).chmod(0o755)
        for file in files:
            (Path(folder) / file).chmod(0o644)
    return directory


def corrupt_copy(source: Path, name: str) -> Path:
    """A copy of ``source`` whose weight file is cut short (the worker must refuse it)."""
    dest = model_root() / name
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest)
    weights = dest / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    return readable_by_pods(dest)


def warmmodel(name: str, model: Path, *, revision: str = "r1", replicas: int = 1, min_warm: int = 1,
              max_replicas: int = 4, worker_args: list[str] | None = None) -> dict[str, Any]:
    """A WarmModel of a tiny model: CPU, short buckets, one prompt per bucket (fast to warm)."""
    return {
        "apiVersion": API_GROUP_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "spec": {
            "model": {"hostPath": {"path": str(model)}, "revision": revision},
            "pool": {"replicas": replicas, "minWarm": min_warm, "maxReplicas": max_replicas},
            "warmup": {"buckets": [8, 16, 32], "prompts": ["hello there", "how are you today"],
                       "timeoutSeconds": 120},
            # Stopped at once: these pools' pods are deleted by the tests far more often than a
            # client meets one going (the default's drain: tests/node_lifecycle/test_two_nodes_pool.py).
            "pod": {"workerArgs": ["--device=cpu", "--prompts-per-bucket=1", "--decode-tokens=2",
                                   *(worker_args or [])], "drainSeconds": 0},
        },
    }


# --------------------------------------------------------------------------- the operator


def delete_warmmodels(cluster: ClusterLike, namespace: str) -> None:
    """A test's teardown: delete every WarmModel in `namespace` (bounded), then drop the finalizer
    of any left behind (an operator the test killed cannot release it; the namespace would stay)."""
    cluster.kubectl("-n", namespace, "delete", PLURAL, "--all", "--timeout=60s", check=False)
    for ref in cluster.kubectl("-n", namespace, "get", PLURAL, "-o", "name", check=False).stdout.split():
        cluster.kubectl("-n", namespace, "patch", ref, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                        check=False)


class Operator:
    """The operator under test: a local subprocess, or the one installed in the cluster."""

    def __init__(self, cluster: ClusterLike, namespace: str, log_path: Path, *,
                 installed: bool | None = None, heat_write_interval: float = 5,
                 scrape_network: str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.log_path = log_path
        self.installed = operator_installed() if installed is None else installed
        self.heat_write_interval = heat_write_interval
        #: the only network a local operator may dial: the real node's pod subnet by default
        self.scrape_network = scrape_network or (cluster.node.pod_cidr if cluster.node else "127.0.0.1/32")
        #: more `warmpool operator` flags for a local subprocess (a later one wins over a default above)
        self.extra_args = extra_args
        self.installed_namespace = os.environ.get(ENV_OPERATOR_NAMESPACE, "warmpool-system")
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        if self.installed:
            return  # its Deployment keeps it running
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n===== operator start #{self.starts} =====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "warmpool", "operator", "--namespace", self.namespace,
                 "--scrape-interval", "1", "--scrape-timeout", "1",
                 "--heat-write-interval", f"{self.heat_write_interval:g}",
                 "--metrics-port", "0", "--health-port", "0", "--scrape-network", self.scrape_network,
                 *(f"--allowed-host-path={path}" for path in local_model_dirs()),
                 *([f"--worker-image={self.cluster.images['worker']}"] if "worker" in self.cluster.images else []),
                 *self.extra_args],
                env={**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig), "PYTHONUNBUFFERED": "1"},
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def running(self) -> bool:
        return self.installed or (self.proc is not None and self.proc.poll() is None)

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill leaves it (installed: its pod force-deleted)."""
        if self.installed:
            self.cluster.kubectl("-n", self.installed_namespace, "delete", "pod", "-l", OPERATOR_SELECTOR,
                                 "--grace-period=0", "--force", "--wait=false")
            return
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.installed or self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def log(self) -> str:
        if self.installed:
            proc = self.cluster.kubectl("-n", self.installed_namespace, "logs", "-l", OPERATOR_SELECTOR,
                                        "--tail=400", "--all-containers", "--prefix", check=False)
            return proc.stdout + proc.stderr
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


# --------------------------------------------------------------------------- HTTP to pods


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> tuple[int, str]:
    """(status, text) of a GET (or a JSON POST when ``body`` is given); status 0 when unreachable."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as error:
        return 0, str(error)


@dataclass
class PodHTTP:
    """Base URLs of worker pods: the pod IP on the local node's bridge, a port-forward elsewhere."""

    cluster: ClusterLike
    namespace: str
    forwards: dict[str, tuple[subprocess.Popen[str], str]] = field(default_factory=dict)

    def base(self, pod: dict[str, Any], port: int = DEFAULT_WORKER_PORT) -> str:
        node = self.cluster.node
        if node is not None:
            ip = str((pod.get("status") or {}).get("podIP") or "")
            assert node.holds(ip), f"a pod on the local node must have an address in {node.pod_cidr}, got {ip!r}"
            return f"http://{ip}:{port}"
        key = f"{pod['metadata']['uid']}:{port}"
        held = self.forwards.get(key)
        if held is not None and held[0].poll() is None:
            return held[1]
        return self._forward(key, pod["metadata"]["name"], port)

    def _forward(self, key: str, name: str, port: int) -> str:
        from warmpool_devcluster import build

        kubectl = build.ensure_binaries(["kubectl"])["kubectl"]
        proc = subprocess.Popen(
            [str(kubectl), "--kubeconfig", str(self.cluster.kubeconfig), "-n", self.namespace,
             "port-forward", "--address", "127.0.0.1", f"pod/{name}", f":{port}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 20
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            found = re.search(r"Forwarding from 127\.0\.0\.1:(\d+)", line)
            if found:
                url = f"http://127.0.0.1:{found.group(1)}"
                self.forwards[key] = (proc, url)
                return url
            if not line and proc.poll() is not None:
                break
        proc.kill()
        raise AssertionError(f"kubectl port-forward to pod {name} did not start")

    def close(self) -> None:
        for proc, _ in self.forwards.values():
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.forwards.clear()


# --------------------------------------------------------------------------- one test's world


class World:
    """One test's namespace, operator and pod HTTP, with kubectl helpers and bounded waits."""

    def __init__(self, cluster: ClusterLike, namespace: str, operator: Operator, *,
                 diagnose_timeouts: bool = False) -> None:
        self.cluster = cluster
        self.ns = namespace
        self.operator = operator
        #: a timed-out wait carries dump() (for suites without a hook that prints it on failure)
        self.diagnose_timeouts = diagnose_timeouts
        self.local = cluster.node is not None
        self.pod_http = PodHTTP(cluster, namespace)

    # -- kubectl
    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        return self.cluster.kubectl("-n", self.ns, *args, check=check, input=input).stdout

    def get(self, *what: str) -> Any:
        return json.loads(self.kubectl("get", *what, "-o", "json"))

    def maybe(self, *what: str) -> Any | None:
        proc = self.cluster.kubectl("-n", self.ns, "get", *what, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def apply(self, obj: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))

    def wm(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = self.get(PLURAL, name)
        return obj

    def condition(self, name: str, type_: str) -> dict[str, Any]:
        for cond in (self.wm(name).get("status") or {}).get("conditions") or []:
            if cond["type"] == type_:
                return dict(cond)
        return {}

    def pods(self, name: str, *, include_terminating: bool = False) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get("pods", "-l", f"{LABEL_MODEL}={name}")["items"]
        return [p for p in items if include_terminating or not p["metadata"].get("deletionTimestamp")]

    def children(self, name: str) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for kind in ("deployments", "replicasets", "services", "configmaps", "secrets", "poddisruptionbudgets"):
            items = self.get(kind, "-l", f"{LABEL_MODEL}={name}")["items"]
            found[kind] = sorted(i["metadata"]["name"] for i in items)
        return found

    # -- pods
    def base(self, pod: dict[str, Any]) -> str:
        return self.pod_http.base(pod)

    def readyz(self, pod: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        code, text = http(self.base(pod) + PATH_READYZ, timeout=3)
        try:
            body = json.loads(text) if code else {}
        except ValueError:
            body = {}
        return code, body if isinstance(body, dict) else {}

    def verified_warm(self, pod: dict[str, Any]) -> bool:
        """Ready by the kubelet *and* the worker itself says warm (/readyz 200, stage ready)."""
        if pod["metadata"].get("deletionTimestamp") or not pod_ready(pod):
            return False
        code, body = self.readyz(pod)
        return code == 200 and body.get("stage") == STAGE_READY

    def complete(self, pod: dict[str, Any], model: str, prompt: str = "hello", max_tokens: int = 4,
                 timeout: float = 60.0) -> str:
        code, text = http(self.base(pod) + "/v1/completions",
                          {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                          timeout=timeout)
        assert code == 200, f"completion via {pod['metadata']['name']} -> {code}: {text[:500]}"
        answer: str = json.loads(text)["choices"][0]["text"]
        return answer

    def worker_pid(self, pod: dict[str, Any]) -> int:
        """The host PID of a pod's worker container's process (the local cluster's node only)."""
        node = self.cluster.node
        assert node is not None, "worker PIDs exist on the local cluster's node only"
        statuses = pod["status"]["containerStatuses"]
        worker = next(s for s in statuses if s["name"] == WORKER_CONTAINER)
        return node.container_pid(str(worker["containerID"]))

    # -- waiting
    def wait(self, check: Callable[[], T | None], timeout: float, what: str, every: float = 0.5) -> T:
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                value = check()
                if value:
                    return value
            except (AssertionError, KeyError, IndexError, StopIteration, ValueError) as error:
                last_error = error
            time.sleep(every)
        diagnostics = f"\n{self.dump()}" if self.diagnose_timeouts else ""
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last_error!r})"
                             f"{diagnostics}")

    def wait_ready(self, name: str, warm: int, timeout: float) -> dict[str, Any]:
        """The WarmModel Ready with at least ``warm`` verified-warm pods, for its current generation."""
        def ready() -> dict[str, Any] | None:
            wm = self.wm(name)
            status = wm.get("status") or {}
            conds = {c["type"]: c for c in status.get("conditions") or []}
            ok = (conds.get(CONDITION_READY, {}).get("status") == "True"
                  and status.get("warmReplicas", 0) >= warm
                  and status.get("observedGeneration") == wm["metadata"]["generation"])
            return wm if ok else None

        return self.wait(ready, timeout, f"WarmModel {name} Ready with {warm} warm pods")

    # -- diagnostics
    def dump(self) -> str:
        """Everything a person needs when a test failed: operator log, objects, worker logs."""
        parts = ["===== operator log (tail) =====", "\n".join(self.operator.log().splitlines()[-200:])]
        for what in (PLURAL, "deployments", "replicasets"):
            proc = self.cluster.kubectl("-n", self.ns, "get", what, "-o", "yaml", check=False)
            parts += [f"===== {what} =====", proc.stdout[-8000:] + proc.stderr]
        for args in (("get", "pods", "-o", "wide"), ("get", "events", "--sort-by=.lastTimestamp")):
            proc = self.cluster.kubectl("-n", self.ns, *args, check=False)
            parts += [f"===== {' '.join(args[:2])} =====", proc.stdout[-8000:] + proc.stderr]
        pods = (self.maybe("pods") or {}).get("items", [])
        for pod in pods:
            name = pod["metadata"]["name"]
            parts.append(f"===== pod {name} status =====")
            parts.append(json.dumps({k: pod["status"].get(k) for k in ("phase", "conditions", "containerStatuses")},
                                    indent=1)[-3000:])
            directory = self.cluster.pod_log_dir(self.ns, name)
            if directory is not None and directory.exists():
                for path in sorted(directory.rglob("*.log")):
                    tail = "\n".join(path.read_text(errors="replace").splitlines()[-60:])
                    parts += [f"----- {name}: {path.relative_to(directory)} -----", tail]
            elif directory is None:
                for previous in ("--previous=false", "--previous=true"):
                    proc = self.cluster.kubectl("-n", self.ns, "logs", name, "--all-containers", previous,
                                                "--tail=60", check=False)
                    parts += [f"----- {name}: kubectl logs {previous} -----", proc.stdout + proc.stderr]
        return "\n".join(parts)

    def close(self) -> None:
        self.pod_http.close()


def run_pod(cluster: ClusterLike, namespace: str, name: str, image: str, command: list[str],
            timeout: float = 300.0) -> tuple[str, str]:
    """Run ``command`` once in a pod of ``image`` as the chart runs its containers (UID 65532, no
    privilege, read-only root filesystem, a /tmp emptyDir); its final phase and its log."""
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(one_shot_pod(name, image, command)))
    deadline = time.monotonic() + timeout
    phase = ""
    while time.monotonic() < deadline:
        phase = cluster.kubectl("-n", namespace, "get", "pod", name, "-o", "jsonpath={.status.phase}").stdout
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    log = cluster.kubectl("-n", namespace, "logs", name, check=False)
    return phase, log.stdout + log.stderr


def one_shot_pod(name: str, image: str, command: list[str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod that runs ``command`` once, as the chart runs its containers (see run_pod)."""
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "restartPolicy": "Never", "automountServiceAccountToken": False, "enableServiceLinks": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "main", "image": image, "imagePullPolicy": "IfNotPresent", "command": command,
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }


def pod_ready(pod: dict[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def pod_annotations(pod: dict[str, Any]) -> dict[str, str]:
    return dict(pod["metadata"].get("annotations") or {})


def deletion_cost(pod: dict[str, Any]) -> int | None:
    value = pod_annotations(pod).get(ANNOTATION_POD_DELETION_COST)
    return None if value is None else int(value)


def restarts(pod: dict[str, Any]) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return sum(int(s.get("restartCount") or 0) for s in statuses if s["name"] == WORKER_CONTAINER)


def metric(text: str, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def rss(pid: int) -> int:
    """Resident bytes of a local process; 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


# --------------------------------------------------------------------------- memory ballast


@contextlib.contextmanager
def ballast(control: Path, lifetime_s: float = 900.0) -> Iterator[subprocess.Popen[bytes]]:
    """A process holding as many resident bytes as ``control`` says (rewritten to move it)."""
    control.write_text("0")
    # cwd: `tests.support` is importable from the repository root (pytest's pythonpath there).
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.e2e", "ballast", str(control),
                             str(lifetime_s)], cwd=REPO)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def charge_to_container(pid: int, container_pid: int) -> Path:
    """Move process ``pid`` into the memory cgroup of the container whose process is
    ``container_pid`` (cgroup v1, as on the dev node): what it allocates from then on is the
    container's memory, which the worker reads as its own (its cgroup, against its limit).
    The cgroup's directory is returned."""
    for line in Path(f"/proc/{container_pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            (group / "cgroup.procs").write_text(str(pid))
            return group
    raise AssertionError(f"process {container_pid} has no memory cgroup (cgroup v1 expected)")


def _ballast_main(control: Path, lifetime_s: float) -> None:
    chunk = 4 * 1024 * 1024  # small steps: the level never spikes or dips while it moves
    held: list[bytes] = []
    deadline = time.monotonic() + lifetime_s
    while time.monotonic() < deadline:
        try:
            # Empty: read while the test rewrites the file (truncated, not yet written): no change,
            # never "drop it all" (which dipped the level for a moment and moved the tier).
            text = control.read_text().strip()
            want = int(text) // chunk if text else len(held)
        except (OSError, ValueError):
            want = len(held)
        while len(held) < want:
            held.append(bytes([1]) * chunk)
        while len(held) > want:
            held.pop()
        time.sleep(0.05)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "ballast":
        _ballast_main(Path(sys.argv[2]), float(sys.argv[3]))
    else:
        raise SystemExit("usage: python -m tests.support.e2e ballast CONTROL_FILE LIFETIME_S")
