"""bench coldstart byte-compiles the project's packages before timing, as the worker image does."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from warmpool_bench.coldstart import compile_sources

pytestmark = pytest.mark.unit


def test_compile_sources_writes_the_bytecode_of_every_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "benchpkg_under_test"
    (package / "sub").mkdir(parents=True)
    modules = ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py")
    for module in modules:
        (package / module).write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "pycache_prefix", None)  # where the compiled files go must be beside the source
    compile_sources(["benchpkg_under_test"])
    for module in modules:
        assert Path(importlib.util.cache_from_source(str(package / module))).is_file(), module

