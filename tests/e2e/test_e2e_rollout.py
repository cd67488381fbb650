"""Revisions: a rollout keeps minWarm verified-warm pods throughout, even with the operator
killed and restarted half-way; a revision with corrupt weights stalls with a clear
condition while the old pods keep serving.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.support.e2e import World, corrupt_copy, pod_ready, tiny_model, warmmodel
from warmpool.contract.api import CONDITION_PROGRESSING, CONDITION_READY
from warmpool.contract.http import STAGE_READY
from warmpool.contract.pods import ANNOTATION_REVISION, LABEL_MODEL


class WarmWatch:
    """Counts verified-warm pods (Ready by the kubelet and /readyz 200 from the worker)
    in a background thread, as often as the machine allows, until stopped.

    A /readyz that does not answer within its 3 s (a loaded 2-core machine during a rollout) says
    nothing either way: that sample is set aside as unanswered, not counted as a cold pod."""

    def __init__(self, world: World, name: str) -> None:
        self.world = world
        self.name = name
        self.samples: list[tuple[float, int]] = []
        self.errors: list[str] = []
        self.unanswered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WarmWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.is_set() and time.monotonic() - started < 600:
            try:
                warm, answered = self._count(self.world.pods(self.name))
                if answered:
                    self.samples.append((time.monotonic() - started, warm))
                else:
                    self.unanswered += 1
            except Exception as error:  # a failed kubectl call is not a cold pool; note it
                self.errors.append(repr(error)[:300])
            self._stop.wait(0.3)

    def _count(self, pods: list[dict[str, Any]]) -> tuple[int, bool]:
        """(verified-warm pods, whether every kubelet-Ready pod's worker answered /readyz)."""
        warm, answered = 0, True
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp") or not pod_ready(pod):
                continue
            code, body = self.world.readyz(pod)
            answered &= code != 0
            warm += code == 200 and body.get("stage") == STAGE_READY
        return warm, answered

    @property
    def minimum(self) -> int:
        return min(count for _, count in self.samples)


def revisions(world: World, name: str) -> list[str]:
    return sorted((p["metadata"].get("annotations") or {}).get(ANNOTATION_REVISION, "")
                  for p in world.pods(name))


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_rollout_keeps_min_warm_through_an_operator_crash(world: World) -> None:
    model = tiny_model()
    world.apply(warmmodel("roll", model, revision="r1", replicas=2, min_warm=2, max_replicas=3))
    world.wait_ready("roll", warm=2, timeout=150)
    first_uids = {p["metadata"]["uid"] for p in world.pods("roll")}

    with WarmWatch(world, "roll") as watch:
        world.wait(lambda: len(watch.samples) >= 3, 30, "the warm watch running")
        world.apply(warmmodel("roll", model, revision="r2", replicas=2, min_warm=2, max_replicas=3))
        # Half-way: the first pod of r2 exists.  Kill the operator (SIGKILL), leave it dead a
        # while (the Deployment carries on), then start it again.
        world.wait(lambda: "r2" in revisions(world, "roll"), 60, "the first pod of revision r2")
        world.operator.kill()
        time.sleep(5)
        world.operator.start()

        def rolled() -> dict[str, Any] | None:
            wm = world.wait_ready("roll", warm=2, timeout=5)
            pods = world.pods("roll", include_terminating=True)
            progressing = {c["type"]: c for c in wm["status"]["conditions"]}[CONDITION_PROGRESSING]
            done = (revisions(world, "roll") == ["r2", "r2"] and len(pods) == 2
                    and progressing["reason"] == "Stable")
            return wm if done else None

        wm = world.wait(rolled, 240, "revision r2 rolled out, 2 warm, Progressing Stable")
    print(f"\nrollout r1 -> r2: {len(watch.samples)} samples of the warm count, minimum {watch.minimum} "
          f"(minWarm 2); watch errors: {len(watch.errors)}; unanswered /readyz samples: {watch.unanswered}")
    assert len(watch.samples) >= 10, f"too few samples to say anything: {watch.samples} {watch.errors}"
    assert watch.unanswered <= len(watch.samples), "workers left /readyz unanswered more often than not"
    dips = [(round(t, 1), n) for t, n in watch.samples if n < 2]
    assert not dips, f"verified-warm pods fell below minWarm during the rollout at (s, warm): {dips}"
    assert not {p["metadata"]["uid"] for p in world.pods("roll")} & first_uids, "every pod replaced"
    assert wm["status"]["warmReplicas"] == 2 and wm["status"]["observedGeneration"] == wm["metadata"]["generation"]

    # Converged without duplicates: one of each child, the old ReplicaSet scaled to zero.
    kids = world.children("roll")
    assert {k: v for k, v in kids.items() if k != "replicasets"} == {
        "deployments": ["roll"], "services": ["roll"], "configmaps": ["roll-warmup"],
        "secrets": ["roll-control"], "poddisruptionbudgets": ["roll"]}, kids
    active = [rs["metadata"]["name"] for rs in world.get("replicasets", "-l", f"{LABEL_MODEL}=roll")["items"]
              if rs["spec"].get("replicas")]
    assert len(active) == 1, f"one active ReplicaSet after the rollout, got {active}"
    if not world.operator.installed:
        assert world.operator.starts == 2


@pytest.mark.e2e
@pytest.mark.timeout(360)
def test_corrupt_revision_stalls_with_a_clear_condition_and_old_pods_serve(world: World) -> None:
    good = tiny_model()
    bad = corrupt_copy(good, "tiny-llama-4l-corrupt")
    world.apply(warmmodel("weights", good, revision="good", replicas=2, min_warm=2, max_replicas=3))
    world.wait_ready("weights", warm=2, timeout=150)
    old = {p["metadata"]["name"] for p in world.pods("weights")}

    bad_spec = warmmodel("weights", bad, revision="corrupt", replicas=2, min_warm=2, max_replicas=3)
    world.apply(bad_spec)

    def stalled() -> dict[str, Any] | None:
        cond = world.condition("weights", CONDITION_PROGRESSING)
        return cond if cond.get("reason") == "RolloutStalled" and cond.get("status") == "False" else None

    cond = world.wait(stalled, 150, "Progressing=False RolloutStalled for the corrupt revision")
    print(f"\nstalled rollout: {cond['message']}")
    new_pods = [p for p in world.pods("weights") if p["metadata"]["name"] not in old]
    assert new_pods, "the corrupt revision's pod exists"
    assert all(p["metadata"]["name"] in cond["message"] for p in new_pods), cond
    assert "exit code" in cond["message"], cond
    # The worker said why in its log: the weight file is cut short.
    assert any(not p["status"].get("containerStatuses", [{}])[0].get("ready") for p in new_pods)

    # The old pods are still there, warm, and answer; the WarmModel stays Ready.
    wm = world.wm("weights")
    ready = {c["type"]: c for c in wm["status"]["conditions"]}[CONDITION_READY]
    assert ready["status"] == "True", ready
    still = [p for p in world.pods("weights") if p["metadata"]["name"] in old]
    assert len(still) == 2 and all(world.verified_warm(p) for p in still)
    for pod in still:
        assert world.complete(pod, "weights", "hello", max_tokens=3) is not None

    # Fixing the revision recovers: the pool rolls to it and the condition clears.
    world.apply(warmmodel("weights", good, revision="fixed", replicas=2, min_warm=2, max_replicas=3))
    world.wait(lambda: revisions(world, "weights") == ["fixed", "fixed"]
               and world.condition("weights", CONDITION_PROGRESSING).get("reason") == "Stable",
               180, "the fixed revision rolled out")
    world.wait_ready("weights", warm=2, timeout=60)
