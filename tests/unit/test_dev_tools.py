"""The developer tools live outside the product packages: the demo is told where the source
checkout is (never guesses it from its own file's location), the `warmpool` command names a
developer tool that is not installed (as in an image) instead of failing with a traceback,
and every tool takes its caches from one root."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from warmpool_dev import demo, model_fetch, paths
from warmpool_devcluster import build, cluster

from warmpool import cli

pytestmark = pytest.mark.unit


def test_demo_refuses_a_directory_that_is_not_a_checkout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--repo", str(tmp_path)]) == 1  # refused before any cluster is started
    error = capsys.readouterr().err
    assert str(tmp_path.resolve()) in error
    assert "examples/builtin-smollm2.yaml" in error and "crds" in error and "--repo" in error


def test_demo_reads_the_checkout_it_is_given(repo_root: Path, tmp_path: Path) -> None:
    checkout = demo.find_checkout(repo_root)
    assert checkout.example.is_file() and checkout.crds.is_dir()
    body = yaml.safe_load(demo._manifest(tmp_path / "models" / "smollm2", checkout))
    assert body["metadata"]["namespace"] == demo.NAMESPACE
    assert body["spec"]["model"]["nodeCache"] == {"root": str(tmp_path / "models"), "key": "smollm2"}


def test_a_developer_tool_missing_from_the_install_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # An image: the product packages only, no warmpool_dev.
    monkeypatch.setitem(sys.modules, "warmpool_dev", None)
    monkeypatch.delitem(sys.modules, "warmpool_dev.demo", raising=False)
    assert cli.main(["demo", "--help"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("warmpool demo: a developer tool, not in this install")
    assert "warmpool_dev" in error and "Traceback" not in error


def test_a_missing_dependency_is_named_not_blamed_on_the_tool(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)
    monkeypatch.delitem(sys.modules, "warmpool_dev.demo", raising=False)
    assert cli.main(["demo", "--help"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("warmpool demo: needs the Python module 'yaml'")
    assert "developer tool" not in error


def test_one_cache_root_for_every_tool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(paths.ENV_CACHE_DIR, str(tmp_path))
    assert paths.cache_root() == tmp_path
    assert model_fetch.default_model_dir() == tmp_path / "models" / model_fetch.MODEL_DIR_NAME
    assert cluster.clusters_root() == tmp_path / "clusters"
    assert build.cached_path(build.ALL_BINARIES[0]).is_relative_to(tmp_path / "bin")
