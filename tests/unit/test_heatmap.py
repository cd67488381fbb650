"""Heat map file format, ordering and the hot share."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from warmpool.contract.files import HEATMAP_FORMAT
from warmpool.heatmap import (
    HeatMap,
    HeatMapError,
    default_layer_order,
    hot_layers,
    layer_order,
    read_heatmap,
    usable_heat,
)

pytestmark = pytest.mark.unit


def test_round_trip(tmp_path: Path) -> None:
    """What the operator writes into the ConfigMap (to_text) is what the worker reads from the file."""
    original = HeatMap(model_digest="sha256:abc", num_layers=4, heat={0: 1.0, 3: 7.5}, updated_at=12.0)
    path = tmp_path / "heatmap.json"
    path.write_text(original.to_text())
    assert read_heatmap(path) == original
    assert json.loads(path.read_text())["format"] == HEATMAP_FORMAT


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not JSON"),
        ("[]", "JSON object"),
        ('{"format": "other"}', "format"),
        (json.dumps({"format": HEATMAP_FORMAT, "num_layers": 2}), "model_digest"),
        (json.dumps({"format": HEATMAP_FORMAT, "model_digest": "d", "num_layers": -1}), "num_layers"),
        (
            json.dumps({"format": HEATMAP_FORMAT, "model_digest": "d", "num_layers": 2, "heat": {"x": 1}}),
            "'x'",
        ),
        (
            json.dumps({"format": HEATMAP_FORMAT, "model_digest": "d", "num_layers": 2, "heat": {"5": 1}}),
            "range",
        ),
        (
            json.dumps({"format": HEATMAP_FORMAT, "model_digest": "d", "num_layers": 2, "heat": {"0": -1}}),
            "negative",
        ),
        (
            json.dumps(
                {"format": HEATMAP_FORMAT, "model_digest": "d", "num_layers": 2, "heat": {"0": "hot"}}
            ),
            "finite",
        ),
    ],
)
def test_bad_files_named(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "heatmap.json"
    path.write_text(content)
    with pytest.raises(HeatMapError) as info:
        read_heatmap(path)
    assert str(path) in str(info.value)
    assert needle in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(HeatMapError, match="cannot read"):
        read_heatmap(tmp_path / "absent.json")


def test_applies_to() -> None:
    heat_map = HeatMap("d1", 4)
    assert heat_map.applies_to("d1", 4) is None
    assert "not 'd2'" in (heat_map.applies_to("d2", 4) or "")
    assert "layers" in (heat_map.applies_to("d1", 5) or "")


def test_layer_order() -> None:
    assert layer_order(None, 4) == [0, 1, 2, 3] == default_layer_order(4)
    assert layer_order({}, 3) == [0, 1, 2]
    assert layer_order({2: 5.0, 0: 1.0, 3: 5.0}, 5) == [2, 3, 0, 1, 4]
    # garbage heat is no heat; out-of-range indices ignored
    assert layer_order({1: math.nan, 2: -3.0, 9: 100.0, 3: 1.0}, 4) == [3, 0, 1, 2]


@pytest.mark.parametrize(
    ("n", "percent", "expected_count"),
    [(10, 30, 3), (30, 30, 9), (4, 30, 2), (1, 30, 1), (10, 0, 0), (10, 100, 10), (10, 1, 1), (0, 30, 0)],
)
def test_hot_layers(n: int, percent: float, expected_count: int) -> None:
    order = list(reversed(range(n)))
    result = hot_layers(order, percent)
    assert result == order[:expected_count]


def test_hot_layers_bad_percent() -> None:
    with pytest.raises(ValueError):
        hot_layers([0, 1], 101)


def test_usable_heat_applies_only_to_its_own_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "heat.json"
    path.write_text(HeatMap(model_digest="sha256:a", num_layers=3, heat={0: 1.0, 2: 9.0}).to_text())
    assert usable_heat(path, "sha256:a", 3) == {0: 1.0, 2: 9.0}
    assert usable_heat(path, "sha256:b", 3) is None  # another checkpoint's heat
    assert usable_heat(path, "sha256:a", 4) is None  # same digest, other shape: stale
    assert usable_heat(path, None, 3) is None  # no digest to check it against
    assert usable_heat(None, "sha256:a", 3) is None
    path.write_text("{not json")
    assert usable_heat(path, "sha256:a", 3) is None  # garbage costs the order, never the start
