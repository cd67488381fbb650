"""The pass's steps in control/ are named for what they do to the world: a step that only decides
is a rule (rules/), so a function in control/ called plain ``decide`` hides that it also sends
directives to workers or posts Events."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CONTROL = Path(__file__).resolve().parents[2] / "operator" / "warmpool_operator" / "control"
#: Names that say only "a choice is made": the action the function takes must be in its name.
VAGUE = {"decide", "handle", "process", "do", "run_step"}


def test_no_function_in_control_is_named_only_for_deciding() -> None:
    vague = [f"{path.name}:{node.lineno} {node.name}"
             for path in sorted(CONTROL.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in VAGUE]
    assert vague == [], f"name these for the action they take (send, post, write): {vague}"
