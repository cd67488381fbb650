"""Scale to zero on the real node: the activator (two replicas of the operator's image, as the chart
runs it) holds the requests of a pool at zero, the operator starts a pod for them, and the answer
is the engine's own greedy text.

One pool goes through the whole story, so the suite pays a few cold starts of a tiny model rather
than one per check: warm -> idle to zero (its Events say so) -> an activator replica killed while it
holds a request (the client gets an error at once; the other replica serves) -> back at zero, 50
concurrent requests, each answered with the engine's greedy text and none refused (429/503): the
pool's maxHeldRequests is 50 per activator replica, so no replica can be full -> warm again, the
Service routes to the pod and the activator sees no more traffic -> a hold timeout answers 503
naming the WarmModel.  A wait for kube-proxy polls its iptables rules (tests/support/kube_proxy.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from warmpool_bench import zero_activator as activator
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import Operator, World, http, metric, pod_ready, tiny_model, warmmodel
from tests.support.kube_proxy import cluster_ip_destinations
from warmpool.contract.api import CONDITION_READY, PLURAL
from warmpool.contract.metrics import METRIC_ACTIVATOR_REQUESTS
from warmpool.contract.zero import (
    DEFAULT_ACTIVATOR_PORT,
    ERROR_HOLD_TIMEOUT,
    HELD_ANNOTATION_PREFIX,
    LABEL_SERVICE_NAME,
)

PROMPT = "hello there"
MAX_TOKENS = 6
#: Requests sent at once to the pool at zero: at most maxHeldRequests (MAX_HELD, per activator
#: replica), so whichever replicas kube-proxy spreads them over, none is refused.
CONCURRENT = 50
MAX_HELD = 50


@pytest.fixture()
def zero_world(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[World]:
    if cluster.node is None or "operator" not in cluster.images:
        pytest.skip("the activator runs from the project's operator image on the local cluster's real node")
    operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False,
                        extra_args=("--activator-service", f"{namespace}/{activator.NAME}"))
    operator.start()
    world = World(cluster, namespace, operator, diagnose_timeouts=True)
    try:
        for obj in activator.activator_objects(cluster.images["operator"], namespace):
            world.apply(obj)
        yield world
    finally:
        logs = cluster.kubectl("-n", namespace, "logs", "-l", activator.SELECTOR, "--tail=60",
                               "--prefix", check=False)
        print("\n===== activator logs (tail) =====\n" + logs.stdout + logs.stderr)
        cluster.kubectl("-n", namespace, "delete", PLURAL, "--all", "--timeout=60s", check=False)
        operator.stop()
        world.close()


def _activator_pods(world: World) -> list[dict[str, Any]]:
    found = json.loads(world.kubectl("get", "pods", "-l", activator.SELECTOR, "-o", "json"))
    return [p for p in found["items"] if not p["metadata"].get("deletionTimestamp")]


def _slice_ips(world: World, service: str) -> dict[str, list[str]]:
    """The addresses of the operator's EndpointSlices of a pool's Service, by slice name."""
    found = json.loads(world.kubectl("get", "endpointslices", "-l", f"{LABEL_SERVICE_NAME}={service}", "-o", "json"))
    return {s["metadata"]["name"]: sorted(a for e in s.get("endpoints") or [] for a in e["addresses"])
            for s in found["items"]}


def _events(world: World, name: str) -> dict[str, str]:
    found = json.loads(world.kubectl("get", "events", "--field-selector",
                                     f"involvedObject.name={name},involvedObject.kind=WarmModel", "-o", "json"))
    return {e["reason"]: e["message"] for e in found["items"]}


def _post(url: str, host: str | None = None, timeout: float = 180.0) -> tuple[int, str, float]:
    """(status, body, seconds) of one completion; status 0 when the connection failed."""
    body = json.dumps({"model": "zero", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", **({"Host": host} if host else {})}
    request = urllib.request.Request(url + "/v1/completions", data=body, headers=headers)
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read().decode(), time.monotonic() - started
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode(errors="replace"), time.monotonic() - started
    except (urllib.error.URLError, OSError) as error:
        return 0, str(error), time.monotonic() - started


def _text(body: str) -> str:
    return str(json.loads(body)["choices"][0]["text"])


def _at_zero(world: World, activators: int) -> bool:
    """The pool at zero, and its Service listing only the activator's ready replicas."""
    slices = _slice_ips(world, "zero")
    return (world.get("deployment", "zero")["spec"]["replicas"] == 0 and not world.pods("zero")
            and not slices.get("zero-pods") and len(slices.get("zero-activator") or []) == activators)


def _held(world: World) -> dict[str, str]:
    annotations = world.wm("zero")["metadata"].get("annotations") or {}
    return {k.removeprefix(HELD_ANNOTATION_PREFIX): v for k, v in annotations.items()
            if k.startswith(HELD_ANNOTATION_PREFIX)}


