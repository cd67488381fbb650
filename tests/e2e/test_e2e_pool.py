"""A pool's life: scale up and down (the coldest pod goes first), a worker killed (its pod
restarts and warms again).  Memory pressure across 70/90 % (tiers with their hysteresis, the
warm-up depth, the pool's conditions) is integration/test_operator.py's
test_memory_pressure_moves_tiers_with_hysteresis: the same pods on the same node, driven once.

Tiny random Llama checkpoints: they load and warm in seconds, so the story is about the
operator and the pods, not the model.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.e2e import (
    World,
    deletion_cost,
    http,
    metric,
    pod_ready,
    restarts,
    tiny_model,
    warmmodel,
)
from warmpool.contract.api import CONDITION_READY, KIND, PLURAL
from warmpool.contract.http import DEFAULT_WORKER_PORT, PATH_METRICS
from warmpool.contract.metrics import METRIC_PHASE_TIMESTAMP

WARM_COST = 1000  # the operator's deletion cost of a verified-warm pod is at least this


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_scale_up_down_coldest_first_and_worker_restart(world: World, pod_dir: Callable[[str], Path]) -> None:
    model = tiny_model()
    world.apply(warmmodel("pool", model, replicas=1, min_warm=1, max_replicas=4))
    # Beside it, a pool whose weights its workers may not read: its status must say why.
    world.apply(warmmodel("denied", unreadable_copy(model, pod_dir("denied")), replicas=1, min_warm=1))
    world.wait_ready("pool", warm=1, timeout=120)
    status_explains(world)

    # -- scale up through the scale subresource (as `kubectl scale`, an HPA or KEDA would);
    # the pool never stops being Ready while the new pods warm.
    world.kubectl("scale", f"{PLURAL}/pool", "--replicas=3")
    readiness: list[str] = []

    def three_warm() -> bool:
        wm = world.wm("pool")
        conds = {c["type"]: c for c in wm["status"]["conditions"]}
        readiness.append(conds[CONDITION_READY]["status"])
        return bool(wm["status"].get("warmReplicas") == 3)

    world.wait(three_warm, 180, "three warm pods after scaling to 3")
    assert set(readiness) == {"True"}, f"the pool dropped out of Ready while scaling up: {readiness}"
    assert world.get("deployment", "pool")["spec"]["replicas"] == 3

    def costs_warm() -> list[dict[str, Any]] | None:
        pods = world.pods("pool")
        return pods if len(pods) == 3 and all((deletion_cost(p) or 0) >= WARM_COST for p in pods) else None

    pods = world.wait(costs_warm, 30, "every warm pod's deletion cost >= 1000")

    # -- scale down: the coldest pod goes first.  Freeze the *oldest* pod's worker (the one
    # the ReplicaSet would keep on its own, as the longest Ready): its warmth can no longer be
    # verified, the operator drops its deletion cost, and the scale-down takes it while the
    # kubelet still reports it Ready.
    if world.local:
        oldest = min(pods, key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"]))
        frozen_name = oldest["metadata"]["name"]
        pid = world.worker_pid(oldest)
        os.kill(pid, signal.SIGSTOP)
        try:
            def frozen_cold() -> dict[str, Any] | None:
                by_name = {p["metadata"]["name"]: p for p in world.pods("pool")}
                pod = by_name[frozen_name]
                return pod if (deletion_cost(pod) or 0) < WARM_COST else None

            cold = world.wait(frozen_cold, 20, f"the operator marking frozen pod {frozen_name} cold", every=0.2)
            still_ready = pod_ready(cold)
            others = [p for p in world.pods("pool") if p["metadata"]["name"] != frozen_name]
            assert all((deletion_cost(p) or 0) >= WARM_COST for p in others)
            world.kubectl("scale", f"{PLURAL}/pool", "--replicas=2")
            world.wait(lambda: frozen_name not in {p["metadata"]["name"] for p in world.pods("pool")}, 30,
                       f"the cold pod {frozen_name} removed first")
        finally:
            os.kill(pid, signal.SIGCONT)
        print(f"\nscale-down removed the coldest pod {frozen_name} (Ready by the kubelet then: {still_ready}, "
              f"deletion cost {deletion_cost(cold)} vs >= {WARM_COST} for the others)")
        kept = {p["metadata"]["name"] for p in others}
        world.wait(lambda: {p["metadata"]["name"] for p in world.pods("pool")} == kept, 60,
                   "exactly the two warm pods kept")
    else:
        world.kubectl("scale", f"{PLURAL}/pool", "--replicas=2")
        world.wait(lambda: len(world.pods("pool")) == 2, 60, "two pods after scaling to 2")
    world.wait_ready("pool", warm=2, timeout=60)
    world.wait(lambda: world.wm("pool")["status"]["replicas"] == 2, 60, "status.replicas 2 (the removed pod gone)")
    assert all(world.verified_warm(p) for p in world.pods("pool"))

    # -- a worker killed: its pod restarts the container, drops out of Ready, warms again.
    def started_at(pod: dict[str, Any]) -> float | None:
        text = http(world.base(pod) + PATH_METRICS, timeout=5)[1]
        return metric(text, METRIC_PHASE_TIMESTAMP, phase="process_start")

    if not world.local:
        pytest.skip("killing a worker process needs the local cluster's kubelet (processes on this host)")
    victim = world.pods("pool")[0]
    victim_name = victim["metadata"]["name"]
    before_restarts = restarts(victim)
    before_start = started_at(victim)
    os.kill(world.worker_pid(victim), signal.SIGKILL)
    seen_unready = False
    seen_pool_ready: set[str] = set()

    def back_warm() -> dict[str, Any] | None:
        nonlocal seen_unready
        pod = world.get("pod", victim_name)
        if not pod_ready(pod):
            seen_unready = True
        conds = {c["type"]: c for c in world.wm("pool")["status"]["conditions"]}
        seen_pool_ready.add(conds[CONDITION_READY]["status"])
        return pod if seen_unready and restarts(pod) > before_restarts and world.verified_warm(pod) else None

    pod = world.wait(back_warm, 120, f"killed worker of {victim_name} restarted and warm again", every=0.3)
    assert pod["metadata"]["uid"] == victim["metadata"]["uid"], "the pod restarts in place, it is not replaced"
    after_start = started_at(pod)
    assert before_start is not None and after_start is not None and after_start > before_start
    assert seen_pool_ready == {"True"}, "minWarm 1 held by the other pod: the pool stays Ready"
    world.wait_ready("pool", warm=2, timeout=60)
    print(f"worker of {victim_name} killed: restarts {before_restarts} -> {restarts(pod)}, warm again")


def unreadable_copy(model: Path, directory: Path) -> Path:
    """The model copied, its model.safetensors mode 0600 and root's (as `save_pretrained` leaves a
    file for a pod that runs as another user): the worker (UID 65532) cannot read it."""
    for item in model.iterdir():
        shutil.copy2(item, directory / item.name)
        (directory / item.name).chmod(0o644)
    (directory / "model.safetensors").chmod(0o600)
    return directory


def status_explains(world: World) -> None:
    """`kubectl get/describe wm` at a glance (issue 42 item 4): the warm pool's URL, progress and
    PoolReady Event; the denied pool's Ready condition carrying its worker's termination message."""
    status = world.wm("pool")["status"]
    assert status["url"] == f"http://pool.{world.ns}.svc:{DEFAULT_WORKER_PORT}"
    (entry,) = status["pods"]
    assert entry["warm"] and entry["stage"] == "ready" and entry["layersResident"] > 0, entry
    assert entry["prefillsPlanned"] > 0 and entry["prefillsDone"] > 0 and "secondsLeft" not in entry, entry

    def reasons() -> str | None:
        found = world.kubectl("get", "events", "-o", "jsonpath={.items[*].reason}",
                              "--field-selector", f"involvedObject.kind={KIND},involvedObject.name=pool")
        return found if "PoolReady" in found.split() else None

    world.wait(reasons, 30, "a PoolReady Event on the warm pool")

    def explained() -> str | None:
        message = str(world.condition("denied", CONDITION_READY).get("message") or "")
        return message if "Permission denied" in message else None

    message = world.wait(explained, 90, "the denied pool's Ready condition naming its worker's error")
    assert "model.safetensors" in message and "cannot read" in message, message
    described = world.kubectl("describe", PLURAL, "denied")
    assert "Permission denied" in described and "BelowMinWarm" in described
    (denied,) = world.wm("denied")["status"]["pods"]
    assert not denied["warm"] and "Permission denied" in denied["message"]
    world.kubectl("delete", PLURAL, "denied", "--wait=false")
    print(f"\ndenied pool, Ready condition: {message}")
