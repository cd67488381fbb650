"""Demand prediction in the running operator (#16), on the real local control plane with real
worker processes: a synthetic ramp of requests (loopback only, bounded in count and time) makes
the pool grow while the rate is still below what one pod serves, before the ramp's peak; the
request history survives an operator killed and started again; and a pool whose request metrics
cannot be read scales reactively, with the Predictive condition saying why.

The operator runs with ``--predict-step-seconds 2`` (a 60 s step would make each test last an
hour); every wait is bounded, and the assertions are on the order of events (the ramp's stage
when the Deployment grew), never on a stopwatch.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.io.history_store import CONFIGMAP_KEY_HISTORY, history_configmap_name
from warmpool_operator.rules.builders import CONFIGMAP_KEY_LEARNED_BUCKETS
from warmpool_operator.rules.forecast.buckets import MIN_PROMPTS
from warmpool_operator.rules.forecast.history import loads
from warmpool_operator.rules.forecast.lengths import round_up

from tests.support.e2e import Operator, World, delete_warmmodels, http, metric, pod_ready, readable_by_pods, warmmodel
from warmpool.contract.api import CONDITION_PREDICTIVE
from warmpool.contract.http import PATH_METRICS
from warmpool.contract.metrics import METRIC_WARMUP_PLANNED
from warmpool.contract.pods import CONFIGMAP_SUFFIX

pytestmark = pytest.mark.integration

STEP_S = 2
PREDICT_ARGS = ("--predict-step-seconds", str(STEP_S))
STEADY_MEMORY = f"--memory-capacity-bytes={64 * 1024**3}"
PROMPT = "the quick brown fox jumps over the lazy dog"
#: Tokens generated per request: one pod's capacity is then a few requests per second on a CPU.
MAX_TOKENS = 8
#: The ramp: fractions of one pod's measured capacity, each held for STAGE_S seconds (two steps).
RAMP = tuple(round(0.1 * k, 1) for k in range(1, 17))
STAGE_S = 4.0
#: Requests in flight from the test at most (the rest of a stage's schedule is skipped, counted).
MAX_IN_FLIGHT = 16

MakeWorld = Callable[..., World]


@pytest.fixture(scope="module")
def slow_model(pod_dir: Callable[[str], Path]) -> Path:
    """~70 MB of float32 weights: each completion takes long enough on a CPU that one pod's
    capacity is a rate this test's loopback client can go well past."""
    from warmpool_dev.testing_models import make_tiny_llama

    return readable_by_pods(make_tiny_llama(pod_dir("slow") / "model", layers=4, hidden=512, heads=8, kv_heads=4,
                                            intermediate=2048, vocab_size=512, max_position_embeddings=256))


@pytest.fixture()
def make_world(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[MakeWorld]:
    """A World whose operator subprocess takes the given Operator options (started once made)."""
    made: list[World] = []

    def make(**options: Any) -> World:
        operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False,
                            extra_args=PREDICT_ARGS, **options)
        operator.start()
        world = World(cluster, namespace, operator, diagnose_timeouts=True)
        made.append(world)
        return world

    yield make
    for world in made:
        if not world.operator.running():
            world.operator.start()
        delete_warmmodels(cluster, namespace)
        world.operator.stop()
        world.close()


def predictive(name: str, model: Path, *, learn: bool = False) -> dict[str, Any]:
    # One request at a time per pod: its capacity curve is then one point, the figure the ramp is
    # scaled by (a batching pod would measure a higher point during the ramp and rightly not grow).
    obj = warmmodel(name, model, replicas=1, min_warm=1, max_replicas=3,
                    worker_args=[STEADY_MEMORY, "--max-batch-size=1"])
    obj["spec"]["pool"]["predictive"] = {"enabled": True, "horizonSeconds": 10, "maxExtraReplicas": 2}
    obj["spec"]["warmup"]["learnBuckets"] = learn
    return obj


def forecast(world: World, name: str) -> dict[str, Any]:
    return dict((world.wm(name).get("status") or {}).get("forecast") or {})


def replicas(world: World, name: str) -> int:
    return int(world.get("deployment", name)["spec"]["replicas"])


def stored_history(world: World, name: str) -> Any | None:
    found = world.maybe("configmap", history_configmap_name(name))
    text = ((found or {}).get("data") or {}).get(CONFIGMAP_KEY_HISTORY)
    return loads(text) if text else None


