"""The reconcile pass (control/reconciler.py), over the in-memory API server and against a real one
(the control_cluster fixture): the watches and controllers are played by the test, the worker pods
by what their /metrics would say (FakeWorkers), and the clock is moved by hand.  The pass's own
code runs unchanged."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Mapping
from typing import Any

import pytest
from kopf._core.engines import posting
from warmpool_operator.control import reconciler as reconciling
from warmpool_operator.control.forecasting import Predicted
from warmpool_operator.control.reconciler import Permanent, Reconciler
from warmpool_operator.control.shared import Shared
from warmpool_operator.io.scrape_scheduler import ScrapeScheduler
from warmpool_operator.model import Obj
from warmpool_operator.rules import builders, zero
from warmpool_operator.rules import status as st
from warmpool_operator.rules.observation import PodObservation
from warmpool_operator.settings import OperatorConfig

from tests.support.control_doubles import Clock, ControlCluster, FakeWorkers, Worker, capture_events
from warmpool.contract.api import (
    CONDITION_DEGRADED,
    CONDITION_PROGRESSING,
    CONDITION_TYPES,
    CONDITION_WARMUP_GATED,
    KIND,
    PLURAL,
)
from warmpool.contract.http import (
    CONTROL_FIELD_SLEEP_LEVEL,
    CONTROL_FIELD_TIER,
    PATH_CONTROL_SLEEP,
    PATH_CONTROL_TIER,
    PATH_CONTROL_WAKE,
)
from warmpool.contract.pods import (
    ANNOTATION_POD_DELETION_COST,
    ANNOTATION_TIER,
    AWAKE_FALSE,
    AWAKE_TRUE,
    CONTROL_SECRET_KEY,
    LABEL_AWAKE,
)
from warmpool.contract.zero import held_annotation, held_value
from warmpool.kube import KubeError

IPS = ["10.0.0.1", "10.0.0.2"]


def spec(**pool: Any) -> dict[str, Any]:
    return {"model": {"hostPath": {"path": "/models/m"}}, "pool": {"replicas": 2, "minWarm": 1, **pool}}


class World:
    """One WarmModel, its reconciler, and everything around it: the real API server, the rest
    played at the boundaries."""

    def __init__(self, cluster: ControlCluster) -> None:
        self.cluster = cluster
        self.kube = cluster.kube
        self.ns = cluster.namespace

    async def make(self, pool: Mapping[str, Any] | None = None, config: OperatorConfig | None = None) -> World:
        """The WarmModel and its reconciler (called inside the test's coroutine: its context is the operator's)."""
        self.events = capture_events()
        self.clock = Clock()
        self.workers = FakeWorkers(self.clock)
        scheduler = ScrapeScheduler(self.workers, interval=1.0, concurrency=4)
        self.shared = Shared(self.kube, self.workers, scheduler, config or OperatorConfig(scrape_interval=1.0),
                             monotonic=self.clock, wall=self.clock)
        self.body = await self.cluster.warmmodel("m", spec(**(pool or {})))
        self.rec = Reconciler(self.body, self.shared, self.cluster.cache)
        return self

    async def run(self, prompted: bool = True) -> None:
        """One pass, then the watches catch up with what it wrote."""
        await self.rec.sync(prompted=prompted)
        await self.cluster.watch()

    async def start_pods(self, ratios: Mapping[str, float | None] | None = None) -> list[Obj]:
        for ip in IPS:
            self.workers.pods[ip] = Worker(used_ratio=(ratios or {}).get(ip, 0.5))
        return await self.cluster.run_pods("m", IPS)

    async def status(self) -> dict[str, Any]:
        found = await self.kube.get_obj(PLURAL, self.ns, "m")
        assert found is not None
        return dict(found.get("status") or {})

    async def conditions(self) -> dict[str, dict[str, Any]]:
        return {c["type"]: c for c in (await self.status()).get("conditions") or []}

    async def pod(self, index: int) -> Obj:
        found = await self.kube.get_obj("pods", self.ns, f"m-{index}")
        assert found is not None
        return found


@pytest.fixture()
def world(control_cluster: ControlCluster) -> World:
    return World(control_cluster)


async def test_a_first_pass_makes_every_child_owned_by_the_warmmodel_and_writes_status(world: World) -> None:
    await world.make()
    await world.run()
    for plural, name in (("secrets", builders.control_secret_name("m")), ("configmaps", builders.configmap_name("m")),
                         ("services", "m"),
                         ("poddisruptionbudgets", "m"), ("deployments", "m")):
        child = await world.kube.get_obj(plural, world.ns, name)
        assert child is not None, f"{plural}/{name} not made"
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == world.body["metadata"]["uid"] and owner["kind"] == KIND
    deployment = await world.kube.get_obj("deployments", world.ns, "m")
    assert deployment is not None and deployment["spec"]["replicas"] == 2
    assert set(await world.conditions()) == set(CONDITION_TYPES)
    assert (await world.conditions())[CONDITION_PROGRESSING]["reason"] == st.REASON_ROLLING_OUT
    # A second pass over what the watch shows writes nothing: every child is settled.
    writes = len(world.kube.writes())
    await world.run()
    assert len(world.kube.writes()) == writes, [c for c in world.kube.writes()][writes:]


async def test_tiers_are_decided_on_new_samples_sent_with_the_token_and_annotated(world: World) -> None:
    await world.make()
    events = world.events
    await world.run()
    await world.start_pods({IPS[0]: 0.75, IPS[1]: 0.2})
    # Both pods run on one node: the node's level is the fuller pod's, and a pod's directive the stricter.
    await world.run()
    directives = world.workers.sent(PATH_CONTROL_TIER)
    assert {(d.ip, d.body[CONTROL_FIELD_TIER]) for d in directives} == {
        (IPS[0], "truncated"), (IPS[1], "truncated")}
    assert {d.token for d in directives} == {world.rec.memory.children.token} and directives[0].token
    assert (await world.pod(0))["metadata"]["annotations"][ANNOTATION_TIER] == "truncated"
    assert int((await world.pod(0))["metadata"]["annotations"][ANNOTATION_POD_DELETION_COST]) >= 1000
    assert events.reasons().count("TierChanged") == 4  # each on the WarmModel and on its pod
    assert (await world.status())["tierCounts"]["truncated"] == 2 and (await world.status())["warmReplicas"] == 2

    # A pass without a new sample keeps the decisions and sends nothing.
    await world.run()
    assert len(world.workers.sent(PATH_CONTROL_TIER)) == 2
    # A round of samples: decided again (70/90 with hysteresis: 0.87 stays below paused's entry).
    world.workers.pods[IPS[0]].used_ratio = 0.87
    await world.rec.scrape_round()
    await world.run()
    tiers = [d.body[CONTROL_FIELD_TIER] for d in world.workers.sent(PATH_CONTROL_TIER)[2:]]
    assert tiers == ["truncated", "truncated"]
    world.workers.pods[IPS[0]].used_ratio = 0.95
    await world.rec.scrape_round()
    await world.run()
    assert (await world.pod(1))["metadata"]["annotations"][ANNOTATION_TIER] == "paused"
    assert (await world.conditions())[CONDITION_WARMUP_GATED]["reason"] == st.REASON_MEMORY_PRESSURE


async def test_an_edited_control_secret_gets_the_operators_token_back_once_a_worker_refuses(world: World) -> None:
    await world.make()
    await world.run()
    await world.start_pods()
    await world.run()
    first = world.rec.memory.children.token
    assert first and {d.token for d in world.workers.sent(PATH_CONTROL_TIER)} == {first}
    # Someone edits the Secret; the workers read the new token from their mount and refuse ours.
    name = builders.control_secret_name("m")
    secret = await world.kube.get_obj("secrets", world.ns, name)
    assert secret is not None
    edited = base64.b64encode(b"edited-" + b"x" * 40).decode()
    await world.kube.put("secrets", {**secret, "data": {CONTROL_SECRET_KEY: edited}})
    world.workers.refuse[PATH_CONTROL_TIER] = "http 403: control token refused"
    await world.rec.scrape_round()
    await world.run()
    assert world.rec.memory.children.token == ""  # forgotten: the next pass writes it again
    await world.run()
    # Our token is back in the Secret (the workers' mounts follow), never having been read.
    restored = await world.kube.get_obj("secrets", world.ns, name)
    assert restored is not None
    assert base64.b64decode(restored["data"][CONTROL_SECRET_KEY]).decode() == first
    assert world.rec.memory.children.token == first
    del world.workers.refuse[PATH_CONTROL_TIER]
    await world.rec.scrape_round()
    await world.run()
    assert world.workers.sent(PATH_CONTROL_TIER)[-1].token == first
    assert all(c.method != "GET" for c in world.kube.calls if c.plural == "secrets")


async def test_an_unreadable_pod_is_unknown_gets_no_directive_and_never_grows_the_pool(world: World) -> None:
    await world.make()
    await world.run()
    await world.start_pods({IPS[0]: 0.5})
    del world.workers.pods[IPS[1]]  # its /metrics never answers
    await world.run()
    assert {d.ip for d in world.workers.sent(PATH_CONTROL_TIER)} == {IPS[0]}
    assert (await world.status())["tierCounts"]["unknown"] == 1
    deployment = await world.kube.get_obj("deployments", world.ns, "m")
    assert deployment is not None and deployment["spec"]["replicas"] == 2


async def test_a_name_held_by_someone_else_is_a_permanent_conflict_and_left_untouched(world: World) -> None:
    await world.make()
    theirs = await world.kube.put("services", {"apiVersion": "v1", "kind": "Service",
                                               "metadata": {"name": "m", "namespace": world.ns},
                                               "spec": {"ports": [{"name": "theirs", "port": 80}]}})
    with pytest.raises(Permanent) as raised:
        await world.run()
    assert raised.value.degradation.reason == st.REASON_CHILD_CONFLICT
    assert await world.kube.get_obj("services", world.ns, "m") == theirs
    assert (await world.conditions())[CONDITION_DEGRADED]["reason"] == st.REASON_CHILD_CONFLICT
    # The Deployment is still made: only the Secret and ConfigMap are mounted by its pods.
    assert await world.kube.get_obj("deployments", world.ns, "m") is not None


async def test_a_refused_child_waits_out_the_retry_interval_unless_a_handler_asks(world: World) -> None:
    await world.make(config=OperatorConfig(scrape_interval=1.0, permanent_retry_interval=300.0))
    world.kube.faults[("POST", "deployments")] = KubeError(422, "Invalid", "spec.template: requests above limits")
    with pytest.raises(Permanent) as raised:
        await world.run(prompted=False)
    assert raised.value.degradation.reason == st.REASON_CHILD_REJECTED
    calls = len(world.kube.calls)
    world.kube.faults[("POST", "deployments")] = KubeError(422, "Invalid", "still refused")
    world.clock.advance(60)
    await world.run(prompted=False)  # waiting out: no call at all
    assert len(world.kube.calls) == calls
    world.clock.advance(300)
    with pytest.raises(Permanent):
        await world.run(prompted=False)  # the slow retry
    assert len(world.kube.calls) > calls
    await world.run(prompted=True)  # the fault is gone; a handler's pass is never held back
    assert await world.kube.get_obj("deployments", world.ns, "m") is not None


async def test_a_host_path_outside_the_allowed_prefixes_makes_no_child(world: World) -> None:
    await world.make(config=OperatorConfig(allowed_host_paths=("/elsewhere",)))
    with pytest.raises(Permanent) as raised:
        await world.run()
    assert raised.value.degradation.reason == st.REASON_HOST_PATH_NOT_ALLOWED
    assert [c.plural for c in world.kube.writes()] == [PLURAL]  # the status, nothing else


class FixedForecast:
    """Stands in for demand prediction: this pass's forecast asks for ``wanted`` awake pods."""

    def __init__(self, wanted: int) -> None:
        self.wanted = wanted
        self.passes = 0

    def step(self, spec: Any, owner: Any, observations: list[PodObservation], cold_p95: float | None,
             at_zero: bool = False) -> Predicted:
        self.passes += 1
        return Predicted(wanted=self.wanted, hold_s=60.0)

    async def stop(self, *, save: bool) -> None:
        return None


