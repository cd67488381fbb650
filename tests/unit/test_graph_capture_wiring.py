"""CUDA-graph capture is wired from the WarmModel to the worker, and only runs after a FULL warm-up."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from warmpool_operator.api.types import parse_spec
from warmpool_operator.model import Target
from warmpool_operator.rules import builders
from warmpool_worker.builtin.runtime import WorkerRuntime
from warmpool_worker.config import ServeConfig
from warmpool_worker.engine_api import GraphCapture

from warmpool.contract.api import Tier
from warmpool.contract.pods import WORKER_CONTAINER

pytestmark = pytest.mark.unit


def _worker_args(graph_capture: bool) -> list[str]:
    spec = parse_spec({"model": {"hostPath": {"path": "/models/tiny"}},
                       "warmup": {"graphCapture": graph_capture}})
    dep = builders.build_deployment(Target(name="tiny", namespace="ns", spec=spec))
    containers = dep["spec"]["template"]["spec"]["containers"]
    worker = next(c for c in containers if c["name"] == WORKER_CONTAINER)
    args: list[str] = worker["args"]
    return args


def test_graph_capture_off_in_the_spec_reaches_the_worker() -> None:
    assert "--no-graph-capture" in _worker_args(False)
    assert "--no-graph-capture" not in _worker_args(True)


class _Recorder:
    def __init__(self) -> None:
        self.calls = 0

    def capture_graphs(self, buckets: Sequence[int] = (1, 2, 4, 8)) -> dict[int, float]:
        self.calls += 1
        return {1: 0.01}


@pytest.mark.parametrize(("tier", "enabled", "expected_calls"), [
    (Tier.FULL, True, 1),
    (Tier.TRUNCATED, True, 0),
    (Tier.PAUSED, True, 0),
    (Tier.FULL, False, 0),
])
def test_graphs_are_captured_only_after_a_full_warmup(tier: Tier, enabled: bool, expected_calls: int) -> None:
    engine = _Recorder()
    assert isinstance(engine, GraphCapture)
    runtime: Any = WorkerRuntime.__new__(WorkerRuntime)  # only the fields _capture_graphs reads
    runtime.config = ServeConfig(model=Path("/models/tiny"), graph_capture=enabled)
    runtime.status = argparse.Namespace(warmup_tier=tier)
    runtime.recorder = None  # tracing off
    runtime._capture_graphs(engine)
    assert engine.calls == expected_calls
