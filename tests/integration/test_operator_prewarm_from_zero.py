"""Pre-warm from zero, live: a `warmpool operator` process, restarted over a scale-to-zero pool at
zero whose stored history holds a daily burst at this time of day, raises the pool from zero BEFORE
the burst, at the step it chose from that history.

In the suite, on the api_server fixture (a real API server, no node, no controllers): what the
operator does is the Deployment's replicas, which this test reads; no pod is started.  The operator's
clock and this test's are the same machine's, and the proof is by order: the Deployment was seen
raised (and the PreWarm Event posted) before the forecast burst's step began, with status.forecast
saying what it expected and at which step.  The real-node variant (opt-in: about a minute, beyond the
suite's budget) also waits for the pod: created, and Ready (warm), before the burst.

The history (10 s steps, 28 hours) repeats one day: 20 s bursts every 2 minutes, none in the 2
minutes before the burst.  A restarted operator scores its baselines on the stored steps at once
(rules/forecast/forecaster.py), so seasonal naive, exact on this history, forecasts yesterday's
burst; no capacity was measured since the restart (nothing served), so the forecast asks for the
one pod any request needs (rules/forecast/decision.py).  Either part missing: the pool stays at zero
until the first request, and this test fails.  Wall time on the api_server: about 20 s (two operator
starts, and the burst set 28 s after the second, raised one lead time, 20 s, before it).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.control.forecasting import limits_for
from warmpool_operator.io.history_store import CONFIGMAP_KEY_HISTORY, history_configmap_name
from warmpool_operator.rules.forecast.history import History, StepObservation, dumps
from warmpool_operator.rules.forecast.report import REASON_PRE_WARMING

from tests.support.e2e import Operator, model_root, warmmodel
from warmpool.contract.api import API_GROUP_VERSION, CONDITION_PREDICTIVE, KIND, PLURAL
from warmpool.contract.pods import LABEL_MODEL

pytestmark = pytest.mark.integration

NAME = "prewarm"
STEP_S = 10
DAY_STEPS = 86400 // STEP_S
BURST = 40  # requests in each 10 s step of a burst
#: The lead time planned for (no cold start measured): two steps, so that a pass that closes a step
#: a few seconds late (a pool with no pod is passed over less often) still raises the pool ahead.
LEAD_S = 2 * STEP_S
#: On the real node the lead must cover a new pod's cold start (the tiny model's: a few seconds).
REAL_NODE_LEAD_S = 3 * STEP_S
ENV_REAL_NODE = "WARMPOOL_TEST_PREWARM_REAL_NODE"
#: Bounds that only catch a hang.
START_S = 60.0

T = TypeVar("T")


def _until(check: Callable[[], T], within: float, what: str, every: float = 0.2) -> T:
    deadline = time.monotonic() + within
    while not (found := check()):
        assert time.monotonic() < deadline, f"not within {within:g}s: {what}"
        time.sleep(every)
    return found


def daily_history(burst_step: int, end: int) -> History:
    """Steps up to ``end`` (excluded), a whole history's worth, of one day repeated: 20 s bursts every
    2 minutes, none in the 2 minutes before ``burst_step``'s time of day, which starts one."""
    history = History(limits=limits_for(STEP_S))
    for step in range(end - history.limits.points, end):
        offset = (step - burst_step) % DAY_STEPS
        burst = offset % 12 in (0, 1) and offset < DAY_STEPS - 12
        history.record(step, StepObservation(requests=BURST if burst else 0))
    return history


