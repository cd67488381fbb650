"""The operator puts idle pods to sleep and wakes them, on the real local control plane with
real workers in containers on the local cluster's real node: idle sleep down to minAwake with the memory
measured, a request to a sleeping pod answered with the same greedy text, `kubectl scale` waking
a sleeping pod before any new pod is Ready, the operator killed while pods sleep, two WarmModels
under memory pressure on one node, and the upgrade of a pool made before the awake label.

Short afterIdleSeconds and a one-second scrape interval; every wait is bounded, and the tests
assert on labels, Events and the workers' own metrics, never on a stopwatch.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import (
    Operator,
    World,
    delete_warmmodels,
    http,
    metric,
    pod_ready,
    readable_by_pods,
    rss,
    warmmodel,
)
from warmpool.contract.api import PLURAL
from warmpool.contract.http import PATH_METRICS
from warmpool.contract.metrics import (
    METRIC_SLEEP_LEVEL,
    METRIC_SLEEP_RELEASED_BYTES,
    METRIC_SLEEPS,
    METRIC_WAKES_ON_REQUEST,
)
from warmpool.contract.pods import ANNOTATION_TIER, AWAKE_FALSE, AWAKE_TRUE, LABEL_AWAKE

pytestmark = pytest.mark.integration

#: Memory measured against a capacity far above what a tiny worker uses: tier full throughout.
STEADY_MEMORY = f"--memory-capacity-bytes={64 * 1024**3}"
#: A capacity a worker exceeds by itself: every pod on the node reads the paused tier.
PRESSURE_MEMORY = f"--memory-capacity-bytes={1 << 20}"
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def sleepy_model(pod_dir: Callable[[str], Path]) -> Path:
    """~60 MB of float16 weights served in float32 (converted copies): what a level-1 sleep frees
    stands well above the interpreter's noise."""
    from warmpool_dev.testing_models import make_tiny_llama

    return readable_by_pods(make_tiny_llama(pod_dir("sleepy") / "model", layers=4, hidden=512, heads=8,
                                            kv_heads=4, intermediate=2048, vocab_size=512, dtype="float16",
                                            max_position_embeddings=256))


@pytest.fixture()
def world(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[World]:
    operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False)
    operator.start()
    made = World(cluster, namespace, operator, diagnose_timeouts=True)
    try:
        yield made
    finally:
        if not operator.running():
            operator.start()  # a test that killed it: it sees its WarmModels go and stops their passes
        delete_warmmodels(cluster, namespace)
        operator.stop()
        made.close()


def sleepy(name: str, model: Path, *, replicas: int, sleep: dict[str, Any], memory: str = STEADY_MEMORY,
           node: str | None = None) -> dict[str, Any]:
    obj = warmmodel(name, model, replicas=replicas, min_warm=1, max_replicas=4,
                    worker_args=["--dtype=float32", memory])
    obj["spec"]["pool"]["sleep"] = sleep
    if node is not None:
        obj["spec"]["pod"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return obj


def scraped(world: World, pod: dict[str, Any]) -> str:
    code, text = http(world.base(pod) + PATH_METRICS, timeout=5)
    assert code == 200, text[:300]
    return text


def level(world: World, pod: dict[str, Any]) -> float | None:
    return metric(scraped(world, pod), METRIC_SLEEP_LEVEL)


def awake_label(pod: dict[str, Any]) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(LABEL_AWAKE)


def events(world: World, reason: str) -> list[dict[str, Any]]:
    raw = world.kubectl("get", "events", "--field-selector", f"reason={reason}", "-o", "json")
    return list(json.loads(raw)["items"])


def by_name(world: World, model: str) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in world.pods(model)}


def asleep_pods(world: World, model: str) -> list[dict[str, Any]]:
    return [p for p in world.pods(model) if pod_ready(p) and (level(world, p) or 0) > 0]


def one_asleep(world: World, model: str) -> dict[str, Any] | None:
    """The pool's only sleeping pod, once exactly one sleeps."""
    found = asleep_pods(world, model)
    return found[0] if len(found) == 1 else None


def first_ready(world: World, model: str) -> dict[str, Any] | None:
    found = world.pods(model)
    return found[0] if found and pod_ready(found[0]) else None


