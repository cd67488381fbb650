"""Worker pods of an http/s3 source: the digest the node agents report, the cache volume,
the init container that waits for the published revision, the preferred node affinity."""

from __future__ import annotations

from typing import Any

import pytest
from warmpool_operator.api.types import parse_spec
from warmpool_operator.model import CacheRevision, Target
from warmpool_operator.rules import builders, host_paths
from warmpool_operator.rules.object_store_pods import resolved_revision

from warmpool import cachekeys
from warmpool.contract.files import MODEL_MOUNT_PATH
from warmpool.contract.nodecache import (
    CACHE_NODE_LABEL_PREFIX,
    CACHE_ROOT_MOUNT_PATH,
    CACHE_WAIT_CONTAINER,
)
from warmpool.contract.pods import ANNOTATION_CACHE_REVISION

pytestmark = pytest.mark.unit

DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32
HTTP = {"http": {"url": "http://127.0.0.1:8080/m"}}


def _spec(source: dict[str, Any] = HTTP) -> Any:
    return parse_spec({"model": dict(source)})


def _entry(node: str, digest: str | None, source: dict[str, Any] = HTTP, published: bool = False) -> dict[str, Any]:
    entry: dict[str, Any] = {"node": node, "source": cachekeys.source_fingerprint(source), "published": published}
    if digest is not None:
        entry["revision"] = digest
    return entry


def test_no_digest_until_an_agent_reports_one_for_the_current_source() -> None:
    spec = _spec()
    assert resolved_revision(spec, None) is None
    assert resolved_revision(spec, {"cacheNodes": [_entry("n1", None)]}) is None
    old = {"http": {"url": "http://127.0.0.1:8080/old"}}
    assert resolved_revision(spec, {"cacheNodes": [_entry("n1", OTHER, source=old, published=True)]}) is None
    assert resolved_revision(spec, {"cacheNodes": [_entry("n1", DIGEST)]}) == DIGEST
    assert resolved_revision(_spec({"hostPath": {"path": "/models/m"}}), {"cacheNodes": [_entry("n", DIGEST)]}) is None


def test_disagreeing_agents_a_published_digest_wins_then_the_majority() -> None:
    spec = _spec()
    entries = [_entry("a", DIGEST), _entry("b", DIGEST), _entry("c", OTHER, published=True)]
    assert resolved_revision(spec, {"cacheNodes": entries}) == OTHER
    entries = [_entry("a", OTHER), _entry("b", DIGEST), _entry("c", DIGEST)]
    assert resolved_revision(spec, {"cacheNodes": entries}) == DIGEST


