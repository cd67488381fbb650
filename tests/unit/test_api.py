"""The typed WarmModel API and the CRD generated from it, without a cluster.

The same catalogue of bad manifests that the API server must refuse
(tests/integration/test_crd.py) must also be refused by the pydantic model, so the
operator's own parse of an invalid-but-admitted object fails the same way.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_operator.api import crdgen
from warmpool_operator.api import types as api
from warmpool_operator.api.types import (
    DEFAULT_ENGINE_PORT,
    DEFAULT_MAX_REPLICAS,
    DEFAULT_MIN_WARM,
    DEFAULT_NODE_CACHE_ROOT,
    DEFAULT_REPLICAS,
)
from warmpool_operator.api.validation import ApiObject

from warmpool.contract.api import (
    CONDITION_READY,
    DEFAULT_HOT_LAYER_PERCENT,
    DEFAULT_HYSTERESIS_PERCENT,
    DEFAULT_LENGTH_BUCKETS,
    DEFAULT_PAUSE_AT_PERCENT,
    DEFAULT_TRUNCATE_AT_PERCENT,
    DEFAULT_WARMUP_TIMEOUT_SECONDS,
)
from warmpool.contract.files import MODEL_MOUNT_PATH
from warmpool.contract.http import DEFAULT_WORKER_PORT

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / crdgen.CRD_FILE
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CATALOGUE = sorted((ROOT / "tests" / "data" / "bad-warmmodels").glob("*.yaml"))
MINIMAL: dict[str, Any] = {"model": {"nodeCache": {"key": "SmolLM2-135M-Instruct"}}}


def _expectations(path: Path) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in path.read_text().splitlines() if line.startswith("# expect:")]


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


# --- the CRD file and the model agree -------------------------------------------------------


def test_committed_crd_is_generated_from_the_model() -> None:
    assert CRD_PATH.read_text() == crdgen.render(), (
        f"{CRD_PATH} is stale: run PYTHONPATH=.:worker:operator:devcluster "
        f"python -m warmpool_operator.api.crdgen > {CRD_PATH.relative_to(ROOT)}"
    )


def test_check_flag_reports_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text(crdgen.render().replace("maxItems: 16", "maxItems: 17", 1))
    assert crdgen.main(["--check", str(stale)]) == 1
    stale.write_text(crdgen.render())
    assert crdgen.main(["--check", str(stale)]) == 0


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for name, child in node.get("properties", {}).items():
        found += _walk(child, f"{path}.{name}")
    if "items" in node:
        found += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += _walk(node["additionalProperties"], f"{path}{{}}")
    return found


def test_schema_is_structural_and_bounded() -> None:
    schema = crdgen.root_schema()
    for path, node in _walk(schema["properties"]["spec"], "spec") + _walk(schema["properties"]["status"], "status"):
        assert "$ref" not in node and "title" not in node and "allOf" not in node, path
        if "anyOf" not in node:
            assert "type" in node, f"{path} has no type"
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path} is a list without maxItems"
        if node.get("type") == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, f"{path} is a map without maxProperties"
        if node.get("type") == "string" and "enum" not in node and node.get("format") != "date-time":
            assert "maxLength" in node, f"{path} is a string without maxLength"
        for name in node.get("properties", {}):
            assert node["properties"][name].get("description"), f"{path}.{name} has no description"


def test_crd_names_scope_and_subresources() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "warmmodels.warmpool.dev"
    assert spec["group"] == "warmpool.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "WarmModel" and spec["names"]["shortNames"] == ["wm"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.pool.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    columns = [column["name"] for column in version["additionalPrinterColumns"]]
    assert {"Desired", "Ready", "Warm", "Tiers", "Age"} <= set(columns)
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert "phase" not in status["properties"]
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_every_rule_reaches_the_schema() -> None:
    schema = crdgen.root_schema()
    in_schema = [rule for _path, node in _walk(schema) for rule in node.get("x-kubernetes-validations", [])]
    classes = [value for value in vars(api).values() if isinstance(value, type) and issubclass(value, ApiObject)]
    for cls in classes:
        for rule in cls.cel_rules:
            assert rule.to_schema() in in_schema, f"{cls.__name__}: {rule.message}"
    assert sum(rule["rule"] == "self == oldSelf" for rule in in_schema) == 2  # model.format, engine.kind


def _apply_schema_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's structural defaulting does: fill absent fields with `default`."""
    if isinstance(value, dict) and "properties" in schema:
        for name, child in schema["properties"].items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = _apply_schema_defaults(child, value[name])
    elif isinstance(value, list) and "items" in schema:
        value = [_apply_schema_defaults(schema["items"], item) for item in value]
    return value


