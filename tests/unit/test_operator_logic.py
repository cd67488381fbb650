"""The operator's pure decisions: scrape parsing, per-pod/per-node tiers, deletion cost, status, heat."""

from __future__ import annotations

import json

import pytest
from warmpool_operator.api.types import WarmModelSpec, parse_spec
from warmpool_operator.io import worker_metrics as scrape
from warmpool_operator.model import Sample
from warmpool_operator.rules import gating, heat
from warmpool_operator.rules import status as st
from warmpool_operator.rules.observation import ColdStarts, PodObservation

from warmpool.contract.api import CONDITION_TYPES, Tier
from warmpool.contract.files import HEATMAP_FORMAT
from warmpool.contract.metrics import (
    METRIC_ENGINE_BATCH_FINISHED,
    METRIC_LAYER_HEAT,
    METRIC_LAYERS_RESIDENT,
    METRIC_LAYERS_TOTAL,
    METRIC_MEMORY_USED_RATIO,
    METRIC_MODEL_INFO,
    METRIC_PHASE_DURATION,
    METRIC_READY,
    METRIC_REQUEST_PROMPT_TOKENS,
    METRIC_TIER,
)
from warmpool.tiering import Thresholds

pytestmark = pytest.mark.unit

TH = Thresholds(70, 90, 5)


def body(ratio: float | None, ready: int = 1, extra: str = "") -> str:
    lines = [f"{METRIC_READY} {ready}"]
    if ratio is not None:
        lines.append(f'{METRIC_MEMORY_USED_RATIO}{{source="nvml"}} {ratio}')
    return "\n".join(lines) + "\n" + extra


def sample(ratio: float | None) -> Sample:
    return scrape.parse_metrics(body(ratio))


def test_parse_real_worker_metrics() -> None:
    from warmpool_worker.metrics import WorkerMetrics

    m = WorkerMetrics()
    m.set_memory(750, 1000, "configured")
    m.set_tier(Tier.TRUNCATED, Tier.TRUNCATED, True)
    m.set_ready(True)
    m.set_layers(3, 4)
    m.mark_phase("ready")
    m.set_heat({0: 2.0, 3: 5.0})
    s = scrape.parse_metrics(m.render().decode())
    assert s.ok and s.used_ratio == 0.75 and s.ready and s.tier is Tier.TRUNCATED
    assert s.layers_resident == 3 and s.layers_total == 4
    assert "ready" in s.phase_durations and s.heat == {0: 2.0, 3: 5.0}


@pytest.mark.parametrize(
    "text",
    ["{{{ not prometheus", "", "some_other_metric 1\n", f"{METRIC_READY} abc\n"],
)
def test_garbage_is_an_error_not_zero(text: str) -> None:
    s = scrape.parse_metrics(text)
    assert not s.ok and s.used_ratio is None


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-0.5"])
def test_bad_memory_figures_are_unknown(value: str) -> None:
    s = scrape.parse_metrics(f'{METRIC_READY} 1\n{METRIC_MEMORY_USED_RATIO}{{source="x"}} {value}\n')
    assert s.used_ratio is None
    pod = gating.PodRef("u", "p", "n", "127.0.0.1")
    assert gating.decide([pod], {"u": s}, gating.GateState(), TH)[0].tier is Tier.UNKNOWN


def test_missing_memory_series_is_unknown_never_zero() -> None:
    pod = gating.PodRef("u", "p", "n", "127.0.0.1")
    decisions = gating.decide([pod], {"u": sample(None)}, gating.GateState(), TH)
    assert decisions[0].tier is Tier.UNKNOWN
    assert gating.decide([pod], {}, gating.GateState(), TH)[0].tier is Tier.UNKNOWN


def test_pod_tiers_with_hysteresis() -> None:
    pod = gating.PodRef("u", "p", "n", "127.0.0.1")
    state = gating.GateState()
    path = []
    for ratio in (0.5, 0.75, 0.92, 0.87, 0.84, 0.67, 0.64):
        path.append(gating.decide([pod], {"u": sample(ratio)}, state, TH)[0].tier.value)
    assert path == ["full", "truncated", "paused", "paused", "truncated", "truncated", "full"]


def test_node_level_is_the_max_of_its_pods() -> None:
    a = gating.PodRef("a", "pa", "node-1", "127.0.0.1")
    b = gating.PodRef("b", "pb", "node-1", "127.0.0.2")
    c = gating.PodRef("c", "pc", "node-2", "127.0.0.3")
    samples = {"a": sample(0.2), "b": sample(0.93), "c": sample(0.2)}
    tiers = {d.pod.uid: d.tier for d in gating.decide([a, b, c], samples, gating.GateState(), TH)}
    # a shares node-1's accelerator with b: it is paused too; c on another node is not.
    assert tiers == {"a": Tier.PAUSED, "b": Tier.PAUSED, "c": Tier.FULL}