class Pool:
    def __init__(self, cluster: ClusterHandle, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        found = self.cluster.kubectl("-n", self.namespace, "get", kind, name, "-o", "json", check=False)
        return json.loads(found.stdout) if found.returncode == 0 else None

    def pods(self) -> list[dict[str, Any]]:
        found = self.cluster.kubectl("-n", self.namespace, "get", "pods", "-l", f"{LABEL_MODEL}={NAME}", "-o",
                                     "json", check=False)
        return list(json.loads(found.stdout)["items"]) if found.returncode == 0 else []

    def replicas(self) -> int | None:
        deployment = self.get("deployment", NAME)
        return None if deployment is None else int(deployment["spec"].get("replicas") or 0)

    def prewarm_events(self) -> list[dict[str, Any]]:
        found = self.cluster.kubectl("-n", self.namespace, "get", "events", "-o", "json", check=False)
        items = json.loads(found.stdout)["items"] if found.returncode == 0 else []
        return [e for e in items if e.get("reason") == "PreWarm" and e["involvedObject"].get("name") == NAME]

    def seed(self, history: History) -> None:
        """The stored history, in the ConfigMap the operator keeps it in, owned by the WarmModel."""
        owner = self.get(PLURAL, NAME)
        assert owner is not None
        name = history_configmap_name(NAME)
        self.cluster.kubectl("-n", self.namespace, "delete", "configmap", name, "--ignore-not-found")
        self.cluster.kubectl("-n", self.namespace, "create", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "ownerReferences": [{
                "apiVersion": API_GROUP_VERSION, "kind": KIND, "name": NAME, "uid": owner["metadata"]["uid"],
                "controller": True}]},
            "data": {CONFIGMAP_KEY_HISTORY: dumps(history)},
        }))


def _cleanup(cluster: ClusterHandle, namespace: str) -> None:
    cluster.kubectl("-n", namespace, "delete", PLURAL, "--all", "--wait=false", check=False)
    for ref in cluster.kubectl("-n", namespace, "get", PLURAL, "-o", "name", check=False).stdout.split():
        cluster.kubectl("-n", namespace, "patch", ref, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                        check=False)


@pytest.fixture()
def pool(api_server: ClusterHandle) -> Iterator[Pool]:
    namespace = f"prewarm-{int(time.time() * 1000) % 10**8}"
    api_server.kubectl("create", "namespace", namespace)
    try:
        yield Pool(api_server, namespace)
    finally:
        _cleanup(api_server, namespace)
        api_server.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@dataclass(frozen=True)
class Raised:
    burst_at: float  # when the forecast burst's step begins (unix seconds)
    seen_at: float  # when this test first saw the Deployment raised (an upper bound on the raise)


