"""What `pip install .` ships: every Python package under a product directory is listed.

setuptools' explicit `packages` list does not pick up subpackages on its own: a package
missing from it is absent from the image (the worker's `warmpool_worker.builtin.engine` was, once),
which a source checkout never shows.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_every_package_under_a_package_dir_is_shipped() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found: set[str] = set()
    for top, directory in setuptools["package-dir"].items():
        root = REPO / directory
        for init in root.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(root).parts
            found.add(".".join((top, *relative)))
    assert found - listed == set(), "packages that `pip install .` would leave out"
