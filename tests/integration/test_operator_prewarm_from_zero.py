"""Pre-warm from zero, live: a `warmpool operator` process, restarted over a
scale-to-zero pool at zero whose stored history holds a daily burst at this time of day, raises the
pool from zero BEFORE the burst, at the step it chose from that history.

On the api_server fixture (a real API server, no node, no controllers): what the operator does is
the Deployment's replicas, which this test reads; the pod a Deployment controller would then start
is not made here (the warm pod's own start is the real-node tests' part).  The operator's clock and
this test's are the same machine's, and the proof is by order: the Deployment was seen raised (and
the PreWarm Event posted) before the forecast burst's step began, with status.forecast saying what it
expected and at which step.

The history (10 s steps, 28 hours) repeats one day: 20 s bursts every 2 minutes, none in the 2
minutes before the burst.  A restarted operator scores its baselines on the stored steps at once
(rules/forecast/forecaster.py), so seasonal naive, exact on this history, forecasts yesterday's
burst; no capacity was measured since the restart (nothing served), so the forecast asks for the
one pod any request needs (rules/forecast/decision.py).  Either part missing: the pool stays at zero
until the first request, and this test fails.  Wall time: about 30 s (two operator starts, and the
burst set 28 s after the second).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
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

pytestmark = pytest.mark.integration

NAME = "prewarm"
STEP_S = 10
DAY_STEPS = 86400 // STEP_S
BURST = 40  # requests in each 10 s step of a burst
#: The lead time planned for (no cold start measured): two steps, so that a pass that closes a step
#: a few seconds late (a pool with no pod is passed over less often) still raises the pool ahead.
LEAD_S = 2 * STEP_S
#: How far after the second operator start the burst is set: its load, the first forecast (a
#: LightGBM training on the history) and the lead time fit inside.
BURST_AFTER_S = LEAD_S + 8.0
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


@pytest.fixture()
def pool(api_server: ClusterHandle) -> Iterator[Pool]:
    namespace = f"prewarm-{int(time.time() * 1000) % 10**8}"
    api_server.kubectl("create", "namespace", namespace)
    try:
        yield Pool(api_server, namespace)
    finally:
        api_server.kubectl("-n", namespace, "delete", PLURAL, "--all", "--wait=false", check=False)
        for ref in api_server.kubectl("-n", namespace, "get", PLURAL, "-o", "name", check=False).stdout.split():
            api_server.kubectl("-n", namespace, "patch", ref, "--type=merge", "-p",
                               '{"metadata":{"finalizers":null}}', check=False)
        api_server.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_a_restarted_operator_raises_a_pool_at_zero_before_the_burst_its_history_forecasts(
        pool: Pool, tmp_path: Path) -> None:
    obj = warmmodel(NAME, model_root() / NAME, replicas=1, min_warm=0, max_replicas=2)
    obj["spec"]["pool"]["scaleToZero"] = {"afterIdleSeconds": 60}
    obj["spec"]["pool"]["predictive"] = {"enabled": True, "horizonSeconds": LEAD_S, "maxExtraReplicas": 1}
    pool.cluster.kubectl("-n", pool.namespace, "apply", "-f", "-", input=json.dumps(obj))
    operator = Operator(pool.cluster, pool.namespace, tmp_path / "operator.log", installed=False,
                        extra_args=("--predict-step-seconds", str(STEP_S)))
    try:
        # The first operator makes the pool; it is then stopped with the pool at zero (as the
        # scale-to-zero path leaves it: the Deployment at 0 replicas) and its history replaced.
        operator.start()
        _until(lambda: pool.replicas() is not None, START_S, "the first operator making the Deployment")
        operator.stop()
        pool.cluster.kubectl("-n", pool.namespace, "scale", "deployment", NAME, "--replicas=0")
        burst_step = math.ceil((time.time() + BURST_AFTER_S) / STEP_S)
        pool.seed(daily_history(burst_step, end=int(time.time() // STEP_S)))
        burst_at = burst_step * STEP_S

        operator.start()
        _until(lambda: "history loaded" in operator.log(), START_S, "the restarted operator loading the history")
        assert pool.replicas() == 0, "the restarted operator left zero before any forecast"
        restarted = time.time()
        _until(lambda: (pool.replicas() or 0) >= 1, burst_at - time.time() + 2 * STEP_S, "the pool raised from zero")
        raised_seen = time.time()  # an upper bound on when it was raised (polled every 0.2 s)
        wm = pool.get(PLURAL, NAME)
        assert wm is not None
        forecast = wm["status"].get("forecast") or {}
        conditions = {c["type"]: c for c in wm["status"].get("conditions") or []}
        print(f"\nraised {burst_at - raised_seen:.1f} s before the burst, {raised_seen - restarted:.1f} s after the "
              f"history was loaded; status.forecast: {forecast}")
        assert raised_seen < burst_at, (f"the pool left zero {raised_seen - burst_at:.1f} s after the burst began: "
                                        "not ahead of it")
        assert pool.replicas() == 1  # one pod: no capacity measured since the restart
        assert forecast.get("stepSeconds") == STEP_S and forecast.get("model") == "seasonal_naive", forecast
        assert ": 10 s steps (the longest allowed step ≤ half the typical burst)" in forecast["reason"]
        assert (forecast.get("predictedRate") or 0) >= BURST / STEP_S, forecast
        assert conditions[CONDITION_PREDICTIVE]["reason"] == REASON_PRE_WARMING, conditions[CONDITION_PREDICTIVE]
        events = _until(pool.prewarm_events, 10, "the PreWarm Event")
        assert "0 -> 1 pods" in events[0]["message"], events[0]["message"]
    finally:
        operator.stop()
        print(f"\n===== operator log (tail) =====\n{operator.log()[-4000:]}")