@pytest.mark.parametrize(
    "spec",
    [MINIMAL, *(_documents(path)[0]["spec"] for path in EXAMPLES)],
    ids=["minimal", *(path.stem for path in EXAMPLES)],
)
def test_schema_defaults_equal_model_defaults(spec: dict[str, Any]) -> None:
    """Defaults live once, in the model; the CRD's, applied as the API server does, agree."""
    spec_schema = crdgen.root_schema()["properties"]["spec"]
    by_schema = _apply_schema_defaults(spec_schema, copy.deepcopy(spec))
    by_model = api.parse_spec(spec).model_dump(by_alias=True, exclude_none=True)
    assert by_schema == by_model


# --- defaults and parsing -----------------------------------------------------------------


def test_defaults_come_from_the_contract() -> None:
    spec = api.parse_spec(MINIMAL)
    assert spec.engine.kind == "builtin"
    assert spec.engine.port == DEFAULT_ENGINE_PORT
    assert spec.model.format == "safetensors"
    assert spec.model.node_cache is not None and spec.model.node_cache.root == DEFAULT_NODE_CACHE_ROOT
    assert (spec.pool.replicas, spec.pool.min_warm, spec.pool.max_replicas) == (
        DEFAULT_REPLICAS,
        DEFAULT_MIN_WARM,
        DEFAULT_MAX_REPLICAS,
    )
    assert tuple(spec.warmup.buckets) == DEFAULT_LENGTH_BUCKETS
    assert spec.warmup.graph_capture is True and spec.warmup.kv_prefix_persistence is False
    assert spec.warmup.timeout_seconds == DEFAULT_WARMUP_TIMEOUT_SECONDS
    gating = spec.gating
    assert gating.truncate_at_percent == DEFAULT_TRUNCATE_AT_PERCENT == 70
    assert gating.pause_at_percent == DEFAULT_PAUSE_AT_PERCENT == 90
    assert gating.hysteresis_percent == DEFAULT_HYSTERESIS_PERCENT
    assert gating.hot_layer_percent == DEFAULT_HOT_LAYER_PERCENT == 30
    assert spec.pod.port == DEFAULT_WORKER_PORT


def test_default_lists_are_not_shared() -> None:
    first, second = api.parse_spec(MINIMAL), api.parse_spec(MINIMAL)
    first.warmup.buckets.append(2048)
    assert second.warmup.buckets == list(DEFAULT_LENGTH_BUCKETS)


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_examples_parse(path: Path) -> None:
    (document,) = _documents(path)
    model = api.parse_warmmodel(document)
    assert model.metadata["name"] == document["metadata"]["name"]
    # A round trip through the model gives back what was written, plus defaults.
    dumped = model.model_dump(by_alias=True, exclude_none=True)
    assert api.parse_warmmodel(dumped) == model


def test_example_shapes() -> None:
    builtin = api.parse_warmmodel(_documents(ROOT / "examples" / "builtin-smollm2.yaml")[0])
    assert builtin.spec.engine.kind == "builtin" and builtin.spec.model.node_cache is not None
    assert builtin.spec.model.node_cache.key == "smollm2-135m-instruct"  # warmpool model fetch
    vllm = api.parse_warmmodel(_documents(ROOT / "examples" / "sidecar-vllm.yaml")[0])
    assert vllm.spec.engine.kind == "sidecar" and vllm.spec.engine.image is not None
    assert "vllm" in vllm.spec.engine.image


def test_everything_example_sets_every_spec_field() -> None:
    spec = _documents(ROOT / "examples" / "everything.yaml")[0]["spec"]
    text = (ROOT / "examples" / "everything.yaml").read_text()
    for path, _node in _walk(crdgen.root_schema()["properties"]["spec"], "spec")[1:]:
        leaf = path.rsplit(".", 1)[-1].rstrip("[]{}")
        # Alternatives that cannot be set together are shown commented out.
        assert f"{leaf}:" in text, f"examples/everything.yaml does not show {path}"
    assert api.parse_spec(spec).engine.env is not None


