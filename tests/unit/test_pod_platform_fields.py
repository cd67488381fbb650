"""spec.pod's GPU-platform fields (runtimeClassName, affinity, topology spread, labels, annotations,
serviceAccountName, shmSize, extra volumes and mounts): each reaches the worker pods as Kubernetes
writes it; bad values are refused naming the field; the host-path policy covers extra volumes."""

from __future__ import annotations

from typing import Any

import pytest
from warmpool_operator.api.types import InvalidWarmModel, parse_spec
from warmpool_operator.model import CacheRevision, Target
from warmpool_operator.rules import builders, host_paths
from warmpool_operator.rules.host_paths import DEFAULT_ALLOWED_HOST_PATHS

from warmpool.contract.pods import ENGINE_CONTAINER, LABEL_AWAKE, LABEL_MODEL, WORKER_CONTAINER

pytestmark = pytest.mark.unit

ALLOWED = host_paths.normalise_prefixes(DEFAULT_ALLOWED_HOST_PATHS)
MODEL = {"hostPath": {"path": "/models/tiny"}}
SIDECAR = {"kind": "sidecar", "image": "vllm/vllm-openai:v0.8.0"}


def spec(pod: dict[str, Any], model: dict[str, Any] | None = None, engine: dict[str, Any] | None = None) -> Any:
    body: dict[str, Any] = {"model": model or MODEL, "pod": pod}
    if engine is not None:
        body["engine"] = engine
    return parse_spec(body)


def pod_template(pod: dict[str, Any], model: dict[str, Any] | None = None, engine: dict[str, Any] | None = None,
                 cache: CacheRevision | None = None) -> dict[str, Any]:
    target = Target(name="tiny", namespace="ns", spec=spec(pod, model, engine), cache=cache)
    template: dict[str, Any] = builders.build_deployment(target)["spec"]["template"]
    return template


def container(template: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in template["spec"]["containers"] if c["name"] == name)


AFFINITY: dict[str, Any] = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 10, "preference": {"matchExpressions": [{"key": "zone-a", "operator": "Exists"}]}}],
    },
    "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                            "labelSelector": {"matchLabels": {"team": "llm"}}}}]},
}


