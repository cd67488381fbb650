"""The operator reacts to events, not to a timer (issue #14), on the real local control plane.

Each test runs `python -m warmpool operator` with a scrape interval of ten minutes, far longer
than any wait here: whatever the operator does within a test was caused by a watch event (a
pod's Ready condition, a child deleted or edited), never by a scrape round or a periodic pass.
Every wait is bounded; a timeout prints the operator's log, the workers' logs and the status.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import Operator, World, delete_warmmodels, warmmodel
from warmpool.contract.api import CONDITION_READY

pytestmark = pytest.mark.integration

#: Longer than every bounded wait below: no scrape round can explain what the tests see.
LONG_SCRAPE_INTERVAL = "600"
#: Memory measured against a capacity far above what a tiny worker uses: its tier stays full.
STEADY_MEMORY = [f"--memory-capacity-bytes={64 * 1024**3}"]


@pytest.fixture()
def world(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[World]:
    operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False,
                        extra_args=("--scrape-interval", LONG_SCRAPE_INTERVAL))
    operator.start()
    made = World(cluster, namespace, operator, diagnose_timeouts=True)
    try:
        yield made
    finally:
        delete_warmmodels(cluster, namespace)
        operator.stop()
        made.close()


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return {}


def _uid(world: World, kind: str) -> str | None:
    obj = world.maybe(kind, "evkids")
    return None if obj is None else str(obj["metadata"]["uid"])


def test_a_pod_turning_warm_shows_in_status_without_a_scrape_round(world: World, tiny_model: Path) -> None:
    world.apply(warmmodel("evwarm", tiny_model, worker_args=STEADY_MEMORY))
    # At creation no pod is Ready: the first pass writes Ready=False.
    world.wait(lambda: _condition(world.wm("evwarm"), CONDITION_READY).get("status") == "False", 60,
               "the first pass writing Ready=False")
    # The pod warms up; its Ready condition changing is the only event that can move status
    # before the next scrape round, ten minutes away.
    wm = world.wait_ready("evwarm", warm=1, timeout=150)
    ready = _condition(wm, CONDITION_READY)
    pods = world.pods("evwarm")
    assert len(pods) == 1
    pod_ready = next(c for c in pods[0]["status"]["conditions"] if c["type"] == "Ready")
    assert pod_ready["status"] == "True"
    # The WarmModel turned Ready after (or in the same second as) its pod did: that event moved it.
    assert ready["status"] == "True" and ready["lastTransitionTime"] >= pod_ready["lastTransitionTime"], (
        ready, pod_ready)
    assert wm["status"]["warmReplicas"] == 1


def test_a_deleted_or_edited_child_is_restored_by_its_event(world: World, tiny_model: Path) -> None:
    world.apply(warmmodel("evkids", tiny_model, worker_args=STEADY_MEMORY))
    world.wait(lambda: world.maybe("deployment", "evkids") and world.maybe("service", "evkids")
               and world.maybe("pdb", "evkids"), 60, "the children made")
    service_uid = world.get("service", "evkids")["metadata"]["uid"]
    pdb_uid = world.get("pdb", "evkids")["metadata"]["uid"]

    # Deleted: each comes back as a new object.
    world.kubectl("delete", "service", "evkids", "--wait=true")
    world.kubectl("delete", "pdb", "evkids", "--wait=true")
    world.wait(lambda: _uid(world, "service") not in (None, service_uid), 60, "the deleted Service made again")
    world.wait(lambda: _uid(world, "pdb") not in (None, pdb_uid), 60, "the deleted PDB made again")

    # Edited by hand (replicas and the worker's arguments): put back.
    before = world.get("deployment", "evkids")
    container = before["spec"]["template"]["spec"]["containers"][0]
    patch = {"spec": {"replicas": 3, "template": {"spec": {"containers": [
        {"name": container["name"], "args": [*container["args"], "--hand-edit"]}]}}}}
    world.kubectl("patch", "deployment", "evkids", "--type=strategic", "-p", json.dumps(patch))

    def restored() -> bool:
        dep = world.get("deployment", "evkids")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        return bool(dep["spec"]["replicas"] == 1 and "--hand-edit" not in args
                    and dep["metadata"]["generation"] > before["metadata"]["generation"] + 1)

    world.wait(restored, 60, "the hand-edited Deployment put back")
    assert "differs from the spec: applying" in world.operator.log()