def test_snake_case_names_and_kopf_style_mappings_are_accepted() -> None:
    from types import MappingProxyType

    spec = api.parse_spec(
        MappingProxyType({"model": {"host_path": {"path": "/data/m"}}, "gating": {"truncate_at_percent": 60}})
    )
    assert spec.model.host_path is not None and spec.gating.truncate_at_percent == 60
    assert spec.model_dump(by_alias=True, exclude_none=True)["gating"]["truncateAtPercent"] == 60


def test_strict_types_like_the_api_server() -> None:
    with pytest.raises(api.InvalidWarmModel) as caught:
        api.parse_spec({**MINIMAL, "pool": {"replicas": "3"}})
    assert caught.value.errors == ["spec.pool.replicas: Input should be a valid integer"]


def test_invalid_spec_error_names_each_field() -> None:
    with pytest.raises(api.InvalidWarmModel) as caught:
        api.parse_spec(
            {
                "model": {"hostPath": {"path": "/m"}, "pvc": {"claimName": "w"}},
                "gating": {"truncateAtPercent": 95},
                "warmup": {"buckets": [32, 1000000]},
            }
        )
    errors = caught.value.errors
    assert (
        "spec.model: exactly one of spec.model.pvc, spec.model.hostPath, spec.model.nodeCache, "
        "spec.model.http or spec.model.s3 must be set" in errors
    )
    assert any(e.startswith("spec.gating: spec.gating.truncateAtPercent must be below") for e in errors)
    assert any(e.startswith("spec.warmup.buckets[1]: ") for e in errors)
    assert str(caught.value) == "; ".join(errors)


def test_thresholds_feed_the_shared_tier_rule() -> None:
    gating = api.parse_spec({**MINIMAL, "gating": {"truncateAtPercent": 60, "pauseAtPercent": 85}}).gating
    thresholds = gating.thresholds()
    assert (thresholds.truncate_at, thresholds.pause_at, thresholds.hysteresis) == (60, 85, 5)


def test_status_round_trip_and_helpers() -> None:
    status = api.WarmModelStatus(
        observed_generation=3,
        replicas=3,
        ready_replicas=3,
        warm_replicas=2,
        tier_counts=api.TierCounts(full=2, truncated=1),
        conditions=[
            api.Condition(
                type=CONDITION_READY,
                status="True",
                reason="MinWarmReached",
                message="2 of 3 pods warm (minWarm 1)",
                last_transition_time="2025-01-01T00:00:00Z",
            )
        ],
        cold_start=api.ColdStart(last_seconds=4.5, p50_seconds=4.0, p95_seconds=6.1),
        selector="warmpool.dev/model=smollm2",
    )
    dumped = api.dump_status(status)
    assert dumped["readyReplicas"] == 3 and dumped["coldStart"]["p95Seconds"] == 6.1
    assert dumped["conditions"][0]["lastTransitionTime"] == "2025-01-01T00:00:00Z"
    assert api.WarmModelStatus.model_validate(dumped) == status
    assert status.condition("Ready") is not None and status.condition("Degraded") is None
    assert status.tier_counts is not None
    assert status.tier_counts.summary() == "full=2 truncated=1 paused=0"
    assert api.TierCounts(unknown=1).summary() == "full=0 truncated=0 paused=0 unknown=1"
    with pytest.raises(ValueError, match="reason"):
        api.Condition(type="Ready", status="True", reason="not camel", message="", last_transition_time="x")


def test_descriptions_name_the_mount_path_from_the_contract() -> None:
    assert MODEL_MOUNT_PATH in crdgen.render()


# --- the catalogue of bad manifests, seen by the typed model -------------------------------


def test_catalogue_is_big_enough_and_annotated() -> None:
    assert len(CATALOGUE) >= 20
    for path in CATALOGUE:
        assert _expectations(path), f"{path.name} has no '# expect:' line"
        assert path.stem[:2].isdigit(), path.name


@pytest.mark.parametrize("path", CATALOGUE, ids=[path.stem for path in CATALOGUE])
def test_catalogue_is_refused_by_the_model(path: Path) -> None:
    documents = _documents(path)
    if len(documents) > 1:
        # A transition (e.g. an immutable field): each object alone is valid; only the API
        # server, which sees old and new together, can refuse the change.
        for document in documents:
            api.parse_warmmodel(document)
        return
    with pytest.raises(api.InvalidWarmModel) as caught:
        api.parse_warmmodel(documents[0])
    field = _expectations(path)[0]
    # Pydantic's own wording differs from the API server's, but it names the same field.
    assert field.split("[")[0] in str(caught.value), str(caught.value)
