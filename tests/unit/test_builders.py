"""The operator's pure builders: deterministic, restricted, warm-aware rollouts."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from warmpool_operator.api.types import DEFAULT_DRAIN_SECONDS, DEFAULT_NODE_CACHE_ROOT, InvalidWarmModel, parse_spec
from warmpool_operator.model import Target
from warmpool_operator.rules import builders, scaling
from warmpool_operator.rules.builders import KV_PREFIX_MOUNT_PATH

from warmpool.contract.files import CONFIGMAP_KEY_HEATMAP, CONFIGMAP_KEY_PROMPTS, MODEL_MOUNT_PATH
from warmpool.contract.http import PATH_LIVEZ, PATH_READYZ, WORKER_PORT_NAME
from warmpool.contract.pods import (
    ANNOTATION_REVISION,
    ANNOTATION_SPEC_HASH,
    CONFIGMAP_SUFFIX,
    CONTROL_SECRET_SUFFIX,
    ENGINE_CONTAINER,
    ENV_POD_IP,
    LABEL_MANAGED_BY,
    LABEL_MODEL,
    MANAGED_BY,
    WORKER_CONTAINER,
)

pytestmark = pytest.mark.unit


def target(**overrides: Any) -> Target:
    spec: dict[str, Any] = {
        "model": {"hostPath": {"path": "/models/tiny"}, "revision": "r1"},
        "pool": {"replicas": 2, "minWarm": 1, "maxReplicas": 4},
        "warmup": {"prompts": ["hello"]},
    }
    for key, value in overrides.items():
        spec[key] = value
    return Target(name="tiny", namespace="ns", spec=parse_spec(spec))


def worker(dep: dict[str, Any]) -> dict[str, Any]:
    containers = dep["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == WORKER_CONTAINER)


def test_names_and_labels_are_deterministic() -> None:
    a, b = builders.build_deployment(target()), builders.build_deployment(target())
    assert a == b
    assert a["metadata"]["name"] == "tiny"
    assert builders.build_service(target())["metadata"]["name"] == "tiny"
    assert builders.build_configmap(target())["metadata"]["name"] == "tiny" + CONFIGMAP_SUFFIX
    assert builders.build_control_secret(target(), "t")["metadata"]["name"] == "tiny" + CONTROL_SECRET_SUFFIX
    labels = a["spec"]["template"]["metadata"]["labels"]
    assert labels[LABEL_MODEL] == "tiny"
    assert labels[LABEL_MANAGED_BY] == MANAGED_BY
    assert a["spec"]["selector"]["matchLabels"] == builders.selector_labels("tiny")
    assert builders.selector_string("tiny") == "app.kubernetes.io/component=worker,warmpool.dev/model=tiny"


def test_restricted_security_context() -> None:
    dep = builders.build_deployment(target())
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False


def test_probes_mean_warm() -> None:
    c = worker(builders.build_deployment(target()))
    assert c["startupProbe"]["httpGet"]["path"] == PATH_READYZ
    assert c["readinessProbe"]["httpGet"]["path"] == PATH_READYZ
    assert c["livenessProbe"]["httpGet"]["path"] == PATH_LIVEZ
    # the startup budget covers the whole warm-up timeout
    budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert budget >= 600


def test_a_deleted_pod_serves_on_until_every_kube_proxy_has_dropped_it() -> None:
    """Each container sleeps spec.pod.drainSeconds (the kubelet's own preStop sleep) before its
    SIGTERM, the engine behind a sidecar too: requests routed to the pod before its endpoint left
    still land.  0 stops at once."""
    sidecar = target(engine={"kind": "sidecar", "image": "vllm/vllm-openai:v0.6.0", "args": []})
    for t in (target(), sidecar):
        pod = builders.build_deployment(t)["spec"]["template"]["spec"]
        for container in pod["containers"]:
            assert container["lifecycle"]["preStop"] == {"sleep": {"seconds": DEFAULT_DRAIN_SECONDS}}
        assert pod["terminationGracePeriodSeconds"] == DEFAULT_DRAIN_SECONDS + builders.STOP_GRACE_SECONDS
    pod = builders.build_deployment(target(pod={"drainSeconds": 0}))["spec"]["template"]["spec"]
    assert all("lifecycle" not in c for c in pod["containers"]) and pod["terminationGracePeriodSeconds"] == 30
    with pytest.raises(InvalidWarmModel, match="drainSeconds"):
        parse_spec({"model": {"hostPath": {"path": "/m"}}, "pod": {"drainSeconds": 301}})


def test_rollout_keeps_warm_pods() -> None:
    strategy = builders.build_deployment(target())["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0


def test_revision_change_rolls_the_pool_and_nothing_else_does() -> None:
    base = builders.build_deployment(target())
    again = builders.build_deployment(target())
    moved = builders.build_deployment(target(model={"hostPath": {"path": "/models/tiny"}, "revision": "r2"}))
    assert base["spec"]["template"] == again["spec"]["template"]
    assert moved["spec"]["template"]["metadata"]["annotations"][ANNOTATION_REVISION] == "r2"
    assert moved["spec"]["template"] != base["spec"]["template"]
    hash_key = ANNOTATION_SPEC_HASH
    assert moved["metadata"]["annotations"][hash_key] != base["metadata"]["annotations"][hash_key]


def test_prompts_change_rolls_but_replicas_do_not_touch_template() -> None:
    base = builders.build_deployment(target())
    other = builders.build_deployment(target(warmup={"prompts": ["bye"]}))
    assert base["spec"]["template"] != other["spec"]["template"]
    scaled = builders.build_deployment(target(), replicas=3)
    assert scaled["spec"]["template"] == base["spec"]["template"]
    assert scaled["spec"]["replicas"] == 3


def test_worker_command_volumes_and_args() -> None:
    t = target(pod={"workerArgs": ["--device=cpu"], "resources": {"limits": {"memory": "2Gi"}}})
    dep = builders.build_deployment(t)
    c = worker(dep)
    assert c["command"] == ["warmpool", "worker", "serve"]
    args = c["args"]
    assert f"--model={MODEL_MOUNT_PATH}" in args
    assert f"--host=$({ENV_POD_IP})" in args
    assert args[-1] == "--device=cpu"
    assert any(a.startswith("--control-token-file=") for a in args)
    assert any(a.startswith("--prompts=") for a in args)
    assert c["resources"] == {"limits": {"memory": "2Gi"}}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["hostPath"]["path"] == "/models/tiny"
    assert volumes["config"]["configMap"]["name"] == "tiny-warmup"
    assert volumes["control"]["secret"]["secretName"] == "tiny-control"
    env = {e["name"]: e for e in c["env"]}
    assert env[ENV_POD_IP]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_model_sources() -> None:
    pvc = builders.build_deployment(target(model={"pvc": {"claimName": "weights", "path": "m/x"}}))
    vols = {v["name"]: v for v in pvc["spec"]["template"]["spec"]["volumes"]}
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mount = next(m for m in worker(pvc)["volumeMounts"] if m["name"] == "model")
    assert mount["subPath"] == "m/x" and mount["readOnly"] is True
    cache = builders.build_deployment(target(model={"nodeCache": {"key": "SmolLM2"}}))
    vols = {v["name"]: v for v in cache["spec"]["template"]["spec"]["volumes"]}
    assert vols["model"]["hostPath"]["path"] == f"{DEFAULT_NODE_CACHE_ROOT}/SmolLM2"


def test_desired_replicas_bounds() -> None:
    spec = target().spec
    assert scaling.desired_replicas(spec) == 2
    assert scaling.desired_replicas(spec, extra=1) == 3
    assert scaling.desired_replicas(spec, extra=10) == 4  # never above maxReplicas
    low = target(pool={"replicas": 0, "minWarm": 2, "maxReplicas": 4}).spec
    assert scaling.desired_replicas(low) == 2  # at least minWarm


def test_configmap_and_pdb() -> None:
    cm = builders.build_configmap(target())
    assert cm["data"][CONFIGMAP_KEY_PROMPTS].startswith("[")
    assert CONFIGMAP_KEY_HEATMAP not in cm["data"]
    no_prompts = builders.build_configmap(target(warmup={}))
    assert no_prompts["data"] == {}
    assert builders.build_pdb(target())["spec"]["minAvailable"] == 1
    assert builders.build_pdb(target(pool={"replicas": 1, "minWarm": 0}))["spec"]["maxUnavailable"] == 1


def test_builders_do_not_mutate_or_depend_on_call_order() -> None:
    t = target()
    before = copy.deepcopy(t.spec.model_dump())
    builders.build_deployment(t)
    builders.build_service(t)
    assert t.spec.model_dump() == before


def _expand(args: list[str], t: Target) -> list[str]:
    return [a.replace(f"$({ENV_POD_IP})", "127.0.0.1") for a in args]


def test_builtin_args_parse_with_the_workers_own_parser() -> None:
    from warmpool_worker.cli import build_parser

    t = target(warmup={"prompts": ["x"], "graphCapture": False, "kvPrefixPersistence": True})
    c = worker(builders.build_deployment(t))
    parsed = build_parser().parse_args(["serve", *_expand(c["args"], t)])
    assert parsed.graph_capture is False and str(parsed.kv_prefix_dir) == KV_PREFIX_MOUNT_PATH
    assert parsed.buckets == (32, 128, 512) and parsed.host == "127.0.0.1"


def test_sidecar_pod_has_engine_and_warmpool_sidecar() -> None:
    from warmpool_worker.cli import build_parser

    t = target(engine={"kind": "sidecar", "image": "vllm/vllm-openai:v0.6.0", "args": ["--model=/warmpool/model"]},
               pod={"resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}})
    dep = builders.build_deployment(t)
    containers = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
    engine, side = containers[ENGINE_CONTAINER], containers[WORKER_CONTAINER]
    assert engine["image"] == "vllm/vllm-openai:v0.6.0" and engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "resources" not in side  # the accelerator belongs to the engine
    assert side["command"] == ["warmpool", "worker", "sidecar"]
    parsed = build_parser().parse_args(["sidecar", *_expand(side["args"], t)])
    assert parsed.engine_url == "http://127.0.0.1:8000" and str(parsed.model_dir) == MODEL_MOUNT_PATH
    assert parsed.memory_source == "engine-kv"  # not the device reading vLLM's pre-allocation fills


def test_a_sleeping_sidecar_engine_listens_on_the_pods_loopback_only() -> None:
    """With spec.pool.sleep the engine runs in vLLM's dev mode, whose sleep and cache endpoints
    need no authentication: it listens on 127.0.0.1 (no container port), and the Service reaches
    it through the sidecar's port."""
    engine = {"kind": "sidecar", "image": "vllm/vllm-openai:v0.6.0", "args": ["--model=/warmpool/model"]}
    for pool, host, declared in (({"sleep": {"afterIdleSeconds": 60}}, ["--host=127.0.0.1"], False), ({}, [], True)):
        t = target(engine=engine, pool={"replicas": 1, "minWarm": 1, **pool})
        containers = {c["name"]: c for c in builders.build_deployment(t)["spec"]["template"]["spec"]["containers"]}
        served = containers[ENGINE_CONTAINER]
        assert served["args"] == ["--model=/warmpool/model", *host]
        assert ("ports" in served) is declared
        assert [port["name"] for port in containers[WORKER_CONTAINER]["ports"]] == [WORKER_PORT_NAME]
        assert all(port["name"] != WORKER_PORT_NAME for port in served.get("ports", []))
        # the sidecar's port, by the name the chart's NetworkPolicy opens (the engine's stays closed)
        assert builders.build_service(t)["spec"]["ports"][0]["targetPort"] == WORKER_PORT_NAME
    own = target(engine={**engine, "args": ["--host", "0.0.0.0"]}, pool={"sleep": {"afterIdleSeconds": 60}})
    containers = {c["name"]: c for c in builders.build_deployment(own)["spec"]["template"]["spec"]["containers"]}
    assert containers[ENGINE_CONTAINER]["args"] == ["--host", "0.0.0.0"]  # the user's own, as written


def test_kv_prefix_emptydir_has_a_size_limit() -> None:
    plain = builders.build_deployment(target())["spec"]["template"]["spec"]
    assert not any(v["name"] == "kv-prefix" for v in plain["volumes"])
    pod = builders.build_deployment(target(warmup={"prompts": ["x"], "kvPrefixPersistence": True}))
    volumes = {v["name"]: v for v in pod["spec"]["template"]["spec"]["volumes"]}
    assert volumes["kv-prefix"]["emptyDir"] == {"sizeLimit": builders.KV_PREFIX_SIZE_LIMIT}
    mounts = {m["name"]: m["mountPath"] for m in worker(pod)["volumeMounts"]}
    assert mounts["kv-prefix"] == KV_PREFIX_MOUNT_PATH


@pytest.mark.parametrize(
    ("resources", "threads"),
    [
        ({"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}, 1),  # the demo's example: a request only
        ({"requests": {"cpu": "4"}, "limits": {"cpu": "2"}}, 2),  # the limit wins: it is the quota
        ({"limits": {"cpu": "1500m"}}, 1),  # rounded down: 2 threads on 1.5 CPUs get throttled
        ({"requests": {"cpu": "250m"}}, 1),  # at least one
        ({"requests": {"cpu": 3}}, 3),  # an integer quantity
    ],
)
def test_builtin_worker_threads_follow_the_pods_cpu(resources: dict[str, Any], threads: int) -> None:
    args = worker(builders.build_deployment(target(pod={"resources": resources})))["args"]
    assert [a for a in args if a.startswith("--threads=")] == [f"--threads={threads}"]


def test_no_cpu_figure_leaves_threads_to_the_workers_cgroup() -> None:
    for pod in ({}, {"resources": {"limits": {"memory": "2Gi"}}}):
        args = worker(builders.build_deployment(target(pod=pod)))["args"]
        assert not any(a.startswith("--threads") for a in args)