def test_idle_pool_sleeps_to_min_awake_answers_the_same_and_scale_wakes_before_a_new_pod(
    world: World, sleepy_model: Path
) -> None:
    world.apply(sleepy("idle", sleepy_model, replicas=2, sleep={"afterIdleSeconds": 3, "minAwake": 1}))
    world.wait_ready("idle", warm=2, timeout=240)
    def two_ready() -> list[dict[str, Any]] | None:
        found = world.pods("idle")
        return found if len(found) == 2 and all(map(pod_ready, found)) else None

    world.wait(two_ready, 60, "two Ready pods")

    # Idle for afterIdleSeconds: one pod sleeps (minAwake 1 keeps the other), out of the Service.
    asleep = world.wait(lambda: one_asleep(world, "idle"), 60, "one pod asleep")
    name = asleep["metadata"]["name"]
    world.wait(lambda: awake_label(by_name(world, "idle")[name]) == AWAKE_FALSE, 20,
               "the sleeping pod labelled awake=false")
    other = next(p for n, p in by_name(world, "idle").items() if n != name)
    assert awake_label(other) == AWAKE_TRUE and level(world, other) == 0
    world.wait(lambda: world.wm("idle")["status"].get("sleepingReplicas") == 1, 30, "status counting one asleep")
    assert world.wm("idle")["status"]["awakeReplicas"] == 1
    assert any(name in e["message"] and "idle" in e["message"] for e in events(world, "PodAsleep"))
    # The Service's endpoints follow: only the awake pod is selected.
    assert world.get("service", "idle")["spec"]["selector"][LABEL_AWAKE] == AWAKE_TRUE
    expected = world.complete(other, "idle", PROMPT, max_tokens=6)  # an awake engine's greedy text

    # A request that reaches the sleeping pod is answered, with the same greedy text; it woke itself.
    # Its memory, measured from outside the worker (VmRSS), asleep and then awake again:
    asleep_rss = rss(world.worker_pid(asleep))
    released = metric(scraped(world, asleep), METRIC_SLEEP_RELEASED_BYTES) or 0
    assert level(world, asleep) == 1, f"{name} woke before its memory was measured\n{world.dump()}"
    assert world.complete(asleep, "idle", PROMPT, max_tokens=6) == expected
    awake_rss = rss(world.worker_pid(asleep))
    print(f"sleep: {name} VmRSS asleep {asleep_rss >> 20} MiB, awake {awake_rss >> 20} MiB; "
          f"the worker measured {int(released) >> 20} MiB released")
    assert asleep_rss < awake_rss - 30 * 2**20, (asleep_rss, awake_rss)
    assert released >= 30 * 2**20
    assert metric(scraped(world, asleep), METRIC_WAKES_ON_REQUEST) == 1
    # ... and the operator puts it back into the Service.
    world.wait(lambda: awake_label(by_name(world, "idle")[name]) == AWAKE_TRUE, 20,
               "the self-woken pod labelled awake=true again")
    assert any(name in e["message"] for e in events(world, "PodWokeOnRequest"))

    # Idle again: one sleeps; then `kubectl scale` up wakes it before the new pod is Ready.
    asleep = world.wait(lambda: one_asleep(world, "idle"), 60, "one pod asleep again")
    name = asleep["metadata"]["name"]
    before = set(by_name(world, "idle"))
    self_woken = [e["metadata"]["name"] for e in events(world, "PodWokeOnRequest") if name in e["message"]]
    world.kubectl("scale", f"{PLURAL}/idle", "--replicas=3")
    order: list[str] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and "new-ready" not in order:
        pods_now = by_name(world, "idle")
        if "woken" not in order and name in pods_now and level(world, pods_now[name]) == 0:
            order.append("woken")
        if any(pod_ready(p) for n, p in pods_now.items() if n not in before):
            order.append("new-ready")
        time.sleep(0.2)
    assert order[:1] == ["woken"], f"{order}\n{world.dump()}"
    assert "new-ready" in order, "the new pod never became Ready"
    woken = [e for e in events(world, "PodWoken") if name in e["message"]]
    assert woken and "pool grew" in woken[0]["message"], woken
    # The operator woke it: no Event says a request did (a scrape sent before the wake showed it asleep).
    assert [e["metadata"]["name"] for e in events(world, "PodWokeOnRequest") if name in e["message"]] == self_woken


def test_operator_killed_while_pods_sleep_they_serve_and_wake_on_requests(
    world: World, sleepy_model: Path
) -> None:
    world.apply(sleepy("dark", sleepy_model, replicas=2, sleep={"afterIdleSeconds": 2, "minAwake": 1}))
    world.wait_ready("dark", warm=2, timeout=240)
    asleep = world.wait(lambda: one_asleep(world, "dark"), 60, "one pod asleep")
    world.wait(lambda: awake_label(by_name(world, "dark")[asleep["metadata"]["name"]]) == AWAKE_FALSE,
               20, "awake=false on the sleeping pod")
    world.operator.kill()

    # No operator: both pods keep serving; the sleeping one wakes for the request it receives.
    for pod in world.pods("dark"):
        assert world.complete(pod, "dark", PROMPT, max_tokens=4)
    assert level(world, asleep) == 0
    assert metric(scraped(world, asleep), METRIC_WAKES_ON_REQUEST) == 1
    assert all(pod_ready(p) for p in world.pods("dark"))

    # The operator back: the woken pod is back in the Service (its level read from its metrics).
    world.operator.start()
    world.wait(lambda: awake_label(by_name(world, "dark")[asleep["metadata"]["name"]]) == AWAKE_TRUE,
               60, "the pod that woke while the operator was down relabelled awake=true")