async def _settle(world: World) -> None:
    """Let the sleeps and wakes the pass started finish (they run as tasks of their own)."""
    pending = list(world.rec.memory.sleep.pending.values())
    if pending:
        await asyncio.gather(*pending)


async def test_idle_pods_sleep_by_this_passes_forecast_not_the_last_ones(world: World) -> None:
    await world.make(pool={"sleep": {"afterIdleSeconds": 30, "minAwake": 0}})
    events = world.events
    await world.run()
    await world.start_pods()
    await world.run()  # first sight: idleness starts counting now
    world.clock.advance(120)
    await world.rec.scrape_round()
    # The same pass's forecast asks for both pods awake: neither sleeps (with the previous pass's
    # forecast, none yet, both would).
    world.rec.forecast = FixedForecast(wanted=2)  # type: ignore[assignment]
    await world.run()
    await _settle(world)
    assert world.workers.sent(PATH_CONTROL_SLEEP) == []
    # This pass's forecast wants one: the other, idle, is labelled out of the Service and put to sleep.
    world.rec.forecast = FixedForecast(wanted=1)  # type: ignore[assignment]
    await world.rec.scrape_round()
    await world.run()
    await _settle(world)
    (slept,) = world.workers.sent(PATH_CONTROL_SLEEP)
    assert slept.body == {CONTROL_FIELD_SLEEP_LEVEL: 1}
    index = IPS.index(slept.ip)
    assert (await world.pod(index))["metadata"]["labels"][LABEL_AWAKE] == AWAKE_FALSE
    assert {"PodSleeping", "PodAsleep"} <= set(events.reasons())
    # A forecast for both again wakes it before any new pod is asked for.
    world.rec.forecast = FixedForecast(wanted=2)  # type: ignore[assignment]
    await world.rec.scrape_round()
    await world.run()
    await _settle(world)
    assert [w.ip for w in world.workers.sent(PATH_CONTROL_WAKE)] == [slept.ip]
    assert (await world.pod(index))["metadata"]["labels"][LABEL_AWAKE] == AWAKE_TRUE


