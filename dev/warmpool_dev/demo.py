"""`warmpool demo`: the main job end to end on a local cluster.

1. start the local control plane (or use the cluster named by WARMPOOL_KUBECONFIG),
2. fetch the small real model (SmolLM2-135M-Instruct) and install the WarmModel CRD,
3. run the operator, apply the builtin-engine example WarmModel,
4. show the pods loading and warming (stage, tier, layers resident) until the pool is warm,
5. send a completion through a warm pod, and
6. print the cold-start phases per pod with first-request vs steady-state TTFT, and render
   the same timeline as a PNG waterfall.

With ``--object-store`` (`make demo-object-store`) the model takes the production path
instead (#18): pushed to a real S3 store (SeaweedFS, on loopback), filled into the node's
cache by a node agent, and mapped by the pods from there; see demo_object_store.py.

Ctrl-C, or `warmpool demo --down` (`make demo-down`), cleans everything up.

It reads the example WarmModel and the CRD from a warmpool source checkout: the current
directory (as `make demo` runs it), or the one `--repo` names.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from warmpool.contract import DEFAULT_WORKER_PORT, LABEL_MODEL, PATH_READYZ
from warmpool.paths import cache_root
from warmpool_dev.timeline import PodTimeline, measure_ttft, phase_table, render_waterfall, scrape_phases

CLUSTER_NAME = "demo"
NAMESPACE = "warmpool-demo"
#: What the demo reads from the source checkout (relative to its root).
EXAMPLE_IN_CHECKOUT = Path("examples") / "builtin-smollm2.yaml"
CRDS_IN_CHECKOUT = Path("crds")
STEADY_REQUESTS = 5
PROMPT = "Kubernetes is an open-source system for"


class DemoError(RuntimeError):
    pass


@dataclass(frozen=True)
class Checkout:
    """The warmpool source checkout the demo reads its manifests from (an install has none)."""

    root: Path

    @property
    def example(self) -> Path:
        return self.root / EXAMPLE_IN_CHECKOUT

    @property
    def crds(self) -> Path:
        return self.root / CRDS_IN_CHECKOUT


def find_checkout(root: Path | None = None) -> Checkout:
    """``root`` (default: the current directory) if it is a warmpool source checkout, else DemoError."""
    resolved = (Path.cwd() if root is None else root).resolve()
    missing = [str(part) for part in (EXAMPLE_IN_CHECKOUT, CRDS_IN_CHECKOUT) if not (resolved / part).exists()]
    if missing:
        raise DemoError(f"{resolved} is not a warmpool source checkout (no {' or '.join(missing)} in it): "
                        "run the demo from the checkout's root or pass --repo DIR")
    return Checkout(resolved)


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


class Kube:
    """kubectl against the demo's cluster (ours, or the one WARMPOOL_KUBECONFIG names)."""

    def __init__(self, kubeconfig: Path) -> None:
        from warmpool_devcluster import build

        self.kubeconfig = kubeconfig
        self.binary = build.ensure_binaries(["kubectl"])["kubectl"]

    def run(self, *args: str, input_text: str | None = None, check: bool = True) -> str:
        proc = subprocess.run([str(self.binary), "--kubeconfig", str(self.kubeconfig), *args],
                              input=input_text, capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise DemoError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json"))


def _state_file() -> Path:
    return cache_root() / "demo" / "operator.pid"


def _output_dir(checkout: Checkout) -> Path:
    return Path(os.environ.get("WARMPOOL_DEMO_OUTPUT", checkout.root / "demo-output"))


def down() -> int:
    from warmpool_dev import demo_object_store

    pid_file = _state_file()
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(pid_file.read_text()), signal.SIGTERM)
        pid_file.unlink(missing_ok=True)
    demo_object_store.stop_agent()
    if os.environ.get("WARMPOOL_KUBECONFIG"):
        kube = Kube(Path(os.environ["WARMPOOL_KUBECONFIG"]))
        kube.run("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false", check=False)
    else:
        from warmpool_devcluster import cluster

        demo_object_store.stop_store(CLUSTER_NAME)
        cluster.down(CLUSTER_NAME)
    _say("cleaned up")
    return 0


