"""The per-pod capacity curve: the worker's batch-size counters scraped, turned into per-step
deltas, and the best point measured with enough work as the capacity the forecast divides by."""

from __future__ import annotations

import pytest
from warmpool_operator.io.worker_metrics import parse_metrics
from warmpool_operator.model import Sample
from warmpool_operator.rules.forecast.steps import CapacityMeter, StepAccumulator, batch_deltas

from warmpool.contract.metrics import (
    BATCH_SIZE_EDGES,
    METRIC_ENGINE_BATCH_FINISHED,
    METRIC_ENGINE_BATCH_SECONDS,
    METRIC_ENGINE_BUSY_SECONDS,
    METRIC_REQUESTS_TOTAL,
    batch_bucket,
)

pytestmark = pytest.mark.unit

STEP = 10


def test_batch_sizes_fall_in_buckets_named_by_their_lower_edge() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 7, 8, 11, 12, 15, 16, 17)] == [1, 2, 2, 4, 4, 8, 8, 12, 12, 16, 16]
    assert batch_bucket(10_000) == BATCH_SIZE_EDGES[-1]
    with pytest.raises(ValueError, match="at least one request"):
        batch_bucket(0)


def test_scrape_reads_the_curve_and_drops_labels_that_are_not_edges() -> None:
    text = "\n".join([
        f"{METRIC_REQUESTS_TOTAL} 30",
        f"{METRIC_ENGINE_BUSY_SECONDS} 9.5",
        f'{METRIC_ENGINE_BATCH_SECONDS}{{batch="1"}} 6.0',
        f'{METRIC_ENGINE_BATCH_SECONDS}{{batch="8"}} 3.5',
        f'{METRIC_ENGINE_BATCH_FINISHED}{{batch="1"}} 6',
        f'{METRIC_ENGINE_BATCH_FINISHED}{{batch="8"}} 24',
        f'{METRIC_ENGINE_BATCH_SECONDS}{{batch="3"}} 1.0',  # not an edge: garbage, dropped
        f'{METRIC_ENGINE_BATCH_SECONDS}{{batch="-8"}} 1.0',
        f'{METRIC_ENGINE_BATCH_FINISHED}{{batch="12"}} NaN',
    ]) + "\n"
    parsed = parse_metrics(text)
    assert parsed.ok and parsed.batch_seconds == {1: 6.0, 8: 3.5} and parsed.batch_finished == {1: 6.0, 8: 24.0}
    assert parse_metrics(f"{METRIC_REQUESTS_TOTAL} 1\n").batch_seconds == {}  # an engine with no curve


def _sample(requests: float, served: float, busy: float, batch: dict[int, tuple[float, float]]) -> Sample:
    return Sample(requests_total=requests, prompt_count=served, busy_seconds=busy,
                  batch_seconds={edge: seconds for edge, (_, seconds) in batch.items()},
                  batch_finished={edge: finished for edge, (finished, _) in batch.items()})


def test_steps_carry_the_curves_deltas_summed_over_pods() -> None:
    acc = StepAccumulator(STEP)
    acc.observe({"a": ("a", _sample(10, 10, 5.0, {1: (10, 5.0)})),
                 "b": ("b", _sample(0, 0, 0.0, {}))}, 1.0)  # baselines
    acc.observe({"a": ("a", _sample(40, 40, 8.0, {1: (12, 6.0), 8: (28, 2.0)})),  # bucket 8 new: from zero
                 "b": ("b", _sample(6, 6, 3.0, {1: (6, 3.0)}))}, 11.0)
    closed = acc.observe({"a": ("a", _sample(40, 40, 8.0, {1: (12, 6.0), 8: (28, 2.0)})),
                          "b": ("b", _sample(6, 6, 3.0, {1: (6, 3.0)}))}, 21.0)
    assert closed[0].batch == {1: (2.0 + 6.0, 1.0 + 3.0), 8: (28.0, 2.0)}
    # a worker restart: its counters count from zero, so the new values are the deltas
    assert batch_deltas({1: (12, 6.0), 8: (28, 2.0)}, {1: (3, 1.5)}) == {1: (3.0, 1.5)}
    assert batch_deltas({1: (3, 1.5)}, {1: (3, 1.5)}) == {}  # nothing moved


def test_capacity_is_the_best_point_measured_with_enough_work() -> None:
    meter = CapacityMeter(window=3)
    meter.add(10.0, 10.0, {1: (10.0, 10.0)})
    assert meter.curve() == {1: 1.0} and meter.capacity_rps() == pytest.approx(1.0)
    # at batch 8 a pod served 3 per busy second, but 4 requests in 0.3 s is too little to believe yet
    meter.add(4.0, 0.3, {8: (4.0, 0.3)})
    assert meter.curve() == {1: 1.0} and meter.capacity_rps() == pytest.approx(1.0)
    meter.add(20.0, 1.5, {4: (8.0, 1.0), 8: (12.0, 0.5)})
    assert meter.curve() == pytest.approx({1: 1.0, 4: 8.0, 8: 16.0 / 0.8})
    assert meter.capacity_rps() == pytest.approx(20.0)  # the best point, not the all-steps mean (34 / 11.8)
    for _ in range(3):  # the window holds the newest busy steps only
        meter.add(6.0, 2.0, {2: (6.0, 2.0)})
    assert meter.curve() == {2: 3.0} and meter.capacity_rps() == pytest.approx(3.0)


def test_without_a_curve_capacity_is_served_over_busy_in_all() -> None:
    meter = CapacityMeter(window=3)
    meter.add(8.0, 2.0)  # an external engine: busy seconds but no batch counters
    assert meter.curve() == {} and meter.capacity_rps() == pytest.approx(4.0)
    meter.add(3.0, 3.0, {1: (3.0, 3.0)})  # a point with too little work: the figure in all stands
    assert meter.curve() == {} and meter.capacity_rps() == pytest.approx(11.0 / 5.0)