def _activator_requests(world: World) -> float:
    total = 0.0
    for pod in _activator_pods(world):
        _, text = http(f"http://{pod['status']['podIP']}:{activator.METRICS_PORT}/metrics", timeout=5)
        for outcome in ("forwarded", "timed_out", "rejected_full", "client_gone", "error"):
            total += metric(text, METRIC_ACTIVATOR_REQUESTS, namespace=world.ns, warmmodel="zero",
                            outcome=outcome) or 0.0
    return total


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_pool_idles_to_zero_and_every_request_is_held_until_a_pod_answers(zero_world: World) -> None:
    world = zero_world
    node = world.cluster.node
    assert node is not None
    body = warmmodel("zero", tiny_model(), replicas=1, min_warm=1)
    body["spec"]["pool"]["scaleToZero"] = {"afterIdleSeconds": 6, "holdTimeoutSeconds": 240,
                                           "maxHeldRequests": MAX_HELD}
    world.apply(body)
    world.wait(lambda: len([p for p in _activator_pods(world) if pod_ready(p)]) == 2, 240, "two activator replicas")
    world.wait_ready("zero", warm=1, timeout=240)
    pod = world.pods("zero")[0]
    reference = world.complete(pod, "zero", PROMPT, max_tokens=MAX_TOKENS)
    service = world.get("service", "zero")
    cluster_ip = service["spec"]["clusterIP"]
    service_port = int(service["spec"]["ports"][0]["port"])
    via_service = f"http://{cluster_ip}:{service_port}"
    assert "selector" not in service["spec"], "a scale-to-zero pool's Service is routed by the operator's slices"
    assert _slice_ips(world, "zero")["zero-pods"] == [pod["status"]["podIP"]]

    # -- idle to zero: the pod goes, the Service routes to the activator, the Events and Ready say so.
    world.wait(lambda: _at_zero(world, activators=2), 120, "the pool at zero, routed to both activator replicas")
    world.wait(lambda: world.condition("zero", CONDITION_READY)["reason"] == "ScaledToZero", 30, "Ready ScaledToZero")
    assert world.condition("zero", CONDITION_READY)["status"] == "True"
    assert "no request for" in _events(world, "zero")["ScaledToZero"]

    # -- an activator replica killed while it holds a request: that client's connection ends at
    # once, and the other replica holds and serves the next one.
    outcome: dict[str, tuple[int, str, float]] = {}
    waiting = threading.Thread(target=lambda: outcome.setdefault("held", _post(via_service)))
    waiting.start()
    holders = world.wait(lambda: _held(world), 30, "a held-requests annotation on the WarmModel", every=0.1)
    (holder,) = holders
    victim = next(p for p in _activator_pods(world) if p["metadata"]["name"] == holder)
    survivor = next(p for p in _activator_pods(world) if p["metadata"]["name"] != holder)
    container = victim["status"]["containerStatuses"][0]["containerID"]
    killed = time.monotonic()
    os.kill(node.container_pid(container), signal.SIGKILL)
    waiting.join(timeout=30)
    assert not waiting.is_alive(), "the client of a killed activator hangs"
    code, text, _ = outcome["held"]
    assert code in (0, 502, 503) or text == "", (code, text)
    print(f"\nactivator {holder} killed mid-hold: its client saw {code} {text[:80]!r} "
          f"{time.monotonic() - killed:.2f}s later")
    assert time.monotonic() - killed < 10
    code, text, took = _post(f"http://{survivor['status']['podIP']}:{DEFAULT_ACTIVATOR_PORT}", host=cluster_ip)
    assert code == 200, text
    assert _text(text) == reference, "the held request's answer is not the engine's greedy text"
    print(f"the other replica held a request {took:.2f}s until a pod answered it")
    assert "request(s) held by the activator" in _events(world, "zero")["ScaledFromZero"]

    # -- back at zero, 50 requests at once through the Service's ClusterIP: every one answered with
    # the engine's greedy text, none refused (each replica holds up to MAX_HELD).
    assert CONCURRENT <= MAX_HELD
    world.wait(lambda: _at_zero(world, activators=2), 180, "the pool at zero again, both activator replicas back")
    activator_ips = set(_slice_ips(world, "zero")["zero-activator"])
    world.wait(lambda: cluster_ip_destinations(cluster_ip, service_port) == activator_ips, 30,
               "kube-proxy routing the ClusterIP to the two activator replicas only")
    with ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(lambda _: _post(via_service), range(CONCURRENT)))
    codes = [code for code, _, _ in answers]
    assert 429 not in codes and 503 not in codes, f"refused below maxHeldRequests: {sorted(codes)}"
    assert codes == [200] * CONCURRENT, [(c, t[:200]) for c, t, _ in answers if c != 200]
    assert [_text(text) for _, text, _ in answers] == [reference] * CONCURRENT, "not the engine's greedy text"
    print(f"{CONCURRENT} concurrent held requests answered in {min(t for *_, t in answers):.2f}-"
          f"{max(t for *_, t in answers):.2f}s")

    # -- warm: the Service routes to the pod, and the activator sees no more traffic.
    world.wait(lambda: _slice_ips(world, "zero").get("zero-pods") and not _slice_ips(world, "zero")["zero-activator"],
               60, "the Service switched back to the pod")
    pod_ips = set(_slice_ips(world, "zero")["zero-pods"])
    world.wait(lambda: cluster_ip_destinations(cluster_ip, service_port) == pod_ips, 30,
               "kube-proxy routing the ClusterIP to the pod only")
    before = _activator_requests(world)
    for _ in range(5):
        code, text, _ = _post(via_service)
        assert code == 200 and _text(text) == reference, (code, text)
    assert _activator_requests(world) == before, "the activator still in the data path with a warm pod"

    # -- a hold timeout: the 503 names the WarmModel and what the request waited for.
    world.kubectl("patch", f"{PLURAL}/zero", "--type=merge", "-p",
                  json.dumps({"spec": {"pool": {"scaleToZero": {"holdTimeoutSeconds": 1}}}}))
    world.wait(lambda: _at_zero(world, activators=2), 180, "the pool at zero a third time")
    code, text, took = _post(via_service)
    assert code == 503, text
    error = json.loads(text)["error"]
    assert error["type"] == ERROR_HOLD_TIMEOUT and f"{world.ns}/zero" in error["message"], error
    assert "holdTimeoutSeconds" in error["message"] and took < 10, (error, took)
