"""The worker's metrics carry what the operator needs to learn heat: one end-to-end parse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from warmpool_operator.io.worker_metrics import parse_metrics
from warmpool_operator.model import Sample
from warmpool_operator.rules import heat
from warmpool_worker.metrics import WorkerMetrics

from warmpool.heatmap import HeatMap, layer_order, read_heatmap

pytestmark = pytest.mark.unit


def test_worker_metrics_feed_the_operators_heat_map(tmp_path: Path) -> None:
    metrics = WorkerMetrics(process_start=0.0)
    metrics.set_model("sha256:abc", 4)
    metrics.set_heat({0: 1.0, 1: 5.0, 2: 0.5, 3: 2.0})
    sample = parse_metrics(metrics.render().decode())
    assert sample.digest == "sha256:abc"
    assert sample.num_layers == 4
    aggregated = heat.aggregate([sample])
    assert aggregated is not None
    digest, layers, per_layer = aggregated
    assert (digest, layers) == ("sha256:abc", 4)
    assert layer_order(per_layer, layers)[0] == 1  # the hottest layer loads first
    # What the operator writes into the ConfigMap is what a new worker reads back.
    path = tmp_path / "heatmap.json"
    path.write_text(heat.render(digest, layers, per_layer, now=1000.0))
    heat_map = read_heatmap(path)
    assert heat_map.model_digest == "sha256:abc"
    assert max(heat_map.heat, key=lambda layer: heat_map.heat[layer]) == 1


def test_a_new_model_replaces_the_old_info_series() -> None:
    metrics = WorkerMetrics(process_start=0.0)
    metrics.set_model("sha256:old", 4)
    metrics.set_model("sha256:new", 6)
    sample = parse_metrics(metrics.render().decode())
    assert (sample.digest, sample.num_layers) == ("sha256:new", 6)


def test_the_operator_rewrites_the_map_only_when_the_workers_load_order_changes() -> None:
    """The operator decides with the worker's own ordering (warmpool.heatmap.layer_order)."""
    state = heat.HeatState()
    first = heat.due(state, [Sample(digest="d", num_layers=3, heat={1: 5.0})], interval=0, now=1000.0)
    assert first is not None
    heat.written(state, first, now=1000.0)
    # A layer now reported with heat 0 loads where it loaded before (1, 0, 2): nothing to rewrite.
    assert heat.due(state, [Sample(digest="d", num_layers=3, heat={1: 5.0, 0: 0.0})], interval=0, now=2000.0) is None
    # Layer 2 warmed up: the load order becomes 1, 2, 0, and the map is rewritten.
    moved = heat.due(state, [Sample(digest="d", num_layers=3, heat={1: 5.0, 2: 1.0})], interval=0, now=3000.0)
    assert moved is not None
    assert layer_order(HeatMap.from_json(json.loads(moved)).heat, 3) == [1, 2, 0]