def test_scheduling_fields_reach_the_pod() -> None:
    spread = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
    template = pod_template({"runtimeClassName": "nvidia", "serviceAccountName": "llm-reader",
                             "affinity": AFFINITY, "topologySpreadConstraints": [spread]})
    pod = template["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["serviceAccountName"] == "llm-reader"
    assert pod["automountServiceAccountToken"] is False  # the API token stays out all the same
    assert pod["affinity"] == AFFINITY
    # No labelSelector given: the constraint counts this pool's pods (the Deployment's selector).
    assert pod["topologySpreadConstraints"] == [{**spread, "labelSelector": {"matchLabels":
                                                                             builders.selector_labels("tiny")}}]


def test_an_object_store_pools_own_preference_comes_after_the_users() -> None:
    cache = CacheRevision(root="/var/lib/warmpool/cache", digest="sha256:" + "a" * 64, domain="ns")
    template = pod_template({"affinity": AFFINITY}, model={"http": {"url": "http://models.example/m"}}, cache=cache)
    node = template["spec"]["affinity"]["nodeAffinity"]
    preferred = node["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred[0] == AFFINITY["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert preferred[1]["preference"]["matchExpressions"][0]["operator"] == "Exists"  # the revision's node label
    assert node["requiredDuringSchedulingIgnoredDuringExecution"] == AFFINITY["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert template["spec"]["affinity"]["podAntiAffinity"] == AFFINITY["podAntiAffinity"]


def test_labels_and_annotations_reach_the_pod_beside_the_operators() -> None:
    template = pod_template({"labels": {"team": "llm", "example.com/cost-center": "42"},
                             "annotations": {"prometheus.io/scrape": "false", "note": "hi"}})
    labels, annotations = template["metadata"]["labels"], template["metadata"]["annotations"]
    assert labels["team"] == "llm" and labels["example.com/cost-center"] == "42"
    assert labels[LABEL_MODEL] == "tiny" and labels[LABEL_AWAKE] == "true"
    assert annotations["prometheus.io/scrape"] == "false" and annotations["note"] == "hi"
    assert "warmpool.dev/revision" in annotations


@pytest.mark.parametrize(
    ("pod", "field", "words"),
    [
        ({"labels": {"app.kubernetes.io/managed-by": "me"}}, "spec.pod.labels", "operator's own"),
        ({"labels": {"warmpool.dev/awake": "false"}}, "spec.pod.labels", "operator's own"),
        ({"labels": {"cache.warmpool.dev/x": "1"}}, "spec.pod.labels", "operator's own"),
        ({"labels": {"bad key!": "1"}}, "spec.pod.labels", "label key"),
        ({"labels": {"team": "not a value"}}, "spec.pod.labels.team", "pattern"),
        ({"annotations": {"warmpool.dev/tier": "full"}}, "spec.pod.annotations", "operator's own"),
        ({"annotations": {"controller.kubernetes.io/pod-deletion-cost": "9"}}, "spec.pod.annotations",
         "operator's own"),
        ({"runtimeClassName": "Not_A_Name"}, "spec.pod.runtimeClassName", "pattern"),
        ({"serviceAccountName": ""}, "spec.pod.serviceAccountName", "at least 1"),
        ({"shmSize": "0"}, "spec.pod.shmSize", "pattern"),
        ({"shmSize": "-1Gi"}, "spec.pod.shmSize", "pattern"),
        ({"topologySpreadConstraints": [{"maxSkew": 0, "topologyKey": "k", "whenUnsatisfiable": "DoNotSchedule"}]},
         "spec.pod.topologySpreadConstraints[0].maxSkew", "greater than or equal to 1"),
        ({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "k", "whenUnsatisfiable": "Maybe"}]},
         "spec.pod.topologySpreadConstraints[0].whenUnsatisfiable", "DoNotSchedule"),
        ({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 101, "preference": {}}]}}},
         "spec.pod.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight", "100"),
        ({"extraVolumes": [{"name": "model", "emptyDir": {}}]}, "spec.pod.extraVolumes[0]", "operator's own"),
        ({"extraVolumes": [{"name": "a", "emptyDir": {}, "secret": {"secretName": "s"}}]},
         "spec.pod.extraVolumes[0]", "exactly one"),
        ({"extraVolumes": [{"name": "a"}]}, "spec.pod.extraVolumes[0]", "exactly one"),
        ({"extraVolumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]}, "spec.pod.extraVolumes",
         "share a name"),
        ({"extraVolumeMounts": [{"name": "nope", "mountPath": "/data"}]}, "spec.pod.extraVolumeMounts",
         "name a volume"),
        ({"extraVolumes": [{"name": "a", "emptyDir": {}}],
          "extraVolumeMounts": [{"name": "a", "mountPath": "/warmpool/model"}]},
         "spec.pod.extraVolumeMounts[0]", "operator's own"),
        ({"extraVolumes": [{"name": "a", "emptyDir": {}}],
          "extraVolumeMounts": [{"name": "a", "mountPath": "/dev/shm"}]}, "spec.pod.extraVolumeMounts[0]",
         "operator's own"),
        ({"extraVolumes": [{"name": "a", "emptyDir": {}}],
          "extraVolumeMounts": [{"name": "a", "mountPath": "/d"}, {"name": "a", "mountPath": "/d"}]},
         "spec.pod.extraVolumeMounts", "share a mountPath"),
        ({"extraVolumes": [{"name": "a", "hostPath": {"path": "/models/shared"}}],
          "extraVolumeMounts": [{"name": "a", "mountPath": "/shared"}]}, "spec.pod.extraVolumeMounts",
         "mounted readOnly: true"),
        ({"extraVolumes": [{"name": "a", "hostPath": {"path": "/models/shared"}}],
          "extraVolumeMounts": [{"name": "a", "mountPath": "/shared", "readOnly": False}]},
         "spec.pod.extraVolumeMounts", "mounted readOnly: true"),
        ({"extraVolumes": [{"name": "a", "hostPath": {"path": "/models/../etc"}}]},
         "spec.pod.extraVolumes[0].hostPath.path", "pattern"),
    ],
)
def test_bad_values_are_refused_naming_the_field(pod: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(InvalidWarmModel) as caught:
        spec(pod)
    text = str(caught.value)
    assert f"{field}:" in text, text  # the location, or the rule's message, names the field
    assert words in text, text


def test_shared_memory_and_extra_volumes_reach_every_main_container() -> None:
    pod = {
        "shmSize": "16Gi",
        "extraVolumes": [{"name": "compile-cache", "hostPath": {"path": "/models/cache", "type": "DirectoryOrCreate"}},
                         {"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}},
                         {"name": "tls", "secret": {"secretName": "engine-tls"}},
                         {"name": "extra", "configMap": {"name": "engine-conf", "optional": True}},
                         {"name": "data", "persistentVolumeClaim": {"claimName": "data", "readOnly": True}}],
        "extraVolumeMounts": [{"name": "compile-cache", "mountPath": "/root/.cache/vllm", "readOnly": True},
                              {"name": "tls", "mountPath": "/etc/engine-tls", "readOnly": True},
                              {"name": "data", "mountPath": "/data", "subPath": "set/a"}],
    }
    for engine, names in ((None, (WORKER_CONTAINER,)), (SIDECAR, (WORKER_CONTAINER, ENGINE_CONTAINER))):
        template = pod_template(pod, engine=engine)
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
        assert volumes["compile-cache"] == {"name": "compile-cache",
                                            "hostPath": {"path": "/models/cache", "type": "DirectoryOrCreate"}}
        assert volumes["scratch"] == {"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}}
        assert volumes["tls"] == {"name": "tls", "secret": {"secretName": "engine-tls"}}
        assert volumes["extra"] == {"name": "extra", "configMap": {"name": "engine-conf", "optional": True}}
        assert volumes["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": "data", "readOnly": True}}
        for name in names:
            mounts = {m["mountPath"]: m for m in container(template, name)["volumeMounts"]}
            assert mounts["/dev/shm"] == {"name": "shm", "mountPath": "/dev/shm"}
            assert mounts["/root/.cache/vllm"] == {"name": "compile-cache", "mountPath": "/root/.cache/vllm",
                                                   "readOnly": True}
            assert mounts["/etc/engine-tls"]["readOnly"] is True
            assert mounts["/data"]["subPath"] == "set/a"


def test_no_new_field_no_change_in_the_pod() -> None:
    """A WarmModel that sets none of them keeps its pods byte for byte (no rollout on upgrade)."""
    template = pod_template({})
    for key in ("runtimeClassName", "serviceAccountName", "affinity", "topologySpreadConstraints"):
        assert key not in template["spec"]
    assert {v["name"] for v in template["spec"]["volumes"]} == {"model", "config", "control", "tmp"}


def test_an_extra_host_path_is_held_to_the_allowed_prefixes() -> None:
    inside = spec({"extraVolumes": [{"name": "c", "hostPath": {"path": "/models/compile-cache"}}]})
    assert host_paths.refusal(inside, ALLOWED) is None
    outside = spec({"extraVolumes": [{"name": "kubelet", "hostPath": {"path": "/var/lib/kubelet"}}]})
    why = host_paths.refusal(outside, ALLOWED)
    assert why is not None and "hostPath /var/lib/kubelet is outside" in why and "no pod is created" in why
    # With an object-store model too (whose own mount is the cache, which the operator vouches for).
    http = {"http": {"url": "http://models.example/m"}}
    store = spec({"extraVolumes": [{"name": "etc", "hostPath": {"path": "/etc"}}]}, model=http)
    why = host_paths.refusal(store, ALLOWED)
    assert why is not None and "/etc" in why


def test_an_extra_host_path_may_never_be_the_block_cache() -> None:
    for model in (MODEL, {"http": {"url": "http://models.example/m"}}):
        into = spec({"extraVolumes": [{"name": "c", "hostPath": {"path": "/var/lib/warmpool/cache/revisions"}}]},
                    model=model)
        why = host_paths.refusal(into, ALLOWED)
        assert why is not None and "would mount the node's block cache" in why, why


def test_the_check_sees_the_extra_host_paths_the_builders_mount() -> None:
    target = Target(name="m", namespace="ns", spec=spec(
        {"extraVolumes": [{"name": "c", "hostPath": {"path": "/models/c"}}, {"name": "e", "emptyDir": {}}]}))
    volumes = builders.build_deployment(target)["spec"]["template"]["spec"]["volumes"]
    mounted = tuple(v["hostPath"]["path"] for v in volumes if "hostPath" in v)
    assert mounted == host_paths.mounted_host_paths(target.spec) == ("/models/tiny", "/models/c")