def test_pods_mount_their_namespaces_link_to_the_revision_after_the_wait_and_prefer_nodes_holding_it() -> None:
    cache = CacheRevision("/var/lib/warmpool/cache", DIGEST, "ns")
    target = Target(name="m", namespace="ns", spec=_spec(), cache=cache)
    pod = builders.build_pod_template(target)["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["hostPath"]["path"] == "/var/lib/warmpool/cache"
    worker = pod["containers"][0]
    mount = next(m for m in worker["volumeMounts"] if m["name"] == "model")
    link = f"domains/ns/revisions/{'ab' * 32}"  # made by the agent once "ns" verified every block
    assert (mount["mountPath"], mount["subPath"], mount["readOnly"]) == (MODEL_MOUNT_PATH, link, True)
    (wait,) = pod["initContainers"]
    assert wait["name"] == CACHE_WAIT_CONTAINER
    assert wait["command"][-1] == f"{CACHE_ROOT_MOUNT_PATH}/{link}"
    assert wait["volumeMounts"] == [{"name": "model", "mountPath": CACHE_ROOT_MOUNT_PATH, "readOnly": True}]
    term = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["preference"]["matchExpressions"] == [
        {"key": f"cache.warmpool.dev/sha256-{'ab' * 28}", "operator": "Exists"}]
    # The node agent's pin: it spares the revision every pod on its node names here.
    template = builders.build_pod_template(target)["metadata"]
    assert template["annotations"][ANNOTATION_CACHE_REVISION] == DIGEST
    plain = builders.build_pod_template(Target("m", "ns", _spec({"hostPath": {"path": "/models/m"}})))
    assert ANNOTATION_CACHE_REVISION not in plain["metadata"]["annotations"]


def test_the_wait_which_sees_every_revision_runs_the_operators_image_not_the_tenants() -> None:
    spec = parse_spec({"model": dict(HTTP), "pod": {"image": "tenant.example/own-worker:1"}})
    target = Target(name="m", namespace="ns", spec=spec, cache=CacheRevision("/c", DIGEST, "ns"),
                    default_worker_image="warmpool.local/worker:trusted")
    pod = builders.build_pod_template(target)["spec"]
    (wait,) = pod["initContainers"]
    assert wait["image"] == "warmpool.local/worker:trusted"
    worker = pod["containers"][0]
    assert worker["image"] == "tenant.example/own-worker:1"
    # The tenant's container sees its own revision only, through its own namespace's link.
    assert [m.get("subPath") for m in worker["volumeMounts"] if m["name"] == "model"] == [
        f"domains/ns/revisions/{'ab' * 32}"]


def test_a_new_digest_rolls_the_pool_and_other_sources_are_unchanged() -> None:
    a = builders.build_deployment(Target("m", "ns", _spec(), CacheRevision("/c", DIGEST, "ns")))
    b = builders.build_deployment(Target("m", "ns", _spec(), CacheRevision("/c", OTHER, "ns")))
    assert a["metadata"]["annotations"] != b["metadata"]["annotations"]  # the spec hash differs
    plain = builders.build_pod_template(Target("m", "ns", _spec({"hostPath": {"path": "/models/m"}})))
    assert "initContainers" not in plain["spec"] and "affinity" not in plain["spec"]


def test_without_a_digest_the_builders_refuse_an_object_store_source() -> None:
    with pytest.raises(ValueError, match="digest is not known"):
        builders.build_pod_template(Target("m", "ns", _spec()))


def test_the_cache_root_must_be_an_allowed_host_path() -> None:
    spec = _spec()
    assert host_paths.mounted_host_paths(spec, "/var/lib/warmpool/cache") == ("/var/lib/warmpool/cache",)
    assert host_paths.refusal(spec, ("/var/lib/warmpool",), "/var/lib/warmpool/cache") is None
    refused = host_paths.refusal(spec, ("/models",), "/srv/cache")
    assert refused is not None and "/srv/cache" in refused


def test_node_label_fits_the_label_name_limit_and_refuses_non_digests() -> None:
    key = cachekeys.cache_node_label(DIGEST)
    prefix, name = key.split("/")
    assert len(name) <= 63 and prefix == CACHE_NODE_LABEL_PREFIX
    assert cachekeys.cache_node_label("ab" * 32) == key
    with pytest.raises(ValueError, match="not a sha256 digest"):
        cachekeys.cache_node_label("sha256:../../x")


def test_fingerprint_is_stable_and_tells_sources_apart() -> None:
    assert cachekeys.source_fingerprint(HTTP) == cachekeys.source_fingerprint({"http": {"url": HTTP["http"]["url"]}})
    assert cachekeys.source_fingerprint(HTTP) != cachekeys.source_fingerprint({"http": {"url": "http://127.0.0.1/x"}})
    s3 = {"s3": {"endpoint": "http://127.0.0.1:8333", "bucket": "models", "secretRef": {"name": "k"}}}
    assert _spec(s3).model.object_store() == s3


def test_a_partial_start_mounts_only_its_own_view_never_the_cache_root() -> None:
    spec = parse_spec({"model": {**HTTP, "startOnPartialCache": True}, "pod": {"image": "tenant.example/w:1"}})
    cache = CacheRevision("/var/lib/warmpool/cache", DIGEST, "team-a", partial=True)
    pod = builders.build_pod_template(Target(name="m", namespace="team-a", spec=spec, cache=cache))["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["hostPath"]["path"] == "/var/lib/warmpool/cache"
    worker = pod["containers"][0]
    assert worker["image"] == "tenant.example/w:1"
    link = f"domains/team-a/partial/{'ab' * 32}"
    # The tenant's container mounts its namespace's link to the view (the kubelet binds the view's
    # directory; the progress record is inside it), never the root with every tenant's blocks.
    assert [m for m in worker["volumeMounts"] if m["name"] == "model"] == [
        {"name": "model", "mountPath": MODEL_MOUNT_PATH, "readOnly": True, "subPath": link}]
    assert f"--model={MODEL_MOUNT_PATH}" in worker["args"] and "--partial-cache" in worker["args"]
    (wait,) = pod["initContainers"]
    assert wait["command"][-1] == f"{CACHE_ROOT_MOUNT_PATH}/{link}"  # the view's link, not the published revision
    assert wait["volumeMounts"] == [{"name": "model", "mountPath": CACHE_ROOT_MOUNT_PATH, "readOnly": True}]
    assert host_paths.mounted_host_paths(spec, "/var/lib/warmpool/cache") == ("/var/lib/warmpool/cache",)
    # Without the field nothing changes: the published revision, no --partial-cache.
    plain = builders.build_pod_template(Target("m", "ns", _spec(), CacheRevision("/c", DIGEST, "ns")))
    assert "--partial-cache" not in plain["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(("model", "engine", "wrong"), [
    ({"hostPath": {"path": "/models/m"}, "startOnPartialCache": True}, None, "needs spec.model.http or spec.model.s3"),
    ({**HTTP, "startOnPartialCache": True}, {"kind": "sidecar", "image": "vllm/vllm-openai:v0.9.0", "port": 8000},
     "needs spec.engine.kind builtin"),
])
def test_a_partial_start_is_refused_where_nothing_could_wait_for_the_bytes(
    model: dict[str, Any], engine: dict[str, Any] | None, wrong: str
) -> None:
    from warmpool_operator.api.types import InvalidWarmModel

    spec: dict[str, Any] = {"model": model}
    if engine is not None:
        spec["engine"] = engine
    with pytest.raises(InvalidWarmModel, match=wrong):
        parse_spec(spec)
