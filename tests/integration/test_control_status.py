"""A status that explains (issue 42, item 4), through the reconcile pass over the in-memory API
server and against a real one (the control_cluster fixture): status.url, each pod's cold-start
progress as its worker reports it, an Event per Ready transition (not per pass), and a crashing
pod's termination message carried into the Ready condition."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from warmpool_operator.rules import status as st

from tests.integration.test_control_pass import IPS, World
from tests.support.control_doubles import ControlCluster, Worker
from warmpool.contract.api import CONDITION_READY
from warmpool.contract.metrics import (
    LABEL_BUCKET,
    LABEL_PHASE,
    METRIC_LAYERS_RESIDENT,
    METRIC_LAYERS_TOTAL,
    METRIC_PHASE_DURATION,
    METRIC_PHASE_TIMESTAMP,
    METRIC_WARMUP_PLANNED,
    METRIC_WARMUP_PREFILLS,
)
from warmpool.contract.pods import WORKER_CONTAINER

DENIED = ("model load failed: /models/m/model.safetensors: cannot read: [Errno 13] Permission denied: "
          "'/models/m/model.safetensors'")


@dataclass
class WarmingWorker(Worker):
    """A worker part way through its cold start: weights mapped, 2 of 4 layers resident, 1 of 4
    warm-up prefills done, its process started at ``started`` (unix seconds)."""

    started: float = 0.0

    def text(self) -> str:
        return super().text() + "".join((
            f'{METRIC_PHASE_TIMESTAMP}{{{LABEL_PHASE}="process_start"}} {self.started}\n',
            f'{METRIC_PHASE_DURATION}{{{LABEL_PHASE}="process_start"}} 0\n',
            f'{METRIC_PHASE_DURATION}{{{LABEL_PHASE}="weights_mapped"}} 2\n',
            f"{METRIC_LAYERS_RESIDENT} 2\n{METRIC_LAYERS_TOTAL} 4\n",
            f'{METRIC_WARMUP_PLANNED}{{{LABEL_BUCKET}="32"}} 4\n',
            f"# TYPE {METRIC_WARMUP_PREFILLS} counter\n",
            f'{METRIC_WARMUP_PREFILLS}{{{LABEL_BUCKET}="32"}} 1\n',
        ))


@pytest.fixture()
def world(control_cluster: ControlCluster) -> World:
    return World(control_cluster)


async def test_status_carries_the_pools_url_and_each_pods_progress(world: World) -> None:
    await world.make()
    await world.run()
    await world.start_pods()
    started = world.clock() - 5.0
    for ip in IPS:
        world.workers.pods[ip] = WarmingWorker(ready=False, started=started)
    # A past cold start of this pool (60 s) is what the time left is estimated from.
    world.rec.memory.cold.seen["gone"] = (started - 100.0, 60.0)
    await world.run()
    status = await world.status()
    assert status["url"] == f"http://m.{world.ns}.svc:{world.rec.memory.parsed[1].pod.port}"  # type: ignore[index]
    assert [p["name"] for p in status["pods"]] == ["m-0", "m-1"]
    assert status["pods"][0] == {"name": "m-0", "stage": "weights_mapped", "warm": False, "layersResident": 2,
                                 "layersTotal": 4, "prefillsDone": 1, "prefillsPlanned": 4, "secondsLeft": 55}
    # Warm: the progress says so, and the estimate goes.
    for ip in IPS:
        world.workers.pods[ip] = Worker()
    await world.rec.scrape_round()
    await world.run()
    pods = (await world.status())["pods"]
    assert all(p["warm"] and "secondsLeft" not in p for p in pods), pods


async def test_an_event_when_the_pool_turns_ready_and_when_it_falls_below_min_warm_once_each(world: World) -> None:
    await world.make()
    await world.run()
    await world.start_pods()
    await world.run()
    await world.run()
    assert world.events.reasons().count(st.EVENT_POOL_READY) == 1
    for ip in IPS:
        world.workers.pods[ip].ready = False  # both fall cold (e.g. their weights changed)
    await world.rec.scrape_round()
    await world.run()
    await world.rec.scrape_round()
    await world.run()
    reasons = world.events.reasons()
    assert reasons.count(st.EVENT_BELOW_MIN_WARM) == 1 and reasons.count(st.EVENT_POOL_READY) == 1
    for ip in IPS:
        world.workers.pods[ip].ready = True
    await world.rec.scrape_round()
    await world.run()
    assert world.events.reasons().count(st.EVENT_POOL_READY) == 2


async def test_a_crashing_pods_termination_message_reaches_the_ready_condition(world: World) -> None:
    await world.make({"minWarm": 1})
    await world.run()
    pods = await world.start_pods()
    crashing = pods[0]
    crashing["status"] = {**crashing["status"], "conditions": [{"type": "Ready", "status": "False"}],
                          "containerStatuses": [{
                              "name": WORKER_CONTAINER, "ready": False, "restartCount": 2, "image": "w",
                              "imageID": "", "started": False,
                              "state": {"waiting": {"reason": "CrashLoopBackOff",
                                                    "message": "back-off 20s restarting failed container=worker"}},
                              "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": DENIED}}}]}
    await world.kube.put("pods", crashing)
    del world.workers.pods[IPS[0]]
    world.workers.pods[IPS[1]].ready = False
    await world.cluster.watch()
    await world.run()
    ready = (await world.conditions())[CONDITION_READY]
    assert ready["status"] == "False" and ready["reason"] == st.REASON_BELOW_MIN_WARM
    assert "m-0: container worker CrashLoopBackOff (exit code 1, 2 restarts): " + DENIED in ready["message"]
    entry = (await world.status())["pods"][0]
    assert entry["name"] == "m-0" and entry["stage"] == "CrashLoopBackOff" and "Permission denied" in entry["message"]