def _first_node(world: World) -> str:
    nodes = json.loads(world.cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    # Untainted only: the test session's second node is tainted (the suite's pods stay on node 0).
    ready = [n for n in nodes if (n["metadata"].get("labels") or {}).get("kubernetes.io/hostname")
             and not (n.get("spec") or {}).get("taints")]
    assert ready, "no untainted node carries kubernetes.io/hostname"
    return str(ready[0]["metadata"]["labels"]["kubernetes.io/hostname"])


def test_memory_pressure_sleeps_the_idle_model_and_the_busy_one_keeps_serving(
    world: World, sleepy_model: Path
) -> None:
    node = _first_node(world)
    # Neither has an idle timeout: only memory pressure can put a pod to sleep.  minAwake 0 on
    # both: pressure may take either pool's last awake pod, so which one sleeps is the rule's choice.
    world.apply(sleepy("busy", sleepy_model, replicas=1, sleep={"minAwake": 0}, memory=PRESSURE_MEMORY, node=node))
    busy_pod = world.wait(lambda: (found := world.pods("busy")) and found[0]["status"].get("podIP") and found[0],
                          120, "the busy pod with an address")
    stop = threading.Event()
    answers: list[int] = []

    def load() -> None:  # bounded in count and time; before the pod is Ready its 503s are not counted
        deadline = time.monotonic() + 300
        while not stop.is_set() and len(answers) < 3000 and time.monotonic() < deadline:
            code, _ = http(world.base(busy_pod) + "/v1/completions",
                           {"model": "busy", "prompt": "hi", "max_tokens": 1, "temperature": 0}, timeout=30)
            if answers or code == 200:
                answers.append(code)
            time.sleep(0.1)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        world.wait(lambda: len(answers) >= 10, 240, "the busy model serving its load")
        world.apply(sleepy("quiet", sleepy_model, replicas=1, sleep={"minAwake": 0}, memory=PRESSURE_MEMORY,
                           node=node))
        quiet = world.wait(lambda: first_ready(world, "quiet"), 240, "quiet Ready")

        def tier(pod: dict[str, Any]) -> str | None:
            live = world.get("pod", pod["metadata"]["name"])
            return (live["metadata"].get("annotations") or {}).get(ANNOTATION_TIER)

        world.wait(lambda: tier(quiet) == tier(busy_pod) == "paused", 60, "both pods at the paused tier")
        busy_sleeps = metric(scraped(world, busy_pod), METRIC_SLEEPS)
        world.wait(lambda: (level(world, quiet) or 0) > 0, 90, "the idle model's pod put to sleep")
        asleep = [e for e in events(world, "PodAsleep") if quiet["metadata"]["name"] in e["message"]]
        assert asleep and "memory pressure" in asleep[0]["message"], asleep
        # A few more scrape rounds under pressure: the busy pod keeps serving, awake.
        seen = len(answers)
        world.wait(lambda: len(answers) >= seen + 30, 60, "more requests served")
    finally:
        stop.set()
        thread.join(timeout=40)
    text = scraped(world, busy_pod)
    assert metric(text, METRIC_SLEEPS) == busy_sleeps, "the busy pod was put to sleep"
    assert level(world, busy_pod) == 0
    assert all(code == 200 for code in answers), sorted(set(answers))
    print(f"pressure: {len(answers)} requests to the busy pod, all 200; the idle pod asleep")


def test_a_pool_made_before_the_awake_label_keeps_its_endpoints_through_the_upgrade(
    world: World, sleepy_model: Path
) -> None:
    world.apply(sleepy("legacy", sleepy_model, replicas=1, sleep={"afterIdleSeconds": 3600}))
    world.wait_ready("legacy", warm=1, timeout=240)
    # As a pool of an older operator left it: no awake label on its pods, a Service without it.
    world.operator.stop()
    pod = world.pods("legacy")[0]
    world.kubectl("label", "pod", pod["metadata"]["name"], f"{LABEL_AWAKE}-")
    world.kubectl("patch", "service", "legacy", "--type=json", "-p", json.dumps(
        [{"op": "remove", "path": "/spec/selector/" + LABEL_AWAKE.replace("/", "~1")}]))
    assert LABEL_AWAKE not in world.get("service", "legacy")["spec"]["selector"]

    world.operator.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        selector = world.get("service", "legacy")["spec"]["selector"]
        labels = [awake_label(p) for p in world.pods("legacy")]
        if LABEL_AWAKE in selector:
            # The Service asks for the label only once every live pod carries it.
            assert labels == [AWAKE_TRUE], labels
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the Service never selected the awake label\n{world.dump()}")
    log = world.operator.log().split("operator start #2")[-1]
    relabelled = log.index(f"labelled {LABEL_AWAKE}=true")
    assert relabelled < log.index("Service"), log[-3000:]

    # The live pod matches the Service's new selector (the local control plane refuses loopback
    # addresses in EndpointSlices, so the match is checked here, as the endpoints controller does).
    selector = world.get("service", "legacy")["spec"]["selector"]
    labels = world.get("pod", pod["metadata"]["name"])["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in selector.items()), (selector, labels)
