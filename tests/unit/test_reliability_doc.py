"""docs/reliability.md's fault matrix names tests: every one it names must exist.

The matrix is how an SRE finds the proof of a behaviour; a renamed or deleted test would
otherwise leave a row pointing at nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]
DOC = TESTS.parent / "docs" / "reliability.md"
#: `unit/test_x.py`, `unit/test_x.py::test_name` or a bare `::test_name` (same file as before it).
REFERENCE = re.compile(r"`((?:unit|integration|e2e)/\w+\.py)?(::\w+)?`")


def references() -> list[tuple[str, str | None]]:
    found: list[tuple[str, str | None]] = []
    for row in DOC.read_text().splitlines():
        if not row.startswith("| ") or row.startswith("| #"):
            continue
        proof = row.rstrip(" |").rsplit("|", 1)[-1]
        current: str | None = None
        for match in REFERENCE.finditer(proof):
            path, name = match.group(1), match.group(2)
            current = path or current
            assert current is not None, f"{row[:60]}…: a test name before any test file"
            found.append((current, name[2:] if name else None))
    return found


def test_the_matrix_names_tests() -> None:
    assert len(references()) >= 40


@pytest.mark.parametrize(("path", "name"), references())
def test_every_named_test_exists(path: str, name: str | None) -> None:
    source = TESTS / path
    assert source.is_file(), f"docs/reliability.md names {path}, which does not exist"
    if name is not None:
        assert re.search(rf"^(async )?def {name}\(", source.read_text(), re.M), (
            f"docs/reliability.md names {path}::{name}, which does not exist"
        )
