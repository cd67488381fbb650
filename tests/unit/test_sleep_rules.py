"""The sleep and wake rules (#15, operator/warmpool_operator/rules/sleep_wake.py), the API's sleep block,
the awake label in the builders and the scrape of the sleep and request metrics."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from warmpool_operator.api.types import DEFAULT_SLEEP_MIN_AWAKE, InvalidWarmModel, parse_spec
from warmpool_operator.io.worker_metrics import parse_metrics
from warmpool_operator.model import Target
from warmpool_operator.rules import builders
from warmpool_operator.rules import sleep_wake as sleeping
from warmpool_operator.rules.sleep_wake import Candidate, Policy, SleepPod, plan

from warmpool.contract.api import DEFAULT_SLEEP_LEVEL
from warmpool.contract.metrics import (
    METRIC_REQUESTS_IN_FLIGHT,
    METRIC_REQUESTS_TOTAL,
    METRIC_SLEEP_CAPABLE,
    METRIC_SLEEP_LEVEL,
    METRIC_WAKE_DURATION,
)
from warmpool.contract.pods import AWAKE_TRUE, ENGINE_CONTAINER, ENV_VLLM_SERVER_DEV_MODE, LABEL_AWAKE

pytestmark = pytest.mark.unit

ON = Policy(enabled=True, after_idle_seconds=30, min_awake=1, level=1)


def pod(name: str, *, level: int | None = 0, idle: float | None = 100.0, in_flight: float = 0.0,
        labelled: bool = True, busy: bool = False, capable: bool = True, serving: bool = True,
        node: str = "n1") -> SleepPod:
    return SleepPod(uid=name, name=name, node=node, serving=serving, level=level, capable=capable,
                    idle_seconds=idle, in_flight=in_flight, labelled_awake=labelled, busy=busy)


# --------------------------------------------------------------------------- idle sleep


def test_idle_pods_sleep_idlest_first_down_to_min_awake() -> None:
    made = plan([pod("a", idle=40), pod("b", idle=90), pod("c", idle=60)], ON)
    assert [a.uid for a in made.sleep] == ["b", "c"]  # "a" stays: minAwake 1
    assert all(a.why == sleeping.WHY_IDLE and a.drain for a in made.sleep)
    assert not made.wake


def test_a_pod_idle_less_than_after_idle_seconds_stays_awake() -> None:
    assert not plan([pod("a", idle=10), pod("b", idle=29.9)], ON).sleep


def test_never_sleeps_an_engine_that_cannot_or_a_pod_without_a_request_counter() -> None:
    made = plan([pod("a", capable=False), pod("b", idle=None), pod("c", idle=5)], ON)
    assert not made.sleep


def test_busy_or_in_flight_pods_do_not_sleep() -> None:
    assert not plan([pod("a", busy=True), pod("b", in_flight=1), pod("c", idle=1)], ON).sleep


def test_without_an_idle_timeout_nothing_sleeps_for_idleness() -> None:
    assert not plan([pod("a"), pod("b")], replace(ON, after_idle_seconds=None)).sleep


def test_min_awake_zero_lets_the_last_pod_sleep_without_leaving_the_service() -> None:
    made = plan([pod("a"), pod("b", level=1, labelled=False)], replace(ON, min_awake=0))
    assert [(a.uid, a.drain) for a in made.sleep] == [("a", False)]
    # No pod left awake: the sleeping one goes back into the Service, so requests find a pod to wake.
    assert made.relabel == {"b": True}


def test_routing_follows_sleep() -> None:
    made = plan([pod("a"), pod("b", level=1, labelled=True), pod("c", level=0, labelled=False)],
                replace(ON, after_idle_seconds=None))
    assert made.relabel == {"b": False, "c": True}  # c woke itself (a request reached it)


def test_pods_not_serving_or_without_a_level_are_left_alone() -> None:
    made = plan([pod("a", serving=False, level=1), pod("b", level=None, labelled=False), pod("c")], ON)
    assert not made.sleep and not made.wake and not made.relabel


# --------------------------------------------------------------------------- wake


def test_growth_wakes_as_many_sleeping_pods_as_it_grew_level_one_first() -> None:
    pods = [pod("a"), pod("b", level=2, labelled=False), pod("c", level=1, labelled=False),
            pod("d", level=1, labelled=False)]
    made = plan(pods, ON, grew_by=2)
    assert [a.uid for a in made.wake] == ["c", "d"]
    assert all(a.why == sleeping.WHY_GREW for a in made.wake)
    assert not made.sleep  # a pass that wakes puts none to sleep


def test_growth_beyond_the_sleeping_reserve_wakes_them_all() -> None:
    made = plan([pod("a"), pod("b", level=1, labelled=False)], ON, grew_by=3)
    assert [a.uid for a in made.wake] == ["b"]


def test_queueing_wakes_one_more_pod() -> None:
    pods = [pod("a", in_flight=2, busy=True), pod("b", level=1, labelled=False), pod("c", level=1, labelled=False)]
    made = plan(pods, ON)
    assert [(a.uid, a.why) for a in made.wake] == [("b", sleeping.WHY_DEMAND)]
    # One request per awake pod is not queueing.
    assert not plan([pod("a", in_flight=1, busy=True), pod("b", level=1, labelled=False)], ON).wake


def test_below_min_awake_wakes_the_difference() -> None:
    pods = [pod("a", level=1, labelled=False), pod("b", level=1, labelled=False), pod("c", level=1, labelled=False)]
    made = plan(pods, replace(ON, min_awake=2))
    assert [(a.uid, a.why) for a in made.wake] == [("a", sleeping.WHY_MIN_AWAKE), ("b", sleeping.WHY_MIN_AWAKE)]


def test_a_pod_whose_state_is_unknown_counts_awake_for_min_awake() -> None:
    # The awake pod's scrape failed this pass: no reason to wake the sleeping one.
    made = plan([pod("a", level=None), pod("b", level=1, labelled=False)], ON)
    assert not made.wake and not made.sleep and not made.relabel
    # Unknown pods are never put to sleep, nor do they count toward the sleep budget.
    assert not plan([pod("a", level=None), pod("b")], ON).sleep


def test_sleep_turned_off_wakes_every_sleeping_pod() -> None:
    made = plan([pod("a"), pod("b", level=1, labelled=False), pod("c", level=2, labelled=False)],
                Policy(enabled=False))
    assert sorted(a.uid for a in made.wake) == ["b", "c"]
    assert not made.sleep


# --------------------------------------------------------------------------- memory pressure


def test_pressure_sleeps_the_picked_pod_before_its_idle_timeout_but_keeps_min_awake() -> None:
    made = plan([pod("a", idle=5), pod("b", idle=3)], ON, pressure_picks={"b"})
    assert [(a.uid, a.why) for a in made.sleep] == [("b", sleeping.WHY_PRESSURE)]
    assert not plan([pod("a", idle=5)], ON, pressure_picks={"a"}).sleep  # minAwake 1
    assert not plan([pod("a", busy=True), pod("b", idle=3)], ON, pressure_picks={"a"}).sleep  # busy: keeps serving


def test_pressure_picks_the_idlest_pod_of_any_pool_on_each_paused_node() -> None:
    cands = [
        Candidate(("ns", "busy"), "b1", "n1", last_active=100.0),
        Candidate(("ns", "idle"), "i1", "n1", last_active=10.0),
        Candidate(("ns", "idle"), "i2", "n2", last_active=5.0),
        Candidate(("ns", "other"), "o1", "n3", last_active=1.0),
    ]
    picks = sleeping.pressure_picks(cands, paused_nodes={"n1", "n2"})
    assert {node: c.uid for node, c in picks.items()} == {"n1": "i1", "n2": "i2"}  # n3 is not paused


# --------------------------------------------------------------------------- activity, figures


def test_activity_moves_only_with_the_counter_or_requests_in_flight() -> None:
    first, busy = sleeping.observe_activity(None, 3.0, 0.0, now=100.0)
    assert first.last_active == 100.0 and not busy  # first sight: idle from now (a restart forgets)
    same, busy = sleeping.observe_activity(first, 3.0, 0.0, now=110.0)
    assert same.last_active == 100.0 and not busy
    moved, busy = sleeping.observe_activity(same, 4.0, 0.0, now=120.0)
    assert moved.last_active == 120.0 and busy
    held, busy = sleeping.observe_activity(moved, 4.0, 1.0, now=130.0)
    assert held.last_active == 130.0 and busy
    restarted, busy = sleeping.observe_activity(held, 0.0, 0.0, now=140.0)  # the worker restarted
    assert restarted.last_active == 140.0 and busy


def test_wake_quantiles_from_merged_histograms() -> None:
    one = {0.1: 1.0, 0.25: 3.0, 0.5: 4.0, math.inf: 4.0}
    two = {0.1: 0.0, 0.25: 2.0, 0.5: 4.0, math.inf: 4.0}
    merged = sleeping.merge_buckets([one, two])
    assert merged == {0.1: 1.0, 0.25: 5.0, 0.5: 8.0, math.inf: 8.0}
    assert sleeping.quantile(merged, 0.5) == pytest.approx(0.1 + 0.15 * (4 - 1) / 4)
    assert sleeping.quantile(merged, 0.95) == pytest.approx(0.25 + 0.25 * (7.6 - 5) / 3)
    assert sleeping.quantile({0.1: 0.0, math.inf: 0.0}, 0.5) is None
    assert sleeping.quantile({0.1: 0.0, math.inf: 2.0}, 0.5) == 0.1  # beyond the last bound: that bound


def test_scrape_reads_the_sleep_and_request_metrics() -> None:
    text = (
        f"# TYPE {METRIC_SLEEP_LEVEL} gauge\n{METRIC_SLEEP_LEVEL} 2.0\n"
        f"# TYPE {METRIC_SLEEP_CAPABLE} gauge\n{METRIC_SLEEP_CAPABLE} 1.0\n"
        f"# TYPE warmpool_requests counter\n{METRIC_REQUESTS_TOTAL} 7.0\n"
        f"# TYPE {METRIC_REQUESTS_IN_FLIGHT} gauge\n{METRIC_REQUESTS_IN_FLIGHT} 1.0\n"
        f"# TYPE {METRIC_WAKE_DURATION} histogram\n"
        f'{METRIC_WAKE_DURATION}_bucket{{le="0.5"}} 1.0\n'
        f'{METRIC_WAKE_DURATION}_bucket{{le="+Inf"}} 2.0\n'
        f"{METRIC_WAKE_DURATION}_count 2.0\n{METRIC_WAKE_DURATION}_sum 1.2\n"
    )
    sample = parse_metrics(text)
    assert sample.ok
    assert (sample.sleep_level, sample.sleep_capable, sample.requests_total, sample.requests_in_flight) == (
        2, True, 7.0, 1.0)
    assert sample.wake_buckets == {0.5: 1.0, math.inf: 2.0}


# --------------------------------------------------------------------------- API and builders


def spec(**pool: Any) -> dict[str, Any]:
    return {"model": {"hostPath": {"path": "/models/tiny"}},
            "pool": {"replicas": 2, "maxReplicas": 4, **pool}}


def test_sleep_block_defaults_and_bounds() -> None:
    parsed = parse_spec(spec(sleep={}))
    assert parsed.pool.sleep is not None
    assert (parsed.pool.sleep.after_idle_seconds, parsed.pool.sleep.min_awake, parsed.pool.sleep.level) == (
        None, DEFAULT_SLEEP_MIN_AWAKE, DEFAULT_SLEEP_LEVEL)
    assert parse_spec(spec()).pool.sleep is None
    with pytest.raises(InvalidWarmModel, match=r"spec\.pool\.sleep\.level"):
        parse_spec(spec(sleep={"level": 3}))
    with pytest.raises(InvalidWarmModel, match="minAwake must not exceed"):
        parse_spec(spec(sleep={"minAwake": 5}))
    with pytest.raises(InvalidWarmModel, match="afterIdleSeconds"):
        parse_spec(spec(sleep={"afterIdleSeconds": 0}))


def _target(raw: dict[str, Any]) -> Target:
    return Target(name="tiny", namespace="ns", spec=parse_spec(raw))


def test_the_service_selects_awake_pods_and_the_deployment_selector_does_not() -> None:
    target = _target(spec())
    service = builders.build_service(target)
    dep = builders.build_deployment(target)
    assert service["spec"]["selector"][LABEL_AWAKE] == AWAKE_TRUE
    assert LABEL_AWAKE not in dep["spec"]["selector"]["matchLabels"]
    assert dep["spec"]["template"]["metadata"]["labels"][LABEL_AWAKE] == AWAKE_TRUE
    pdb = builders.build_pdb(target)
    assert LABEL_AWAKE not in pdb["spec"]["selector"]["matchLabels"]  # sleeping pods still count


def test_a_sidecar_pool_with_sleep_runs_vllm_in_dev_mode() -> None:
    raw = {**spec(sleep={"afterIdleSeconds": 60}), "engine": {"kind": "sidecar", "image": "vllm/vllm-openai:v0.11"}}

    def engine_env(raw: dict[str, Any]) -> list[dict[str, Any]]:
        containers = builders.build_deployment(_target(raw))["spec"]["template"]["spec"]["containers"]
        env: list[dict[str, Any]] = next(c for c in containers if c["name"] == ENGINE_CONTAINER)["env"]
        return env

    assert {"name": ENV_VLLM_SERVER_DEV_MODE, "value": "1"} in engine_env(raw)
    without = {**raw, "pool": {"replicas": 2, "maxReplicas": 4}}
    assert all(e["name"] != ENV_VLLM_SERVER_DEV_MODE for e in engine_env(without))
    mine = {**raw, "engine": {**raw["engine"], "env": [{"name": ENV_VLLM_SERVER_DEV_MODE, "value": "0"}]}}
    assert [e for e in engine_env(mine) if e["name"] == ENV_VLLM_SERVER_DEV_MODE] == [
        {"name": ENV_VLLM_SERVER_DEV_MODE, "value": "0"}]  # the user's own value stands