def _start_operator(kubeconfig: Path, log_path: Path, model_root: Path,
                    extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    # The demo's model lives in the local cache, outside the operator's default hostPath prefixes.
    proc = subprocess.Popen([sys.executable, "-m", "warmpool", "operator", "--namespace", NAMESPACE,
                             f"--allowed-host-path={model_root}", *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _state_file().parent.mkdir(parents=True, exist_ok=True)
    _state_file().write_text(str(proc.pid))
    return proc


def _manifest(model_dir: Path, checkout: Checkout | None = None) -> str:
    body = yaml.safe_load((checkout or find_checkout()).example.read_text())
    # The example expects the node-local cache; on this machine the cache is the fetch dir.
    body["spec"]["model"]["nodeCache"]["root"] = str(model_dir.parent)
    body["spec"]["model"]["nodeCache"]["key"] = model_dir.name
    body["metadata"]["namespace"] = NAMESPACE
    return yaml.safe_dump(body)


def _readyz(ip: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://{ip}:{DEFAULT_WORKER_PORT}{PATH_READYZ}", timeout=2) as response:
            body: dict[str, Any] = json.loads(response.read())
            return body
    except urllib.error.HTTPError as error:  # 503 while warming still carries the JSON body
        try:
            body = json.loads(error.read())
            return body
        except ValueError:
            return {}
    except (urllib.error.URLError, OSError, ValueError):
        return {}


def _pods(kube: Kube, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kube.json("get", "pods", "-n", NAMESPACE, "-l", f"{LABEL_MODEL}={name}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def _progress_line(pod: dict[str, Any]) -> str:
    ip = pod.get("status", {}).get("podIP")
    state = _readyz(ip) if ip else {}
    layers = f"{state.get('layers_resident', '?')}/{state.get('layers_total', '?')}"
    warmup = state.get("warmup") or {}
    plan = warmup.get("plan") or {}
    planned = len(plan.get("buckets") or []) * int(plan.get("prompts_per_bucket") or 0)
    done = f"{sum((warmup.get('prefills') or {}).values())}/{planned}" if plan else "-"
    tier = state.get("effective_tier") or state.get("tier") or (state.get("warmup") or {}).get("tier") or "?"
    return (f"  {pod['metadata']['name']:<40} ip={ip or '-':<14} stage={state.get('stage', 'starting'):<16} "
            f"tier={tier:<10} layers={layers} prefills={done}")


def _wait_warm(kube: Kube, name: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    last_report = ""
    last_print = 0.0
    while time.monotonic() < deadline:
        wm = kube.json("get", "warmmodel", name, "-n", NAMESPACE)
        status = wm.get("status", {})
        conditions = {c["type"]: c for c in status.get("conditions", [])}
        ready = conditions.get("Ready", {})
        report = "\n".join([
            f"WarmModel {name}: warm {status.get('warmReplicas', 0)}/{wm['spec']['pool'].get('minWarm')} (min), "
            f"ready {status.get('readyReplicas', 0)}/{wm['spec']['pool'].get('replicas')}; "
            f"Ready={ready.get('status', '?')} ({ready.get('reason', '-')})",
            *(_progress_line(pod) for pod in _pods(kube, name)),
        ])
        # Print when something moved, and at least every 15 s so a slow load still shows life.
        if report != last_report or time.monotonic() - last_print >= 15.0:
            _say(f"+{time.monotonic() - started:5.1f}s " + report)
            last_report, last_print = report, time.monotonic()
        if conditions.get("Ready", {}).get("status") == "True":
            result: dict[str, Any] = wm
            return result
        time.sleep(0.5)
    raise DemoError(f"WarmModel {name} did not become Ready within {timeout:.0f}s")


def _wait_established(kube: Kube, timeout: float = 60.0) -> None:
    """A CRD created a moment ago may have no status yet, and `kubectl wait` then fails at once
    instead of waiting: retried, bounded."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            kube.run("wait", "--for=condition=Established", "crd/warmmodels.warmpool.dev", "--timeout=10s")
            return
        except DemoError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def run(timeout: float, checkout: Checkout, object_store: bool = False) -> int:
    from warmpool_devcluster import cluster

    from warmpool_dev import demo_object_store as objects
    from warmpool_dev.model_fetch import ensure_model

    started = time.monotonic()
    external = os.environ.get("WARMPOOL_KUBECONFIG")
    if external:
        kubeconfig = Path(external)
        _say(f"using the cluster in WARMPOOL_KUBECONFIG={kubeconfig}")
    else:
        _say("starting the local control plane (first run builds its binaries: several minutes)")
        kubeconfig = cluster.up(CLUSTER_NAME)
    kube = Kube(kubeconfig)
    _say("fetching the small real model (SmolLM2-135M-Instruct)")
    model_dir = ensure_model()
    _say("installing the WarmModel CRD")
    kube.run("apply", "--server-side", "-f", str(checkout.crds))
    _wait_established(kube)
    kube.run("create", "namespace", NAMESPACE, check=False)
    out = _output_dir(checkout)
    store: objects.ObjectStore | None = None
    agent: subprocess.Popen[bytes] | None = None
    extra: tuple[str, ...] = ()
    if object_store:
        if external:
            raise DemoError("--object-store runs on the local demo cluster only (its node agent and pods share "
                            "this machine's cache directory): unset WARMPOOL_KUBECONFIG")
        _say("starting the object store (SeaweedFS on loopback; its first use builds it: long)")
        try:
            store = objects.start_store(CLUSTER_NAME)
            _say(f"pushing {model_dir.name} to s3://{store.bucket}/{objects.PREFIX} at {store.endpoint}")
            _say(f"revision {objects.push(store, model_dir)} pushed")
        except Exception as error:  # the store's own errors name what failed and where its log is
            raise DemoError(f"object store: {error}") from error
        kube.run("apply", "-f", "-", input_text=objects.secret_manifest(store, NAMESPACE))
        _say(f"starting the node agent for {objects.NODE} (log: {out / 'node-agent.log'})")
        agent = objects.start_agent(kubeconfig, NAMESPACE, out / "node-agent.log")
        extra = (f"--block-cache-root={objects.node_cache_root()}",
                 f"--allowed-host-path={objects.node_cache_root()}")
    _say(f"starting the operator (log: {out / 'operator.log'})")
    operator = _start_operator(kubeconfig, out / "operator.log", model_dir.parent, extra)
    try:
        manifest = _manifest(model_dir, checkout)
        if store is not None:
            manifest = yaml.safe_dump(objects.from_store(yaml.safe_load(manifest), store))
        name = yaml.safe_load(manifest)["metadata"]["name"]
        source = f"from s3://{store.bucket}/{objects.PREFIX}" if store is not None else model_dir.name
        _say(f"applying WarmModel {name} (builtin engine, {source})")
        kube.run("apply", "-f", "-", input_text=manifest)
        if store is not None and agent is not None:
            try:
                objects.wait_filled(lambda: kube.json("get", "warmmodel", name, "-n", NAMESPACE).get("status") or {},
                                    _say, agent, timeout)
            except RuntimeError as error:
                raise DemoError(str(error)) from None
        _wait_warm(kube, name, timeout)
        _say(f"pool is warm after {time.monotonic() - started:.1f}s of demo time")
        print(kube.run("get", "warmmodel", name, "-n", NAMESPACE, "-o", "wide"))

        timelines: list[PodTimeline] = []
        served_name = yaml.safe_load(manifest)["spec"]["model"].get("servedName", name)
        for pod in _pods(kube, name):
            ip = pod["status"].get("podIP")
            if not ip or not pod["status"].get("conditions"):
                continue
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])
            if not ready:
                continue
            base = f"http://{ip}:{DEFAULT_WORKER_PORT}"
            line = PodTimeline(pod=pod["metadata"]["name"], phases=scrape_phases(base))
            line.first_ttft_s = measure_ttft(base, served_name, PROMPT)
            steady = sorted(measure_ttft(base, served_name, PROMPT) for _ in range(STEADY_REQUESTS))
            line.steady_ttft_s = steady[len(steady) // 2]
            timelines.append(line)
        if not timelines:
            raise DemoError("no Ready worker pod to send a request to")
        completion = _complete(f"http://{_pods(kube, name)[0]['status']['podIP']}:{DEFAULT_WORKER_PORT}",
                               served_name)
        _say(f"completion from a warm pod: {completion!r}")
        print("\nCold start per pod (seconds since the worker process started):")
        print(phase_table(timelines))
        png = render_waterfall(timelines, out / "coldstart-timeline.png", f"warmpool cold start: {name}")
        (out / "coldstart.json").write_text(json.dumps([t.__dict__ for t in timelines], indent=2))
        _say(f"timeline chart: {png}")
        _say("the cluster stays up for you to explore: "
             f"kubectl --kubeconfig {kubeconfig} -n {NAMESPACE} get wm,pods; `make demo-down` cleans up")
        return 0
    finally:
        # The operator is a local process of the demo: stop it with the demo, the cluster stays.
        if operator.poll() is None:
            os.killpg(operator.pid, signal.SIGTERM)
            try:
                operator.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(operator.pid, signal.SIGKILL)
        _state_file().unlink(missing_ok=True)


def _complete(base_url: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}).encode()
    request = urllib.request.Request(base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text: str = json.loads(response.read())["choices"][0]["text"]
        return text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="warmpool demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--down", action="store_true", help="stop the demo cluster and clean up")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the pool to go warm")
    parser.add_argument("--object-store", action="store_true",
                        help="serve the model from a real S3 store (SeaweedFS on loopback) through a node agent's "
                             "cache, as in production; its first run builds SeaweedFS (long)")
    parser.add_argument("--repo", type=Path, default=None,
                        help="the warmpool source checkout to read examples/ and crds/ from "
                             "(default: the current directory)")
    args = parser.parse_args(argv)
    if args.down:
        return down()
    try:
        return run(args.timeout, find_checkout(args.repo), object_store=args.object_store)
    except KeyboardInterrupt:
        _say("interrupted: cleaning up")
        down()
        return 130
    except DemoError as error:
        print(f"warmpool demo: {error}", file=sys.stderr)
        return 1
