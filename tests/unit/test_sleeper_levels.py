"""The sleep level the operator remembers for a pod, across its own sleeps and wakes (#15).

A scrape sent before our wake finished still shows the pod asleep; the first one after it shows
it awake.  Read in that order, the two looked like a pod that woke itself for a request (a false
``PodWokeOnRequest`` Event, seen in CI).  These drive :func:`sleeper.act` directly, with the
Events recorded instead of posted."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from warmpool_operator.api.types import parse_spec
from warmpool_operator.control import sleep_actions as sleeper
from warmpool_operator.model import Sample, Target
from warmpool_operator.rules import gating

from warmpool.contract.pods import AWAKE_FALSE, AWAKE_TRUE, LABEL_AWAKE

pytestmark = pytest.mark.unit

SPEC = parse_spec({
    "model": {"hostPath": {"path": "/models/m"}},
    "pool": {"replicas": 2, "sleep": {"afterIdleSeconds": 3600, "minAwake": 1}},
})
AWAKE = gating.PodRef(uid="a", name="pod-a", node="n", ip="127.0.0.1")
SUBJECT = gating.PodRef(uid="b", name="pod-b", node="n", ip="127.0.0.1")


class LabelWrites:
    """Stands in for the Kube client: the only call a pass may make is a label patch."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, Any]] = []

    async def patch(self, resource: Any, namespace: str, name: str, body: Any) -> None:
        self.patches.append((name, body))


def _pod(ref: gating.PodRef, awake: bool) -> dict[str, Any]:
    label = AWAKE_TRUE if awake else AWAKE_FALSE
    return {"metadata": {"name": ref.name, "uid": ref.uid, "labels": {LABEL_AWAKE: label}}}


def _sample(level: int, sent_at: float) -> Sample:
    return Sample(ready=True, sleep_level=level, sleep_capable=True, requests_total=5.0,
                  requests_in_flight=0.0, sent_at=sent_at)


async def _pass(state: sleeper.SleepState, reasons: list[str], subject_level: int, sent_at: float,
                subject_labelled_awake: bool) -> None:
    ctx = sleeper.Context(kube=LabelWrites(), workers=None, body={},  # type: ignore[arg-type]
                          target=Target("m", "ns", SPEC), token="", refresh=lambda uid: None)
    pods = {"a": _pod(AWAKE, True), "b": _pod(SUBJECT, subject_labelled_awake)}
    samples = {"a": _sample(0, sent_at), "b": _sample(subject_level, sent_at)}
    await sleeper.act(ctx, state, sleeper.PressureBoard(), [AWAKE, SUBJECT], pods, samples, {},
                      {"a": True, "b": True})


@pytest.fixture()
def reasons(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(sleeper, "_event", lambda ctx, pod, reason, message, warning=False: seen.append(reason))
    return seen


async def test_a_scrape_from_before_our_wake_does_not_read_as_a_self_wake(reasons: list[str]) -> None:
    state = sleeper.SleepState(last_want=2)
    # Our wake of pod-b has answered (wake_pod recorded level 0) and is writing the label back.
    state.levels["b"] = 0
    unfinished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    state.pending["b"] = asyncio.ensure_future(unfinished)
    await _pass(state, reasons, subject_level=1, sent_at=time.monotonic() - 1, subject_labelled_awake=False)
    assert state.levels["b"] == 0, "a sample from before the wake overwrote the level the wake recorded"

    # The wake finishes; the next scrape, sent after it, shows the pod awake.
    unfinished.set_result(None)
    await asyncio.sleep(0)
    state.pending.clear()
    state.acted_at["b"] = time.monotonic()
    await _pass(state, reasons, subject_level=0, sent_at=time.monotonic() + 1, subject_labelled_awake=True)
    assert sleeper.REASON_WOKE_ON_REQUEST not in reasons
    assert state.levels["b"] == 0


async def test_a_pod_we_saw_asleep_then_awake_woke_itself(reasons: list[str]) -> None:
    state = sleeper.SleepState(last_want=2)
    await _pass(state, reasons, subject_level=1, sent_at=time.monotonic(), subject_labelled_awake=False)
    assert state.levels["b"] == 1 and reasons == []
    await _pass(state, reasons, subject_level=0, sent_at=time.monotonic(), subject_labelled_awake=False)
    assert reasons == [sleeper.REASON_WOKE_ON_REQUEST]
