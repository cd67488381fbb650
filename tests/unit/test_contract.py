"""warmpool/contract.py: the one place for shared names defines each name once, and stays
cheap to import on the worker's start path (the standard library only)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from warmpool import contract

pytestmark = pytest.mark.unit

SOURCE = Path(contract.__file__).read_text()


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


def test_every_name_is_defined_once() -> None:
    twice = [name for name, count in Counter(_defined_names(ast.parse(SOURCE))).items() if count > 1]
    assert twice == [], f"defined more than once in contract.py: {twice}"


def test_it_imports_the_standard_library_only() -> None:
    imported = {
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(SOURCE)) if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= {"__future__", "enum"}, imported


def test_names_other_programs_read_keep_their_values() -> None:
    """Values outside this repository depend on: the API, label keys, metric and label names."""
    assert (contract.API_GROUP, contract.API_VERSION, contract.CRD_NAME) == (
        "warmpool.dev", "v1alpha1", "warmmodels.warmpool.dev")
    assert contract.LABEL_MODEL == "warmpool.dev/model"
    assert contract.ANNOTATION_TIER == "warmpool.dev/tier"
    assert contract.LABEL_REASON == "reason"
    assert contract.METRIC_MODEL_INFO == "warmpool_model_info"
    assert contract.HEATMAP_FORMAT == "warmpool.heatmap/v1"
    assert [tier.value for tier in contract.DIRECTIVE_TIERS] == ["full", "truncated", "paused"]
