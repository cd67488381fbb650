"""Jaeger for the dev cluster: built like the control plane's binaries, listening on loopback only."""

from __future__ import annotations

import json

import pytest
from warmpool_devcluster import build
from warmpool_devcluster.jaeger import LOOPBACK, jaeger_config

pytestmark = pytest.mark.unit


def endpoints(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [str(v) for k, v in node.items() if k == "endpoint"]
        return found + [e for v in node.values() for e in endpoints(v)]
    if isinstance(node, list):
        return [e for v in node for e in endpoints(v)]
    return []


def test_every_jaeger_listener_is_on_loopback() -> None:
    config = jaeger_config(4318, 16686, 16685)
    assert sorted(endpoints(config)) == sorted(f"{LOOPBACK}:{p}" for p in (4318, 16686, 16685))
    assert config["service"]["telemetry"]["metrics"]["level"] == "none"  # type: ignore[index]  # no :8888 reader
    assert "0.0.0.0" not in json.dumps(config)


def test_a_wrapper_module_repeats_the_modules_own_replaces() -> None:
    go_mod = "module x\n\nreplace (\n\ta => b v1.0.0\n\t// a note\n\tc => d v2.0.0\n)\n\nreplace e => f v3.0.0\n"
    assert sorted(build.module_replace_lines(go_mod)) == ["replace a => b v1.0.0", "replace c => d v2.0.0",
                                                          "replace e => f v3.0.0"]
    assert build.module_replace_lines("module x\n") == []


def test_jaeger_is_one_of_the_cached_binaries() -> None:
    jaeger = next(b for b in build.ALL_BINARIES if b.name == "jaeger")
    assert jaeger.version == build.JAEGER_VERSION == "v1.76.0"
    assert build.cached_path(jaeger).parent.name == "jaeger-v1.76.0"