async def test_a_pod_event_wakes_a_pass_only_when_it_changes_what_a_pass_reads(world: World) -> None:
    await world.make()
    await world.run()
    (pod, _) = await world.start_pods()
    assert world.rec.saw_pod(None, pod)
    assert not world.rec.saw_pod("MODIFIED", pod)
    annotated = {**pod, "metadata": {**pod["metadata"], "annotations": {ANNOTATION_TIER: "full"}}}
    assert not world.rec.saw_pod("MODIFIED", annotated)  # our own annotation: nothing to read
    unready = {**pod, "status": {**pod["status"], "conditions": [{"type": "Ready", "status": "False"}]}}
    assert world.rec.saw_pod("MODIFIED", unready)
    assert world.rec.saw_pod("DELETED", unready) and world.rec.saw_pod(None, unready)


async def test_the_status_is_written_only_when_it_changed_and_a_deleted_warmmodel_ends_quietly(world: World) -> None:
    await world.make()
    await world.run()
    status_writes = len(world.kube.writes(PLURAL))
    await world.run()
    assert len(world.kube.writes(PLURAL)) == status_writes
    # Deleted while the pass ran: its status write is a 404, and the pass ends without an error.
    await world.kube.delete_obj(PLURAL, world.ns, "m")
    world.rec.body["metadata"]["generation"] = 2
    await world.run()
    assert len(world.kube.writes(PLURAL)) == status_writes + 1