def test_unknown_pod_does_not_lower_its_node() -> None:
    a = gating.PodRef("a", "pa", "node-1", "127.0.0.1")
    b = gating.PodRef("b", "pb", "node-1", "127.0.0.2")
    decisions = gating.decide([a, b], {"a": sample(0.8), "b": Sample(error="timeout")}, gating.GateState(), TH)
    assert {d.pod.uid: d.tier for d in decisions} == {"a": Tier.TRUNCATED, "b": Tier.UNKNOWN}


def test_restart_seeds_history_from_what_the_worker_runs() -> None:
    pod = gating.PodRef("u", "p", "n", "127.0.0.1")
    s = scrape.parse_metrics(body(0.88, extra=f'{METRIC_TIER}{{tier="paused"}} 1\n'))
    # 88 % is inside paused's hysteresis band: a fresh operator keeps the worker paused.
    assert gating.decide([pod], {"u": s}, gating.GateState(), TH)[0].tier is Tier.PAUSED


def test_deletion_cost_orders_by_warmth() -> None:
    warm_full = gating.deletion_cost(True, Tier.FULL, sample(0.1))
    warm_paused = gating.deletion_cost(True, Tier.PAUSED, sample(0.95))
    cold = gating.deletion_cost(False, Tier.FULL, sample(0.1))
    unknown = gating.deletion_cost(False, Tier.UNKNOWN, None)
    assert warm_full > warm_paused > cold > unknown == 0


INT32 = (-(2**31), 2**31 - 1)


@pytest.mark.parametrize(
    ("resident", "total", "want_resident", "want_total"),
    [
        ("-1e300", "4", 0, 4),  # the case: a 303-digit cost before the clamp
        ("1e300", "4", 4, 4),
        ("7", "4", 4, 4),  # more resident than there are layers
        ("2", "-3", 0, 0),  # a negative total is no layers at all
        ("2", "1e300", 2, scrape.MAX_LAYERS),
        ("2.9", "4", 2, 4),
    ],
)
def test_scraped_layers_are_clamped_to_their_meaning(
    resident: str, total: str, want_resident: int, want_total: int
) -> None:
    text = body(0.5, extra=f"{METRIC_LAYERS_RESIDENT} {resident}\n{METRIC_LAYERS_TOTAL} {total}\n")
    s = scrape.parse_metrics(text)
    assert s.ok and (s.layers_resident, s.layers_total) == (want_resident, want_total)
    for warm in (True, False):
        for tier in Tier:
            cost = gating.deletion_cost(warm, tier, s)
            assert INT32[0] <= cost <= INT32[1] and 0 <= cost <= 1400
            assert len(str(cost)) <= 4  # an annotation the API server accepts


def test_deletion_cost_clamps_a_sample_built_by_hand() -> None:
    """The cost clamps again, whatever built the Sample (defence in depth for the API server)."""
    absurd = Sample(layers_resident=-(10**301), layers_total=4)
    assert gating.deletion_cost(True, Tier.FULL, absurd) == 1300
    huge = Sample(layers_resident=10**301, layers_total=10**300)
    assert gating.deletion_cost(True, Tier.FULL, huge) == 1400


def test_other_scraped_figures_are_clamped_to_their_meaning() -> None:
    text = body(
        0.5,
        extra=(
            f'{METRIC_PHASE_DURATION}{{phase="ready"}} -5\n'
            f'{METRIC_PHASE_DURATION}{{phase="weights_mapped"}} 2.5\n'
            f'{METRIC_LAYER_HEAT}{{layer="0"}} 1e308\n'
            f'{METRIC_LAYER_HEAT}{{layer="99999999999999999999"}} 3\n'
            f'{METRIC_LAYER_HEAT}{{layer="-1"}} 3\n'
            f'{METRIC_MODEL_INFO}{{digest="sha256:ab",layers="1e300"}} 1\n'
        ),
    )
    s = scrape.parse_metrics(text)
    assert s.ok
    assert s.phase_durations == {"weights_mapped": 2.5}  # a negative duration means nothing
    assert s.heat == {0: scrape.MAX_LAYER_HEAT}  # finite, and summable over a pool
    assert s.num_layers is None
    # Heat summed over many such pods stays finite, so the heat map is valid JSON.
    found = heat.aggregate([Sample(heat=dict(s.heat), digest="d", num_layers=4)] * 1000)
    assert found is not None and all(value < float("inf") for value in found[2].values())


def _spec(min_warm: int = 1) -> WarmModelSpec:
    return parse_spec({"model": {"hostPath": {"path": "/m"}}, "pool": {"replicas": 2, "minWarm": min_warm}})


