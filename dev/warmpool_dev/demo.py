"""`warmpool demo`: the main job end to end on a local cluster.

1. start the local cluster with its real node (kubelet, containerd, kube-proxy on this machine),
2. build the operator and worker images from the checkout's Dockerfiles and load them into the
   node (cached per revision of their inputs: a rerun with no change builds and loads nothing),
3. fetch the small real model (SmolLM2-135M-Instruct) and put it where the node's pods read it,
4. install the operator with the project's Helm chart (`helm upgrade --install`), which also
   installs the WarmModel CRD, and apply the builtin-engine example WarmModel,
5. show the pods loading and warming (stage, tier, layers resident) until the pool is warm,
6. send a completion through the WarmModel's Service (its ClusterIP, through kube-proxy), and
7. print the cold-start phases per pod with first-request vs steady-state TTFT, and render
   the same timeline as a PNG waterfall.

Ctrl-C, or `warmpool demo --down` (`make demo-down`), cleans everything up.

It reads the example WarmModel and the CRD from a warmpool source checkout: the current
directory (as `make demo` runs it), or the one `--repo` names.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from warmpool_devcluster.node_holder import DEMO_CLUSTER

from warmpool.contract.http import DEFAULT_WORKER_PORT, PATH_READYZ
from warmpool.contract.pods import LABEL_MODEL
from warmpool_dev.timeline import PodTimeline, measure_ttft, phase_table, render_waterfall, scrape_phases

CLUSTER_NAME = DEMO_CLUSTER
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


def _output_dir(checkout: Checkout) -> Path:
    return Path(os.environ.get("WARMPOOL_DEMO_OUTPUT", checkout.root / "demo-output"))


def down() -> int:
    """Stop the demo's cluster (its node, the chart's release and pods with it)."""
    from warmpool_devcluster import cluster

    left = cluster.down(CLUSTER_NAME)
    _say("cleaned up" if not left else f"cleaned up, but {len(left)} things remain on the machine (above)")
    return 0 if not left else 1


def _manifest(model_dir: Path, checkout: Checkout | None = None) -> str:
    """The example WarmModel, pointed at where the demo node keeps the model (``model_dir``)."""
    body = yaml.safe_load((checkout or find_checkout()).example.read_text())
    body["spec"]["model"]["nodeCache"]["root"] = str(model_dir.parent)
    body["spec"]["model"]["nodeCache"]["key"] = model_dir.name
    body["metadata"]["namespace"] = NAMESPACE
    # Two workers and two operator replicas on one 2-core node: each worker asks for half a core
    # (the example's one core each would leave the second worker Pending).
    requests = ((body["spec"].get("pod") or {}).get("resources") or {}).get("requests") or {}
    if "cpu" in requests:
        requests["cpu"] = "500m"
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


def _local_cluster() -> tuple[Path, Path, str]:
    """The demo's cluster, up with its real node: (kubeconfig, the node's state dir, its pod subnet)."""
    from warmpool_devcluster import cluster, node

    if os.environ.get("WARMPOOL_KUBECONFIG"):
        raise DemoError("the demo runs on a local cluster of its own (it builds images into its node and talks "
                        "to its pods): unset WARMPOOL_KUBECONFIG")
    _say("starting the local cluster with its real node (the first run builds the Kubernetes binaries and "
         "installs nothing else: `make host-packages` brought containerd, runc, CNI, dockerd)")
    kubeconfig = cluster.up(CLUSTER_NAME, node_runtime="containerd")
    report = cluster.status(CLUSTER_NAME)
    return kubeconfig, node.node_dir(cluster.state_dir(CLUSTER_NAME)), str(report["node"]["podCIDR"])


def _service_url(kube: Kube, name: str) -> str:
    service = kube.json("get", "service", name, "-n", NAMESPACE)
    port = service["spec"]["ports"][0]["port"]
    return f"http://{service['spec']['clusterIP']}:{port}"


def run(timeout: float, checkout: Checkout) -> int:
    from warmpool_devcluster import images
    from warmpool_devcluster.node_files import node_models_root, publish

    from warmpool_dev import demo_install
    from warmpool_dev.model_fetch import ensure_model

    started = time.monotonic()
    kubeconfig, node_state, pod_cidr = _local_cluster()
    kube = Kube(kubeconfig)
    _say("building the images (operator, worker) and loading them into the node: the first run takes many "
         "minutes (the worker image holds torch), a rerun with no change none")
    try:
        loaded = images.load(checkout.root, node_state)
    except (images.ImageError, RuntimeError) as error:
        raise DemoError(f"images: {error}") from error
    _say(f"images on the node: {', '.join(f'{k} {v}' for k, v in loaded.items())}")
    _say("fetching the small real model (SmolLM2-135M-Instruct)")
    model_dir = publish(ensure_model(), "smollm2-135m-instruct")
    kube.run("create", "namespace", NAMESPACE, check=False)
    out = _output_dir(checkout)
    _say(f"installing the operator with the Helm chart (release {demo_install.RELEASE} in "
         f"{demo_install.RELEASE_NAMESPACE}, watching {NAMESPACE})")
    try:
        demo_install.install(kubeconfig, checkout.root / "helm" / "warmpool",
                             demo_install.values(loaded, pod_cidr, NAMESPACE, node_models_root()))
    except demo_install.InstallError as error:
        raise DemoError(str(error)) from error
    _wait_established(kube)
    manifest = _manifest(model_dir, checkout)
    name = yaml.safe_load(manifest)["metadata"]["name"]
    _say(f"applying WarmModel {name} (builtin engine, {model_dir.name})")
    kube.run("apply", "-f", "-", input_text=manifest)
    try:
        _wait_warm(kube, name, timeout)
    except DemoError:
        (out / "operator.log").parent.mkdir(parents=True, exist_ok=True)
        (out / "operator.log").write_text(kube.run("logs", "-n", demo_install.RELEASE_NAMESPACE, "-l",
                                                   demo_install.OPERATOR_SELECTOR, "--tail=500", check=False))
        _say(f"the operator's log: {out / 'operator.log'}")
        raise
    _say(f"pool is warm after {time.monotonic() - started:.1f}s of demo time")
    print(kube.run("get", "warmmodel", name, "-n", NAMESPACE, "-o", "wide"))

    timelines: list[PodTimeline] = []
    served_name = yaml.safe_load(manifest)["spec"]["model"].get("servedName", name)
    for pod in _pods(kube, name):
        ip = pod["status"].get("podIP")
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])
        if not ip or not ready:
            continue
        base = f"http://{ip}:{DEFAULT_WORKER_PORT}"
        line = PodTimeline(pod=pod["metadata"]["name"], phases=scrape_phases(base))
        line.first_ttft_s = measure_ttft(base, served_name, PROMPT)
        steady = sorted(measure_ttft(base, served_name, PROMPT) for _ in range(STEADY_REQUESTS))
        line.steady_ttft_s = steady[len(steady) // 2]
        timelines.append(line)
    if not timelines:
        raise DemoError("no Ready worker pod to send a request to")
    service = _service_url(kube, name)
    completion = _complete(service, served_name)
    _say(f"completion through the Service ({service}): {completion!r}")
    print("\nCold start per pod (seconds since the worker process started):")
    print(phase_table(timelines))
    png = render_waterfall(timelines, out / "coldstart-timeline.png", f"warmpool cold start: {name}")
    (out / "coldstart.json").write_text(json.dumps([t.__dict__ for t in timelines], indent=2))
    _say(f"timeline chart: {png}")
    _say("the cluster stays up for you to explore: "
         f"kubectl --kubeconfig {kubeconfig} -n {NAMESPACE} get wm,pods; `make demo-down` cleans up")
    return 0


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
    parser.add_argument("--repo", type=Path, default=None,
                        help="the warmpool source checkout to read examples/ and crds/ from "
                             "(default: the current directory)")
    args = parser.parse_args(argv)
    if args.down:
        return down()
    try:
        return run(args.timeout, find_checkout(args.repo))
    except KeyboardInterrupt:
        _say("interrupted: cleaning up")
        down()
        return 130
    except DemoError as error:
        print(f"warmpool demo: {error}", file=sys.stderr)
        return 1
