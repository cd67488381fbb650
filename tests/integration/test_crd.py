"""The WarmModel CRD on the real API server: examples, defaults, the bad-manifest catalogue,
the scale and status subresources, printer columns.

Each case of tests/data/bad-warmmodels/ is one YAML file: ``# expect: <substring>`` lines
(every one must appear in the API server's error, and the first names the field), then
the manifest.  A file with two documents is a transition: the first is created and must
succeed, applying the second must fail (immutable fields).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.api import types as api

from tests.support.e2e import install_crd
from warmpool.contract.api import API_GROUP, API_GROUP_VERSION, CONDITION_READY, KIND, PLURAL, SHORT_NAME, SINGULAR
from warmpool.contract.http import DEFAULT_WORKER_PORT
from warmpool.contract.pods import LABEL_MODEL

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CATALOGUE = sorted((ROOT / "tests" / "data" / "bad-warmmodels").glob("*.yaml"))


def _expectations(path: Path) -> list[str]:
    prefix = "# expect:"
    return [line[len(prefix) :].strip() for line in path.read_text().splitlines() if line.startswith(prefix)]


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _get(cluster: ClusterHandle, namespace: str, name: str) -> dict[str, Any]:
    proc = cluster.kubectl("get", f"{PLURAL}.{API_GROUP}", name, "-n", namespace, "-o", "json")
    body: dict[str, Any] = json.loads(proc.stdout)
    return body


@pytest.fixture(scope="module")
def crd(cluster: ClusterHandle) -> str:
    """Install (or update) the CRD and wait until kubectl's discovery (and the published
    OpenAPI that `kubectl explain` reads) know the short name too."""
    return install_crd(cluster, field_manager="warmpool-tests", discovery=("explain", SHORT_NAME))


@pytest.fixture(scope="module")
def shared_namespace(cluster: ClusterHandle, crd: str) -> Iterator[str]:
    """One namespace for the whole catalogue (its object names are unique): faster than one each."""
    name = f"crd-catalogue-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def test_crd_is_accepted_structural_and_established(cluster: ClusterHandle, crd: str) -> None:
    body = json.loads(cluster.kubectl("get", "crd", crd, "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in body["status"]["conditions"]}
    assert conditions.get("Established") == "True"
    assert conditions.get("NamesAccepted") == "True"
    assert conditions.get("NonStructuralSchema", "False") == "False"
    # kubectl explain reads the published OpenAPI: the descriptions made it through.
    explained = cluster.kubectl("explain", "wm.spec.gating.truncateAtPercent").stdout
    assert "at which warm-up is truncated" in explained


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_example_is_created_and_defaulted_as_documented(
    cluster: ClusterHandle, crd: str, namespace: str, path: Path
) -> None:
    (document,) = _documents(path)
    cluster.kubectl("create", "-n", namespace, "-f", str(path))
    stored = _get(cluster, namespace, document["metadata"]["name"])
    # The API server's defaults are the typed model's defaults, field for field.
    expected = api.parse_spec(document["spec"]).model_dump(by_alias=True, exclude_none=True)
    assert stored["spec"] == expected
    api.parse_warmmodel(stored)  # and what the operator will read back parses


def test_minimal_object_gets_the_documented_defaults(cluster: ClusterHandle, crd: str, namespace: str) -> None:
    manifest = {
        "apiVersion": API_GROUP_VERSION,
        "kind": KIND,
        "metadata": {"name": "minimal"},
        "spec": {"model": {"hostPath": {"path": "/data/models/m"}}},
    }
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest))
    spec = _get(cluster, namespace, "minimal")["spec"]
    assert spec["model"]["format"] == "safetensors"
    assert spec["engine"] == {"kind": "builtin", "port": 8000, "healthPath": "/health"}
    assert spec["pool"] == {"replicas": 1, "minWarm": 1, "maxReplicas": 8}
    assert spec["warmup"] == {
        "buckets": [32, 128, 512],
        "graphCapture": True,
        "kvPrefixPersistence": False,
        "timeoutSeconds": 600,
        "learnBuckets": False,
    }
    assert spec["gating"] == {
        "truncateAtPercent": 70,
        "pauseAtPercent": 90,
        "hysteresisPercent": 5,
        "hotLayerPercent": 30,
    }
    assert spec["pod"] == {"port": DEFAULT_WORKER_PORT, "drainSeconds": api.DEFAULT_DRAIN_SECONDS}


def test_catalogue_is_big_enough() -> None:
    assert len(CATALOGUE) >= 20


@pytest.mark.parametrize("path", CATALOGUE, ids=[path.stem for path in CATALOGUE])
def test_bad_manifest_is_refused_naming_the_field(cluster: ClusterHandle, shared_namespace: str, path: Path) -> None:
    documents = _documents(path)
    expectations = _expectations(path)
    assert expectations, f"{path.name}: no '# expect:' line"
    *setup, bad = documents
    for document in setup:
        cluster.kubectl("apply", "-n", shared_namespace, "-f", "-", input=json.dumps(document))
    before = _get(cluster, shared_namespace, bad["metadata"]["name"]) if setup else None

    proc = cluster.kubectl("apply", "-n", shared_namespace, "-f", "-", input=yaml.safe_dump(bad), check=False)

    assert proc.returncode != 0, f"{path.name} was accepted:\n{proc.stdout}"
    for expected in expectations:
        assert expected in proc.stderr, f"{path.name}: {expected!r} not in the API server's error:\n{proc.stderr}"
    # The refusal comes from the API server (its "is invalid" / "Error from server"), not a
    # client-side check that a different client would skip.
    assert "Error from server" in proc.stderr or "is invalid" in proc.stderr, proc.stderr
    if before is None:
        absent = cluster.kubectl(
            "get", "wm", bad["metadata"]["name"], "-n", shared_namespace, "--ignore-not-found", "-o", "name"
        )
        assert absent.stdout.strip() == ""
    else:
        after = _get(cluster, shared_namespace, bad["metadata"]["name"])
        assert after["spec"] == before["spec"]


def _create_example(cluster: ClusterHandle, namespace: str, name: str) -> None:
    cluster.kubectl("create", "-n", namespace, "-f", str(ROOT / "examples" / f"{name}.yaml"))


def test_kubectl_scale_writes_spec_pool_replicas(cluster: ClusterHandle, crd: str, namespace: str) -> None:
    _create_example(cluster, namespace, "builtin-smollm2")  # replicas 2, maxReplicas 4
    cluster.kubectl("scale", "-n", namespace, "wm/smollm2", "--replicas=3")
    assert _get(cluster, namespace, "smollm2")["spec"]["pool"]["replicas"] == 3

    scale = json.loads(
        cluster.kubectl("get", "-n", namespace, "wm/smollm2", "--subresource=scale", "-o", "json").stdout
    )
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3

    # The scale subresource goes through the same validation: past maxReplicas is refused.
    refused = cluster.kubectl("scale", "-n", namespace, "wm/smollm2", "--replicas=9", check=False)
    assert refused.returncode != 0
    assert "spec.pool.replicas" in refused.stderr
    assert _get(cluster, namespace, "smollm2")["spec"]["pool"]["replicas"] == 3


def test_status_subresource_and_printer_columns(cluster: ClusterHandle, crd: str, namespace: str) -> None:
    _create_example(cluster, namespace, "builtin-smollm2")
    status = api.WarmModelStatus(
        observed_generation=1,
        replicas=2,
        ready_replicas=2,
        warm_replicas=1,
        tier_counts=api.TierCounts(full=1, truncated=1),
        tier_summary=api.TierCounts(full=1, truncated=1).summary(),
        conditions=[
            api.Condition(
                type=CONDITION_READY,
                status="True",
                reason="MinWarmReached",
                message="1 of 2 pods warm",
                last_transition_time="2025-01-01T00:00:00Z",
            )
        ],
        cold_start=api.ColdStart(last_seconds=3.5, p50_seconds=3.2, p95_seconds=4.9),
        selector=f"{LABEL_MODEL}=smollm2",
    )
    patch = {"status": api.dump_status(status), "spec": {"pool": {"replicas": 4}}}
    cluster.kubectl(
        "patch",
        "-n",
        namespace,
        "wm/smollm2",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(patch),
    )
    stored = _get(cluster, namespace, "smollm2")
    assert api.parse_warmmodel(stored).status == status
    assert stored["spec"]["pool"]["replicas"] == 2  # the status subresource ignores spec

    # A main-resource update ignores status.
    cluster.kubectl(
        "patch", "-n", namespace, "wm/smollm2", "--type=merge", "-p", json.dumps({"status": {"replicas": 99}})
    )
    assert _get(cluster, namespace, "smollm2")["status"]["replicas"] == 2

    # The status schema is strict too: a reason must be one CamelCase word.
    bad = {"status": {"conditions": [{**api.dump_status(status)["conditions"][0], "reason": "not camel"}]}}
    refused = cluster.kubectl(
        "patch", "-n", namespace, "wm/smollm2", "--subresource=status", "--type=merge", "-p", json.dumps(bad),
        check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "status.conditions[0].reason" in refused.stderr

    # By default: Ready, warm pods beside minWarm, and the Ready condition's reason (AWAKE is empty here).
    table = cluster.kubectl("get", "-n", namespace, "wm", "smollm2").stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "WARM", "MIN-WARM", "DESIRED", "AWAKE", "TIERS", "STATUS", "AGE"]
    assert table[1].split()[:9] == ["smollm2", "True", "1", "1", "2", "full=1", "truncated=1", "paused=0",
                                    "MinWarmReached"]
    wide = cluster.kubectl("get", "-n", namespace, "wm", "smollm2", "-o", "wide").stdout
    assert "PODS-READY" in wide and "URL" in wide and "builtin" in wide

    # The HPA's view: the scale subresource reports status.replicas and the selector.
    scale = json.loads(
        cluster.kubectl("get", "-n", namespace, "wm/smollm2", "--subresource=scale", "-o", "json").stdout
    )
    assert scale["status"] == {"replicas": 2, "selector": f"{LABEL_MODEL}=smollm2"}


def test_short_name_and_category(cluster: ClusterHandle, crd: str, namespace: str) -> None:
    _create_example(cluster, namespace, "builtin-smollm2")
    assert cluster.kubectl("get", "-n", namespace, "wm", "-o", "name").stdout.strip() == (
        f"{SINGULAR}.{API_GROUP}/smollm2"
    )
    assert "smollm2" in cluster.kubectl("get", "-n", namespace, "warmpool").stdout