class Ramp:
    """Requests to one pod at a rate that steps up through ``rates`` (bounded in count and time)."""

    def __init__(self, world: World, pod: dict[str, Any], model: str, rates: list[float]) -> None:
        self.url = world.base(pod) + "/v1/completions"
        self.model = model
        self.rates = rates
        self.stage = -1  # the stage being sent (read by the test's thread)
        self.sent = 0
        self.skipped = 0
        self.stop = threading.Event()
        self._in_flight = threading.Semaphore(MAX_IN_FLIGHT)
        self._thread = threading.Thread(target=self._run, name="ramp", daemon=True)

    def __enter__(self) -> Ramp:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self._thread.join(timeout=STAGE_S * len(self.rates) + 60)

    def _one(self) -> None:
        try:
            http(self.url, {"model": self.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
                 timeout=30)
        finally:
            self._in_flight.release()

    def _run(self) -> None:
        with ThreadPoolExecutor(max_workers=MAX_IN_FLIGHT, thread_name_prefix="ramp") as pool:
            for stage, rate in enumerate(self.rates):
                self.stage = stage
                count = max(1, round(rate * STAGE_S))
                started = time.monotonic()
                for index in range(count):
                    if self.stop.wait(max(0.0, started + index / rate - time.monotonic())):
                        return
                    if self._in_flight.acquire(blocking=False):
                        self.sent += 1
                        pool.submit(self._one)
                    else:
                        self.skipped += 1
                self.stop.wait(max(0.0, started + STAGE_S - time.monotonic()))
            self.stage = len(self.rates)


def test_a_ramp_grows_the_pool_before_its_peak_and_a_restart_keeps_the_history(
    make_world: MakeWorld, slow_model: Path
) -> None:
    began = time.monotonic()

    def say(what: str) -> None:
        print(f"predict: {time.monotonic() - began:5.1f}s {what}")

    world = make_world()
    world.apply(predictive("ramp", slow_model, learn=True))
    world.wait_ready("ramp", warm=1, timeout=180)
    pod = world.wait(lambda: next((p for p in world.pods("ramp") if pod_ready(p)), None), 60, "a Ready pod")
    say("one pod warm")

    # Some served requests, at a fifth of what the pod can serve at most (each is followed by four
    # times its own latency of quiet): the operator measures one pod's capacity from the worker's
    # own figures, and nothing in this traffic asks for a second pod.
    for _ in range(16):
        started = time.monotonic()
        world.complete(pod, "ramp", PROMPT, max_tokens=MAX_TOKENS)
        time.sleep(4 * (time.monotonic() - started))
    measured = world.wait(lambda: forecast(world, "ramp").get("capacityPerPod"), 60,
                          "status.forecast.capacityPerPod measured")
    capacity = float(measured)
    say("capacity measured")
    assert replicas(world, "ramp") == 1, world.dump()
    rates = [fraction * capacity for fraction in RAMP]
    print(f"predict: one pod serves {capacity:.2f} req/s; ramp {[round(r, 2) for r in rates]} req/s")

    grew_at: int | None = None
    capacity_at_growth = capacity
    seen: list[tuple[int, int, str | None]] = []
    with Ramp(world, pod, "ramp", rates) as ramp:
        deadline = time.monotonic() + STAGE_S * len(rates) + 30
        while time.monotonic() < deadline and ramp.stage < len(rates):
            count = replicas(world, "ramp")
            cond = world.condition("ramp", CONDITION_PREDICTIVE)
            seen.append((ramp.stage, count, cond.get("reason")))
            if count > 1:
                grew_at = ramp.stage
                # The capacity the operator judged by when it grew the pool: it goes on measuring
                # during the ramp, and a busier machine moves the figure (12.56 req/s before the ramp,
                # 13.74 during it, once).
                capacity_at_growth = float(forecast(world, "ramp").get("capacityPerPod") or capacity)
                break
            time.sleep(0.3)
    say(f"sent {ramp.sent}, skipped {ramp.skipped}; (stage, replicas, reason) seen: {seen[-8:]}")
    status = world.wm("ramp")["status"]
    print(f"predict: status.forecast {status.get('forecast')}; coldStart {status.get('coldStart')}")
    assert grew_at is not None, f"the pool never grew during the ramp: {seen}\n{world.dump()}"
    assert grew_at >= 0, "the pool grew before the ramp began"
    # The order of events: the pool grew while the rate sent was still within one pod's capacity (a
    # rule on the current rate adds a pod only once that is exceeded: the HPA's by more than its 10 %
    # tolerance), well before the ramp's peak.  At exactly 1.0x one pod still copes.  The capacity is the
    # one the operator held at that moment, not the figure read before the ramp.
    assert rates[grew_at] <= capacity_at_growth, (grew_at, rates, capacity, capacity_at_growth)
    assert grew_at < len(rates) - 1
    assert status["forecast"]["model"], status["forecast"]
    # What raised the pool is in the Event written at that pass (status is the latest pass's: the
    # forecast may have moved on by the time it is read, as it did once on a busy machine).
    events = json.loads(world.kubectl("get", "events", "--field-selector", "reason=PreWarm", "-o", "json"))["items"]
    assert any(e["message"].startswith("demand forecast: 1 -> ") for e in events), events

    # The history is in ConfigMap ramp-history; an operator killed and started again goes on from it.
    before = world.wait(lambda: (h := stored_history(world, "ramp")) is not None and len(h) >= 10 and h, 60,
                        "ten steps of history stored")
    say("ten steps of history stored")
    world.operator.kill()
    world.operator.start()
    after = world.wait(lambda: (h := stored_history(world, "ramp")) is not None and h.end > before.end + 2 and h,
                       90, "the restarted operator storing more history")
    assert after.start == before.start, "the restarted operator started the history from zero"
    assert after.requests[: len(before)] == before.requests  # what was stored is kept, step for step
    assert sum(r for r in after.requests if r > 0) >= ramp.sent // 2
    assert "history loaded" in world.operator.log().rsplit("operator start #2", 1)[-1]
    say("the restarted operator went on from the stored history")

    # spec.warmup.learnBuckets: every prompt served has one length. Once enough are seen, that length
    # (rounded up to a graph size) is learned, written where new pods read it, and a new pod warms at it.
    code, text = http(world.base(pod) + "/v1/completions",
                      {"model": "ramp", "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    assert code == 200, text
    length = round_up(json.loads(text)["usage"]["prompt_tokens"])
    assert length is not None and length not in (8, 16, 32)  # not one of the configured buckets
    for _ in range(MIN_PROMPTS):  # bounded: one at a time, one token each
        world.complete(pod, "ramp", PROMPT, max_tokens=1)

    def learned() -> dict[str, Any] | None:
        block = (world.wm("ramp")["status"].get("learnedBuckets") or {})
        return block if block.get("buckets") else None

    block = world.wait(learned, 60, "status.learnedBuckets with buckets")
    say("buckets learned")
    assert block["buckets"] == [length] and block["observed"] >= MIN_PROMPTS, block
    stored = world.get("configmap", f"ramp{CONFIGMAP_SUFFIX}")["data"]
    assert json.loads(stored[CONFIGMAP_KEY_LEARNED_BUCKETS])["buckets"] == [length]
    # The ramp's extra pod goes once the forecast recedes: wait for the pool of one, or the scale-down
    # may take the replacement of the pod deleted below (the newest), leaving only an older pod.
    def one_pod() -> list[dict[str, Any]] | None:
        found = world.pods("ramp")
        return found if len(found) == 1 and replicas(world, "ramp") == 1 else None

    (only,) = world.wait(one_pod, 180, "the pool back to one pod after the ramp")
    say("back to one pod")
    before = {only["metadata"]["name"]}
    world.kubectl("delete", "pod", only["metadata"]["name"], "--wait=false")

    def new_warm_pod() -> dict[str, Any] | None:
        return next((p for p in world.pods("ramp") if p["metadata"]["name"] not in before and pod_ready(p)), None)

    fresh = world.wait(new_warm_pod, 120, "a new pod Ready")
    say("a new pod Ready")
    code, text = http(world.base(fresh) + PATH_METRICS, timeout=5)
    assert code == 200, text[:300]
    assert (metric(text, METRIC_WARMUP_PLANNED, bucket=str(length)) or 0) > 0, text[-3000:]
    assert metric(text, METRIC_WARMUP_PLANNED, bucket="8") is None  # the configured buckets are not


def test_unreadable_request_metrics_leave_the_pool_reactive_and_say_why(
    make_world: MakeWorld, tiny_model: Path
) -> None:
    # The operator may dial 127.0.0.1 only; pods live in 127.N.0.0/16 (N >= 10): their metrics,
    # the request counters with them, cannot be read (as behind a NetworkPolicy).
    world = make_world(scrape_network="127.0.0.1/32")
    world.apply(predictive("blind", tiny_model))

    def unavailable() -> dict[str, Any] | None:
        cond = world.condition("blind", CONDITION_PREDICTIVE)
        return cond if cond.get("reason") == "RequestMetricsUnavailable" else None

    cond = world.wait(unavailable, 120, "Predictive=False RequestMetricsUnavailable")
    assert cond["status"] == "False" and "reactive" in cond["message"], cond
    pod = world.pods("blind")[0]["metadata"]["name"]
    assert f"{pod}: no metrics read from it" in cond["message"], cond
    assert replicas(world, "blind") == 1
    assert forecast(world, "blind").get("desiredReplicas") is None
