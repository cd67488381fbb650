"""Fixtures the integration tests share (a module that needs another variant defines its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import install_crd


@pytest.fixture(scope="module")
def crd(cluster: ClusterHandle) -> str:
    """The WarmModel CRD, installed (or updated) once per test module."""
    return install_crd(cluster, field_manager="warmpool-tests")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real two-layer Llama checkpoint (safetensors, tokenizer), made once per test module."""
    from warmpool_dev.testing_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny", layers=2)