async def test_a_pool_with_no_pod_to_scrape_asks_for_a_pass_every_few_rounds_one_with_pods_every_round(
        world: World) -> None:
    # The pass loop is not started here: whether a round asked for a pass is its wake-up flag.
    await world.make()
    await world.run()  # the children, no pods yet: nothing to scrape
    asked = []
    for _ in range(3 * reconciling.QUIET_ROUNDS_PER_PASS):
        await world.rec.scrape_round()
        asked.append(world.rec._wake.is_set())
        world.rec._wake.clear()
    passes = [i for i, wanted in enumerate(asked) if wanted]
    assert len(passes) == 3 and passes[1] - passes[0] == passes[2] - passes[1] == reconciling.QUIET_ROUNDS_PER_PASS
    await world.start_pods()
    await world.run()  # the pods Running with an IP: scraped each round, and each round decides
    for _ in range(3):
        await world.rec.scrape_round()
        assert world.rec._wake.is_set()
        world.rec._wake.clear()


async def test_a_bad_held_annotation_is_not_counted_the_pass_completes_and_one_warning_names_it(world: World) -> None:
    """A count of "\u00b2" passes str.isdigit() and int() then raised: one such annotation failed every pass."""
    await world.make(pool={"scaleToZero": {"afterIdleSeconds": 600, "holdTimeoutSeconds": 60}})
    await world.run()
    stored = await world.kube.get_obj(PLURAL, world.ns, "m")
    assert stored is not None
    bad, good = held_annotation("x"), held_annotation("activator-0")
    meta = {**stored["metadata"], "annotations": {bad: "\u00b2 1", good: held_value(3, world.clock())}}
    world.rec.body = await world.kube.put(PLURAL, {**stored, "metadata": meta})  # as the registry's watch does
    await world.run()
    assert (await world.status()).get("held") == 3  # the good one counted
    assert [(e.type, bad in e.message, "ASCII digits" in e.message) for e in _held_ignored(world)] == [
        ("Warning", True, True)]
    # Once per distinct value, not every pass.
    await world.run()
    assert len(_held_ignored(world)) == 1


def _held_ignored(world: World) -> list[posting.K8sEvent]:
    world.events.reasons()  # drains kopf's queue into .seen
    return [e for e in world.events.seen if e.reason == zero.REASON_HELD_IGNORED]