def test_status_conditions_and_counts() -> None:
    pod = gating.PodRef("u", "p", "n", "127.0.0.1")
    decision = gating.decide([pod], {"u": sample(0.8)}, gating.GateState(), TH)[0]
    obs = [
        PodObservation("u", "p", ready=True, terminating=False, sample=sample(0.8), decision=decision),
        PodObservation("v", "q", ready=False, terminating=False, sample=None, decision=None),
    ]
    deployment = {"metadata": {"generation": 1}, "spec": {"replicas": 2},
                  "status": {"observedGeneration": 1, "updatedReplicas": 2, "replicas": 2}}
    out = st.compute_status(name="m", spec=_spec(), generation=3, pods=obs, deployment=deployment,
                            cold_starts=ColdStarts(), previous=None, now="2026-01-01T00:00:00Z")
    conds = {c["type"]: c for c in out["conditions"]}
    assert set(conds) == set(CONDITION_TYPES)
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["reason"] == "MinWarmReached"
    assert conds["WarmupGated"]["status"] == "True" and "q" in conds["WarmupGated"]["message"]
    assert out["warmReplicas"] == 1 and out["readyReplicas"] == 1 and out["observedGeneration"] == 3
    assert out["tierCounts"] == {"full": 0, "truncated": 1, "paused": 0, "unknown": 1}
    # lastTransitionTime is kept while a condition's status holds
    again = st.compute_status(name="m", spec=_spec(), generation=3, pods=obs, deployment=deployment,
                              cold_starts=ColdStarts(), previous=out, now="2026-01-02T00:00:00Z")
    assert again["conditions"] == out["conditions"]


def test_status_degraded() -> None:
    out = st.compute_status(name="m", spec=None, generation=1, pods=(), deployment=None, cold_starts=ColdStarts(),
                            previous=None, now="2026-01-01T00:00:00Z",
                            degraded=st.Degradation("ChildRejected", "cpu request above limit"))
    conds = {c["type"]: c for c in out["conditions"]}
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "ChildRejected"
    assert conds["Ready"]["status"] == "False"


def test_cold_start_percentiles() -> None:
    cold = ColdStarts()
    for i, seconds in enumerate([10.0, 20.0, 30.0, 40.0]):
        s = Sample(phase_durations={"ready": seconds}, phase_timestamps={"ready": 1000.0 + i})
        cold.record(f"u{i}", s)
    figures = cold.figures()
    assert figures.last_seconds == 40.0 and figures.p50_seconds == 20.0 and figures.p95_seconds == 40.0


def test_heat_aggregation_is_rate_limited_and_per_digest() -> None:
    a = Sample(digest="sha:a", num_layers=4, heat={0: 1.0, 3: 5.0})
    b = Sample(digest="sha:a", num_layers=4, heat={0: 10.0})
    other = Sample(digest="sha:b", num_layers=4, heat={1: 100.0})
    state = heat.HeatState()
    payload = heat.due(state, [a, b, other], interval=60, now=1000.0)
    assert payload is not None
    doc = json.loads(payload)
    assert doc["format"] == HEATMAP_FORMAT and doc["model_digest"] == "sha:a"
    assert doc["heat"] == {"0": 11.0, "3": 5.0}
    heat.written(state, payload, now=1000.0)
    assert heat.due(state, [a, b], interval=60, now=1010.0) is None  # too soon
    assert heat.due(state, [a, b], interval=60, now=1100.0) is None  # same order: no write
    from warmpool.heatmap import HeatMap

    assert HeatMap.from_json(doc).heat == {0: 11.0, 3: 5.0}  # the worker reads what we write


def test_labels_in_other_scripts_digits_or_pythons_loose_forms_are_garbage() -> None:
    """int() and float() take Arabic-Indic and fullwidth digits, "+1", " 1" and "1_0"; a worker's
    labels are read by the strict ASCII grammar (warmpool/contract/numerals.py) instead."""
    loose = ["\u0663", "\uff13", " 3", "+3", "3_0", "\u00b2"]
    lines = [f'{METRIC_LAYER_HEAT}{{layer="{label}"}} 5' for label in loose]
    lines += [f'{METRIC_REQUEST_PROMPT_TOKENS}_bucket{{le="{label}"}} 7' for label in [*loose, "nan", "infinity"]]
    lines += [f'{METRIC_ENGINE_BATCH_FINISHED}{{batch="{label}"}} 9' for label in loose]
    lines += [f'{METRIC_LAYER_HEAT}{{layer="2"}} 1', f'{METRIC_REQUEST_PROMPT_TOKENS}_bucket{{le="1e+06"}} 2',
              f'{METRIC_REQUEST_PROMPT_TOKENS}_bucket{{le="+Inf"}} 3', f'{METRIC_ENGINE_BATCH_FINISHED}{{batch="1"}} 4']
    s = scrape.parse_metrics(body(0.5, extra="\n".join(lines) + "\n"))
    assert s.ok
    assert s.heat == {2: 1.0}
    assert s.prompt_buckets == {1e6: 2.0, float("inf"): 3.0}
    assert s.batch_finished == {1: 4.0}
