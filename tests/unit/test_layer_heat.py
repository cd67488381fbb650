"""LayerHeat: decayed per-layer access counts, shared by every engine that reports layer heat."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from warmpool_worker.layer_heat import LayerHeat

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


class _Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_touch_decays_per_layer_with_its_half_life() -> None:
    clock = _Clock()
    heat = LayerHeat(3, half_life_s=10.0, clock=clock)
    assert heat.snapshot() == {0: 0.0, 1: 0.0, 2: 0.0}
    heat.touch(1)
    clock.now += 10.0
    heat.touch(1)
    heat.touch(2)
    assert heat.snapshot() == pytest.approx({0: 0.0, 1: 1.5, 2: 1.0})
    clock.now += 20.0
    assert heat.snapshot() == pytest.approx({0: 0.0, 1: 0.375, 2: 0.25})


def test_touch_all_equals_touching_each_layer_at_one_instant() -> None:
    clock = _Clock()
    each, together = LayerHeat(4, 10.0, clock), LayerHeat(4, 10.0, clock)
    for _ in range(2):
        for index in range(4):
            each.touch(index)
        together.touch_all()
        clock.now += 7.0
    assert together.snapshot() == pytest.approx(each.snapshot())


def test_zero_half_life_counts_without_decay() -> None:
    clock = _Clock()
    heat = LayerHeat(2, half_life_s=0.0, clock=clock)
    heat.touch_all()
    clock.now += 1e6
    heat.touch(0)
    assert heat.snapshot() == {0: 2.0, 1: 1.0}


def test_layer_heat_is_torch_free() -> None:
    """Engines without torch (the serving side's stand-in) use it too."""
    code = "import sys, warmpool_worker.layer_heat, warmpool_worker.weight_table; assert 'torch' not in sys.modules"
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'worker'}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