def raise_ahead(pool: Pool, operator: Operator, model: Path, lead_s: float, *, real_pods: bool) -> Raised:
    """The WarmModel at zero with the daily history stored, the operator restarted over it: the
    pool raised from zero before the burst (asserted), with status.forecast and the PreWarm Event
    saying why."""
    obj = warmmodel(NAME, model, replicas=1, min_warm=0, max_replicas=2)
    obj["spec"]["pool"]["scaleToZero"] = {"afterIdleSeconds": 60}
    obj["spec"]["pool"]["predictive"] = {"enabled": True, "horizonSeconds": int(lead_s), "maxExtraReplicas": 1}
    pool.cluster.kubectl("-n", pool.namespace, "apply", "-f", "-", input=json.dumps(obj))
    # The first operator makes the pool; it is then stopped with the pool at zero (as the
    # scale-to-zero path leaves it: the Deployment at 0 replicas) and its history replaced.
    operator.start()
    _until(lambda: pool.replicas() is not None, START_S, "the first operator making the Deployment")
    operator.stop()
    pool.cluster.kubectl("-n", pool.namespace, "scale", "deployment", NAME, "--replicas=0")
    if real_pods:
        _until(lambda: not pool.pods(), START_S, "the pool's pods gone at zero")
    burst_step = math.ceil((time.time() + lead_s + 8.0) / STEP_S)  # the restart and first forecast fit before
    pool.seed(daily_history(burst_step, end=int(time.time() // STEP_S)))
    burst_at = float(burst_step * STEP_S)

    operator.start()
    _until(lambda: "history loaded" in operator.log(), START_S, "the restarted operator loading the history")
    assert pool.replicas() == 0, "the restarted operator left zero before any forecast"
    restarted = time.time()
    _until(lambda: (pool.replicas() or 0) >= 1, burst_at - time.time() + 2 * STEP_S, "the pool raised from zero")
    raised = Raised(burst_at, time.time())  # polled every 0.2 s

    def pre_warming() -> dict[str, Any] | None:
        """The WarmModel once its status is the raising pass's (the pass writes the Deployment first)."""
        wm = pool.get(PLURAL, NAME) or {}
        conditions = {c["type"]: c for c in (wm.get("status") or {}).get("conditions") or []}
        reason = conditions.get(CONDITION_PREDICTIVE, {}).get("reason")
        return wm if reason == REASON_PRE_WARMING else None

    wm = _until(pre_warming, 10, "status saying the pool is pre-warmed (condition Predictive: PreWarming)")
    assert wm is not None
    forecast = wm["status"].get("forecast") or {}
    print(f"\nraised {burst_at - raised.seen_at:.1f} s before the burst, {raised.seen_at - restarted:.1f} s after the "
          f"history was loaded; status.forecast: {forecast}")
    assert raised.seen_at < burst_at, (f"the pool left zero {raised.seen_at - burst_at:.1f} s after the burst began: "
                                       "not ahead of it")
    assert pool.replicas() == 1  # one pod: no capacity measured since the restart
    assert forecast.get("stepSeconds") == STEP_S and forecast.get("model") == "seasonal_naive", forecast
    assert ": 10 s steps (the longest allowed step ≤ half the typical burst)" in forecast["reason"]
    assert (forecast.get("predictedRate") or 0) >= BURST / STEP_S, forecast
    events = _until(pool.prewarm_events, 10, "the PreWarm Event")
    assert "0 -> 1 pods" in events[0]["message"], events[0]["message"]
    return raised


def test_a_restarted_operator_raises_a_pool_at_zero_before_the_burst_its_history_forecasts(
        pool: Pool, tmp_path: Path) -> None:
    operator = Operator(pool.cluster, pool.namespace, tmp_path / "operator.log", installed=False,
                        extra_args=("--predict-step-seconds", str(STEP_S)))
    try:
        raise_ahead(pool, operator, model_root() / NAME, LEAD_S, real_pods=False)
    finally:
        operator.stop()
        print(f"\n===== operator log (tail) =====\n{operator.log()[-4000:]}")


@pytest.mark.skipif(not os.environ.get(ENV_REAL_NODE), reason=f"the real-node variant (about a minute on the dev "
                    f"cluster, beyond the suite's budget): set {ENV_REAL_NODE}=1 and run it under the node's flock")
def test_on_the_real_node_the_pod_is_warm_before_the_burst(
        cluster: ClusterHandle, namespace: str, crd: str, tiny_model: Path, tmp_path: Path) -> None:
    pool = Pool(cluster, namespace)
    operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False,
                        extra_args=("--predict-step-seconds", str(STEP_S)))
    try:
        raised = raise_ahead(pool, operator, tiny_model, REAL_NODE_LEAD_S, real_pods=True)
        (pod,) = _until(lambda: [p for p in pool.pods() if _ready_at(p) is not None], raised.burst_at - time.time()
                        + START_S, "the pre-warmed pod Ready (warm)")
        created = _timestamp(pod["metadata"]["creationTimestamp"])
        ready = _ready_at(pod)
        assert ready is not None
        print(f"\npod {pod['metadata']['name']}: created {raised.burst_at - created:.0f} s and warm "
              f"{raised.burst_at - ready:.0f} s before the burst (API server timestamps, whole seconds)")
        assert created < raised.burst_at and ready < raised.burst_at, (created, ready, raised)
    finally:
        operator.stop()
        _cleanup(cluster, namespace)
        print(f"\n===== operator log (tail) =====\n{operator.log()[-4000:]}")


def _timestamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _ready_at(pod: dict[str, Any]) -> float | None:
    """When the pod turned Ready (its worker is warm: readiness waits for the warm-up), or None."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready" and condition.get("status") == "True":
            return _timestamp(condition["lastTransitionTime"])
    return None
