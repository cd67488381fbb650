"""No dead code in the shipped packages: every public function and method is called (or named)
somewhere in the product itself, not only from tests.  A function only tests call is either dead
(delete it with its tests) or a test helper (it belongs under tests/).

The check is by name, over the product's source text: a name used anywhere outside its own
definition counts as used (an attribute call, a handler registered by decorator, an entry point in
pyproject.toml).  The few that only a framework or a peer program calls are listed with the reason."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("warmpool", "operator", "worker", "nodecache")
#: Called by something other than our own code, or kept for tests on purpose (why, each).
ALLOWED = {
    "configure": "kopf calls the @kopf.on.startup hook",
    "warmmodel_changed": "a kopf handler, registered by decorator",
    "child_changed": "a kopf handler, registered by decorator",
    "worker_changed": "a kopf handler, registered by decorator",
    "do_GET": "http.server calls it",
    "log_message": "http.server calls it",
    "nullable_schema": "pydantic's GenerateJsonSchema calls it",
    "field_title_should_be_set": "pydantic's GenerateJsonSchema calls it",
    "ignore_aliases": "yaml's Dumper calls it",
    "_check_rules": "a pydantic model validator",
    # Called only from tests today, and kept on purpose (each says why):
    "choose_step": "the replay's step choice from arrival times (bench predict), kept beside the operator's "
                   "choice from counts so that one module owns the rule",
    "round_up": "lengths.py's edges from the reader's side (a prompt length -> its bucket); the predictive "
                "operator test reads a served request's bucket with it",
    "generated_histogram": "the forecast history's generated-token histogram, stored beside prompt_histogram",
    "write_manifest": "the only writer of the manifest an http source serves (no CLI wraps it yet)",
}


def _definitions() -> list[tuple[Path, str]]:
    found = []
    for package in SHIPPED:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in tree.body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    found.append((path, node.name))
                elif isinstance(node, ast.ClassDef):
                    found += [(path, item.name) for item in node.body
                              if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                              and not item.name.startswith("__")]
    return found


def test_every_shipped_function_has_a_caller_in_the_product() -> None:
    sources = [path.read_text(encoding="utf-8") for package in SHIPPED for path in (ROOT / package).rglob("*.py")]
    sources.append((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    uses = Counter(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", "\n".join(sources)))
    unused = sorted(f"{path.relative_to(ROOT)}:{name}" for path, name in _definitions()
                    if name not in ALLOWED and uses[name] <= 1)
    assert unused == [], f"called from no product code (delete, or move to tests/support): {unused}"
