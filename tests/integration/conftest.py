"""Fixtures the integration tests share (a module that needs another variant defines its own)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from warmpool_devcluster.seaweedfs import SeaweedHandle, start_seaweedfs
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import install_crd, readable_by_pods


@pytest.fixture(scope="module")
def crd(cluster: ClusterHandle) -> str:
    """The WarmModel CRD, installed (or updated) once per test module."""
    return install_crd(cluster, field_manager="warmpool-tests")


@pytest.fixture(scope="module")
def tiny_model(pod_dir: Callable[[str], Path]) -> Path:
    """A real two-layer Llama checkpoint (safetensors, tokenizer), made once per test module where
    the node's worker containers can read it."""
    from warmpool_dev.testing_models import make_tiny_llama

    return readable_by_pods(make_tiny_llama(pod_dir("tiny") / "model", layers=2))


@pytest.fixture(scope="session")
def loopback_s3_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedHandle]:
    """SeaweedFS on loopback, started once for the modules that read and write it directly (each
    under prefixes of its own): a start and a stop cost about half a minute."""
    handle = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield handle
    finally:
        handle.stop()
