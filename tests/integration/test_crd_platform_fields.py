"""spec.pod's GPU-platform fields and spec.model.s3's credential fields on a real API server (the
`api_server` fixture: no node): the CRD takes every one of them as examples/everything.yaml writes
them, and refuses the bad ones of tests/data/bad-warmmodels/ naming the field (the same catalogue
test_crd.py runs whole on the dev cluster)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_devcluster.testing import ClusterHandle

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: The catalogue's cases for these fields (51 and 62-74).
CASES = sorted(p for p in (ROOT / "tests" / "data" / "bad-warmmodels").glob("*.yaml")
               if p.stem[:2] == "51" or 62 <= int(p.stem[:2]) <= 74)


@pytest.fixture(scope="module")
def ns(api_server: ClusterHandle) -> Iterator[str]:
    name = f"platform-{uuid.uuid4().hex[:6]}"
    api_server.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        api_server.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def _expectations(path: Path) -> list[str]:
    return [line.removeprefix("# expect:").strip() for line in path.read_text().splitlines()
            if line.startswith("# expect:")]


def test_every_new_field_is_taken_and_kept(api_server: ClusterHandle, ns: str) -> None:
    example = yaml.safe_load((ROOT / "examples" / "everything.yaml").read_text())
    example["metadata"] = {"name": "everything"}
    example["spec"]["model"] = {"s3": {"endpoint": "https://s3.example.com", "bucket": "models",
                                       "prefix": "m/r1", "secretRef": {"name": "models-s3"}, "profile": "readers",
                                       "region": "eu-west-1", "caBundle": {"name": "models-ca"}}}
    api_server.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(example))
    got: dict[str, Any] = json.loads(api_server.kubectl("get", "wm", "everything", "-n", ns, "-o", "json").stdout)
    pod = got["spec"]["pod"]
    for key in ("runtimeClassName", "serviceAccountName", "affinity", "topologySpreadConstraints", "labels",
                "annotations", "shmSize", "extraVolumes", "extraVolumeMounts"):
        assert pod[key] == example["spec"]["pod"][key], key  # nothing pruned
    assert got["spec"]["model"]["s3"]["caBundle"] == {"name": "models-ca", "key": "ca.crt"}  # the key's default
    assert got["spec"]["model"]["s3"]["region"] == "eu-west-1"


def test_an_s3_source_without_a_secret_is_taken(api_server: ClusterHandle, ns: str) -> None:
    """The node agent's own credentials (or unsigned reads): secretRef is no longer required."""
    body = {"apiVersion": "warmpool.dev/v1alpha1", "kind": "WarmModel", "metadata": {"name": "ambient"},
            "spec": {"model": {"s3": {"endpoint": "https://s3.eu-west-1.amazonaws.com", "bucket": "models",
                                      "region": "eu-west-1"}}}}
    api_server.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(body))


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_a_bad_value_is_refused_naming_the_field(api_server: ClusterHandle, ns: str, path: Path) -> None:
    (bad,) = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    proc = api_server.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert proc.returncode != 0, f"{path.name} was accepted:\n{proc.stdout}"
    assert "is invalid" in proc.stderr or "Error from server" in proc.stderr, proc.stderr
    for expected in _expectations(path):
        assert expected in proc.stderr, f"{path.name}: {expected!r} not in:\n{proc.stderr}"
