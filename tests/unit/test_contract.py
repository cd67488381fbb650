"""warmpool/contract/: the one place for shared names defines each name once across its topic
modules, stays cheap to import on the worker's start path (the standard library only), and
re-exports nothing."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

import warmpool.contract
from warmpool.contract.api import API_GROUP, API_VERSION, CRD_NAME, DIRECTIVE_TIERS
from warmpool.contract.files import HEATMAP_FORMAT
from warmpool.contract.metrics import LABEL_REASON, METRIC_MODEL_INFO
from warmpool.contract.pods import ANNOTATION_TIER, LABEL_MODEL

pytestmark = pytest.mark.unit

CONTRACT = Path(warmpool.contract.__file__).parent
SOURCES = {path.stem: path.read_text() for path in sorted(CONTRACT.glob("*.py"))}


def _defined_names(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names += [target.id for target in node.targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
        elif isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.append(node.name)
    return names


def test_every_name_is_defined_once_across_the_topics() -> None:
    names = [name for source in SOURCES.values() for name in _defined_names(ast.parse(source))]
    twice = [name for name, count in Counter(names).items() if count > 1]
    assert twice == [], f"defined more than once in warmpool/contract/: {twice}"
    assert set(SOURCES) == {"__init__", "api", "pods", "http", "metrics", "files", "nodecache", "telemetry", "zero",
                            "numerals"}
    assert _defined_names(ast.parse(SOURCES["__init__"])) == []  # no re-exports, no names of its own


def test_it_imports_the_standard_library_only() -> None:
    imported = {
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for source in SOURCES.values()
        for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    topics = {f"warmpool.contract.{topic}" for topic in SOURCES}
    # re and math: the strict number grammar (numerals), typing: NamedTuple; all on the start path already.
    assert imported <= {"__future__", "enum", "math", "re", "typing"} | topics, imported


def test_names_other_programs_read_keep_their_values() -> None:
    """Values outside this repository depend on: the API, label keys, metric and label names."""
    assert (API_GROUP, API_VERSION, CRD_NAME) == (
        "warmpool.dev", "v1alpha1", "warmmodels.warmpool.dev")
    assert LABEL_MODEL == "warmpool.dev/model"
    assert ANNOTATION_TIER == "warmpool.dev/tier"
    assert LABEL_REASON == "reason"
    assert METRIC_MODEL_INFO == "warmpool_model_info"
    assert HEATMAP_FORMAT == "warmpool.heatmap/v1"
    assert [tier.value for tier in DIRECTIVE_TIERS] == ["full", "truncated", "paused"]
