"""Pure builders: a WarmModel in, the Kubernetes objects it owns out (plain dicts).

Nothing here talks to the API server, reads the clock or draws random numbers, so the same
WarmModel always gives byte-identical children: reconcile compares one hash per child and
an operator restart never rolls the pool by accident.  Owner references are added by the
handlers (``kopf.adopt``), not here, so these functions need nothing but the spec.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from warmpool.contract.files import CONFIGMAP_KEY_HEATMAP, CONFIGMAP_KEY_PROMPTS, MODEL_MOUNT_PATH
from warmpool.contract.http import PATH_LIVEZ, PATH_READYZ, WORKER_PORT_NAME
from warmpool.contract.pods import (
    ANNOTATION_CACHE_REVISION,
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_REVISION,
    ANNOTATION_SPEC_HASH,
    APP_NAME,
    AWAKE_TRUE,
    COMPONENT_WORKER,
    CONFIGMAP_SUFFIX,
    CONTROL_SECRET_KEY,
    CONTROL_SECRET_SUFFIX,
    ENGINE_CONTAINER,
    ENV_NODE_NAME,
    ENV_POD_IP,
    ENV_POD_NAME,
    ENV_VLLM_SERVER_DEV_MODE,
    LABEL_AWAKE,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_MODEL,
    LABEL_NAME,
    MANAGED_BY,
    TERMINATION_MESSAGE_PATH,
    WORKER_CONTAINER,
    WORKER_POLICY_SUFFIX,
)
from warmpool.contract.zero import ANNOTATION_COLD_START_TRACE, ENV_COLD_START_TRACE
from warmpool_operator.api.types import EnvVar, ResourceRequirements, TopologySpreadConstraint, WarmModelSpec
from warmpool_operator.model import Obj, Target
from warmpool_operator.rules import object_store_pods
from warmpool_operator.rules.scaling import desired_replicas

CONTROL_MOUNT_PATH = "/warmpool/control"  # the control-token Secret
PROMPTS_MOUNT_PATH = "/warmpool/prompts"  # a user's prompts ConfigMap (promptsConfigMapRef)
CONFIG_MOUNT_PATH = "/warmpool/config"  # the WarmModel's ConfigMap (prompts + heat map)
KV_PREFIX_MOUNT_PATH = "/warmpool/kv"  # warm-prefix KV persistence (emptyDir)
SHM_MOUNT_PATH = "/dev/shm"  # spec.pod.shmSize (an emptyDir of medium Memory)
#: Key of the WarmModel's ConfigMap holding the warm-up lengths learned from traffic
#: (spec.warmup.learnBuckets): a JSON object {"format": LEARNED_BUCKETS_FORMAT, "buckets": [...]};
#: a worker started while it is there warms at those lengths instead of --buckets.
CONFIGMAP_KEY_LEARNED_BUCKETS = "learned-buckets.json"


#: Bound of the warm-prefix KV emptyDir.  The worker writes one file per warm-up prompt
#: (buckets x prompts per bucket): a few hundred MB for an 8B model at the default buckets,
#: about 1 GB for a 70B one.  Without a bound a runaway writer fills the node's disk and
#: every pod on it is evicted; with one, only this pod is (the kubelet enforces it).
KV_PREFIX_SIZE_LIMIT = "8Gi"


# --------------------------------------------------------------------------------- names


def deployment_name(name: str) -> str:
    return name


def service_name(name: str) -> str:
    return name


def pdb_name(name: str) -> str:
    return name


def configmap_name(name: str) -> str:
    return f"{name}{CONFIGMAP_SUFFIX}"


def control_secret_name(name: str) -> str:
    return f"{name}{CONTROL_SECRET_SUFFIX}"


def selector_labels(name: str) -> dict[str, str]:
    """The worker pods' selector: immutable on a Deployment, so only stable identity labels."""
    return {LABEL_MODEL: name, LABEL_COMPONENT: COMPONENT_WORKER}


def selector_string(name: str) -> str:
    """The selector in the scale subresource's string form (status.selector)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def service_selector(name: str) -> dict[str, str]:
    """The Service's selector: the pool's pods that are awake (warmpool.dev/awake=true).

    The pod template sets the label true, so with the operator down every Ready pod serves;
    the operator sets it false before a pod sleeps.  Never in the Deployment's selector (that
    is immutable, and a relabelled pod must stay the Deployment's)."""
    return {**selector_labels(name), LABEL_AWAKE: AWAKE_TRUE}


def common_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: name,
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def pod_labels(name: str) -> dict[str, str]:
    """The worker pods' labels, as the template sets them (awake at birth: the Service routes to a
    new pod as soon as it is Ready, operator or not).  What NetworkPolicies select the pods by."""
    return {**common_labels(name), LABEL_AWAKE: AWAKE_TRUE}


def spec_hash(obj: Mapping[str, Any]) -> str:
    """A short stable hash of a desired object (sorted-key JSON)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _metadata(target: Target, name: str) -> Obj:
    return {"name": name, "namespace": target.namespace, "labels": common_labels(target.name)}


def stamp(obj: Obj) -> Obj:
    """Put the hash of the object's desired content into its own annotations."""
    body = {k: v for k, v in obj.items() if k != "metadata"}
    body["labels"] = obj["metadata"].get("labels", {})
    obj["metadata"].setdefault("annotations", {})[ANNOTATION_SPEC_HASH] = spec_hash(body)
    return obj


# --------------------------------------------------------------------------------- ConfigMap


def prompts_payload(spec: WarmModelSpec) -> str | None:
    """The prompts file the operator writes (inline prompts only), or None."""
    if spec.warmup.prompts is None:
        return None
    return json.dumps(list(spec.warmup.prompts), ensure_ascii=False, indent=1)


def build_configmap(target: Target, heatmap_json: str | None = None) -> Obj:
    """The WarmModel's ConfigMap: inline warm-up prompts and the learned heat map.

    The heat map is owned by :mod:`warmpool_operator.rules.heat`; reconcile patches only the
    prompts key so a learned heat map is never thrown away.
    """
    data: dict[str, str] = {}
    prompts = prompts_payload(target.spec)
    if prompts is not None:
        data[CONFIGMAP_KEY_PROMPTS] = prompts
    if heatmap_json is not None:
        data[CONFIGMAP_KEY_HEATMAP] = heatmap_json
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(target, configmap_name(target.name)),
        "data": data,
    }


# --------------------------------------------------------------------------------- Secret


def build_control_secret(target: Target, token: str) -> Obj:
    """The control-token Secret; the token is derived by the caller (rules/control_token.py)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(target, control_secret_name(target.name)),
        "type": "Opaque",
        "data": {CONTROL_SECRET_KEY: base64.b64encode(token.encode()).decode()},
    }


# --------------------------------------------------------------------------------- Service, PDB


def build_service(target: Target) -> Obj:
    """The pool's Service.  A scale-to-zero pool's has no selector: the operator writes its
    EndpointSlices itself (the awake warm pods', else the activator's: rules/zero.py), and the
    port is then the pods' number (an EndpointSlice's port is a number, and both kinds of
    endpoint are reached by the Service port's name)."""
    port = target.spec.pod.port
    spec: Obj = {
        "ports": [{"name": WORKER_PORT_NAME, "port": port, "protocol": "TCP",
                   "targetPort": port if target.spec.pool.scale_to_zero else WORKER_PORT_NAME}],
        # Warm pods only: unready (cold) pods never get traffic.
        "publishNotReadyAddresses": False,
    }
    if target.spec.pool.scale_to_zero is None:
        spec["selector"] = service_selector(target.name)
    return stamp({"apiVersion": "v1", "kind": "Service", "metadata": _metadata(target, service_name(target.name)),
                   "spec": spec})


def build_pdb(target: Target) -> Obj:
    """Voluntary disruptions (drains) may never take the pool below minWarm pods.

    minAvailable counts Ready pods, and Ready means warm (the readiness probe is /readyz).
    minWarm 0 -> maxUnavailable 1 instead, so a drain is never blocked for nothing.
    """
    pool = target.spec.pool
    budget: Obj = {"minAvailable": pool.min_warm} if pool.min_warm > 0 else {"maxUnavailable": 1}
    return stamp(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _metadata(target, pdb_name(target.name)),
            "spec": {**budget, "selector": {"matchLabels": selector_labels(target.name)}},
        }
    )


def network_policy_name(name: str) -> str:
    return f"{name}{WORKER_POLICY_SUFFIX}"


def build_network_policy(target: Target, ingress: Sequence[Mapping[str, Any]]) -> Obj:
    """The pool's worker NetworkPolicy (cluster-wide mode, where the chart cannot know the
    namespaces): the ingress rules the chart renders for its own worker policies
    (``--worker-policy-ingress``), over this pool's pods.

    The pods are selected by the pool's selector labels, never the awake label: a pod put to
    sleep loses that, and a policy selecting by it would leave a sleeping pod open to all."""
    return stamp(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(target, network_policy_name(target.name)),
            "spec": {
                "podSelector": {"matchLabels": selector_labels(target.name)},
                "policyTypes": ["Ingress"],
                "ingress": [dict(rule) for rule in ingress],
            },
        }
    )


# --------------------------------------------------------------------------------- Deployment


def _env(items: list[EnvVar] | None) -> list[Obj]:
    out: list[Obj] = []
    for item in items or []:
        entry = item.model_dump(by_alias=True, exclude_none=True)
        out.append(entry)
    return out


#: Where the sidecar reaches the external engine, inside the pod.
ENGINE_LOOPBACK = "127.0.0.1"


def _engine_env(spec: WarmModelSpec) -> list[Obj]:
    """The external engine's environment; with spec.pool.sleep, VLLM_SERVER_DEV_MODE=1 (vLLM
    serves its sleep API only then), unless the user sets that variable themselves."""
    env = _env(spec.engine.env)
    if spec.pool.sleep is not None and all(e["name"] != ENV_VLLM_SERVER_DEV_MODE for e in env):
        env.append({"name": ENV_VLLM_SERVER_DEV_MODE, "value": "1"})
    return env


def _worker_args(target: Target) -> list[str]:
    """The worker's arguments: shared warm-up/gating flags, then the mode's own, then the user's."""
    spec = target.spec
    gating = spec.gating
    warmup = spec.warmup
    args = [
        f"--host=$({ENV_POD_IP})",
        f"--port={spec.pod.port}",
        f"--heat-map={CONFIG_MOUNT_PATH}/{CONFIGMAP_KEY_HEATMAP}",
        f"--buckets={','.join(str(b) for b in warmup.buckets)}",
        f"--truncate-at={gating.truncate_at_percent}",
        f"--pause-at={gating.pause_at_percent}",
        f"--hysteresis={gating.hysteresis_percent}",
        f"--hot-layer-percent={gating.hot_layer_percent}",
        f"--control-token-file={CONTROL_MOUNT_PATH}/{CONTROL_SECRET_KEY}",
        f"--warmup-timeout={warmup.timeout_seconds}",
    ]
    if warmup.learn_buckets:  # the operator writes the key once it has learned them
        args.append(f"--learned-buckets={CONFIG_MOUNT_PATH}/{CONFIGMAP_KEY_LEARNED_BUCKETS}")
    if warmup.prompts is not None:
        args.append(f"--prompts={CONFIG_MOUNT_PATH}/{CONFIGMAP_KEY_PROMPTS}")
    elif warmup.prompts_config_map_ref is not None:
        args.append(f"--prompts={PROMPTS_MOUNT_PATH}/{CONFIGMAP_KEY_PROMPTS}")
    if spec.engine.kind == "sidecar":
        # The sidecar prefetches the weights the engine reads, warms the engine over HTTP on the
        # pod's shared loopback, and passes the pool's traffic (/v1/...) on to it.
        args += [
            f"--engine-url=http://{ENGINE_LOOPBACK}:{spec.engine.port}",
            f"--health-path={spec.engine.health_path}",
            f"--model-dir={MODEL_MOUNT_PATH}",
            # vLLM pre-allocates ~90 % of the GPU at start, so a device-wide reading beside it would
            # hold the pod paused for good; the engine's KV-cache use is the pressure that matters.
            # An engine that exports no such gauge reads Unknown (full warm-up), never 0 % used.
            "--memory-source=engine-kv",
        ]
        if spec.model.served_name:
            args.append(f"--served-model-name={spec.model.served_name}")
    else:
        args += [
            f"--model={target.cache.model_path if target.cache is not None else MODEL_MOUNT_PATH}",
            f"--model-name={spec.model.served_name or target.name}",
            "--graph-capture" if warmup.graph_capture else "--no-graph-capture",
        ]
        if target.cache is not None and target.cache.partial:
            args.append("--partial-cache")  # the model is a partial view still filling (rules/object_store_pods.py)
        if warmup.kv_prefix_persistence:
            args.append(f"--kv-prefix-dir={KV_PREFIX_MOUNT_PATH}")
        threads = torch_threads(spec.pod.resources)
        if threads is not None:
            args.append(f"--threads={threads}")
    return args + list(spec.pod.worker_args or [])


def _cpu_cores(quantity: int | str | None) -> Decimal | None:
    """A CPU quantity ("2", "1.5", "500m") in cores; None when absent or not a plain CPU figure."""
    if quantity is None:
        return None
    text = str(quantity).strip()
    scale = Decimal(1)
    if text.endswith("m"):
        text, scale = text[:-1], Decimal("0.001")
    try:
        cores = Decimal(text) * scale
    except InvalidOperation:
        return None
    return cores if cores.is_finite() and cores > 0 else None


def torch_threads(resources: ResourceRequirements | None) -> int | None:
    """Intra-op threads for the built-in engine: the container's CPU limit, else its request.

    The worker would read its cgroup quota itself, but a pod with only a CPU request has no
    quota to read, and torch would then spin one thread per node core against every other
    worker on the node (a 32-token prefill went from ~0.2 s to 2 s with two workers on two
    cores).  The request is what the scheduler reserved for the pod, so it is the honest share.
    Rounded down (1.5 CPUs -> 1 thread: two busy threads on 1.5 CPUs are throttled), at least 1.
    None when neither is set: the worker then sizes itself from its cgroup.
    """
    if resources is None:
        return None
    for values in (resources.limits, resources.requests):
        cores = _cpu_cores((values or {}).get("cpu"))
        if cores is not None:
            return max(1, int(cores))
    return None


def _model_volume(target: Target) -> tuple[Obj, Obj]:
    """The model's volume and its read-only mount (at MODEL_MOUNT_PATH; for an object-store source
    only the namespace's link to its revision in the node cache: rules/object_store_pods.py)."""
    mount: Obj = {"name": "model", "mountPath": MODEL_MOUNT_PATH, "readOnly": True}
    model = target.spec.model
    if model.object_store() is not None:
        if target.cache is None:
            raise ValueError("spec.model is an object-store source but the revision's digest is not known yet")
        return object_store_pods.model_volume(target.cache)
    if model.pvc is not None:
        volume: Obj = {"name": "model", "persistentVolumeClaim": {"claimName": model.pvc.claim_name, "readOnly": True}}
        if model.pvc.path:
            mount["subPath"] = model.pvc.path
    elif model.host_path is not None:
        volume = {"name": "model", "hostPath": {"path": model.host_path.path, "type": "Directory"}}
    elif model.node_cache is not None:
        path = f"{model.node_cache.root.rstrip('/')}/{model.node_cache.key}"
        volume = {"name": "model", "hostPath": {"path": path, "type": "Directory"}}
    else:  # parse_spec guarantees exactly one source; this keeps the type checker honest
        raise ValueError("spec.model has no source")
    return volume, mount


def _probes(spec: WarmModelSpec) -> Obj:
    # Every second, the kubelet's finest: the pod turns Ready within a period of its worker's
    # /readyz 200, and at 2 s that wait was a quarter of a new pod's start (`bench podstart`).
    # A /readyz answer is a few hundred bytes from memory, so the extra probes cost nothing.
    period = 1
    # The startup probe covers the whole warm-up (plus a margin for loading): a worker that
    # is still warming is not killed, and one stuck past the budget is restarted.
    startup_failures = max(30, math.ceil((spec.warmup.timeout_seconds + 120) / period))
    return {
        "startupProbe": {
            "httpGet": {"path": PATH_READYZ, "port": "http"},
            "periodSeconds": period,
            "timeoutSeconds": 2,
            "failureThreshold": min(startup_failures, 10000),
        },
        "readinessProbe": {
            "httpGet": {"path": PATH_READYZ, "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 2,
            "successThreshold": 1,
        },
        "livenessProbe": {
            "httpGet": {"path": PATH_LIVEZ, "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
    }


RESTRICTED_CONTAINER_SECURITY: Obj = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_POD_SECURITY: Obj = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "fsGroup": 65532,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _volumes(target: Target) -> tuple[Obj, list[Obj], list[Obj]]:
    """(the model's mount, the worker's mounts, the pod's volumes)."""
    spec = target.spec
    model_volume, model_mount = _model_volume(target)
    mounts: list[Obj] = [
        model_mount,
        {"name": "config", "mountPath": CONFIG_MOUNT_PATH, "readOnly": True},
        {"name": "control", "mountPath": CONTROL_MOUNT_PATH, "readOnly": True},
        # readOnlyRootFilesystem: scratch space (torch, tokenizers) goes to /tmp.
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[Obj] = [
        model_volume,
        {"name": "config", "configMap": {"name": configmap_name(target.name), "optional": False}},
        {
            "name": "control",
            "secret": {"secretName": control_secret_name(target.name), "defaultMode": 0o400},
        },
        {"name": "tmp", "emptyDir": {}},
    ]
    ref = spec.warmup.prompts_config_map_ref
    if ref is not None:
        mounts.append({"name": "prompts", "mountPath": PROMPTS_MOUNT_PATH, "readOnly": True})
        volumes.append(
            {
                "name": "prompts",
                "configMap": {"name": ref.name, "items": [{"key": ref.key, "path": CONFIGMAP_KEY_PROMPTS}]},
            }
        )
    if spec.warmup.kv_prefix_persistence:
        mounts.append({"name": "kv-prefix", "mountPath": KV_PREFIX_MOUNT_PATH})
        volumes.append({"name": "kv-prefix", "emptyDir": {"sizeLimit": KV_PREFIX_SIZE_LIMIT}})
    shared_mounts, shared_volumes = _user_volumes(spec)
    return model_mount, mounts + shared_mounts, volumes + shared_volumes


def _user_volumes(spec: WarmModelSpec) -> tuple[list[Obj], list[Obj]]:
    """spec.pod's shared memory and extra volumes: (the mounts every main container gets, the volumes).

    The host paths among them were checked against the allowed prefixes before any child was made
    (rules/host_paths.py), as a hostPath model's are."""
    pod = spec.pod
    mounts: list[Obj] = []
    volumes: list[Obj] = []
    if pod.shm_size is not None:
        mounts.append({"name": "shm", "mountPath": SHM_MOUNT_PATH})
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": pod.shm_size}})
    volumes += [v.model_dump(by_alias=True, exclude_none=True) for v in pod.extra_volumes or ()]
    mounts += [m.model_dump(by_alias=True, exclude_none=True) for m in pod.extra_volume_mounts or ()]
    return mounts, volumes


def _worker_container(target: Target, mounts: list[Obj]) -> Obj:
    spec = target.spec
    pod = spec.pod
    env: list[Obj] = [
        {"name": ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": ENV_NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "HOME", "value": "/tmp"},
        *_env(pod.worker_env),
    ]
    if spec.pool.scale_to_zero is not None:
        # The hold a pod leaving zero starts for (empty without the annotation): its cold start joins that trace.
        field_path = f"metadata.annotations['{ANNOTATION_COLD_START_TRACE}']"
        env.insert(3, {"name": ENV_COLD_START_TRACE, "valueFrom": {"fieldRef": {"fieldPath": field_path}}})
    worker: Obj = {
        "name": WORKER_CONTAINER,
        "image": target.worker_image,
        "command": ["warmpool", "worker", "sidecar" if spec.engine.kind == "sidecar" else "serve"],
        "args": _worker_args(target),
        "ports": [{"name": WORKER_PORT_NAME, "containerPort": pod.port, "protocol": "TCP"}],
        "env": env,
        "volumeMounts": mounts,
        "securityContext": dict(RESTRICTED_CONTAINER_SECURITY),
        # A worker that fails to start writes its last error here (else its log's tail is taken):
        # the kubelet puts it in the pod's lastState.terminated.message, and the WarmModel's
        # conditions carry it, so `kubectl describe wm` shows why.
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **_probes(spec),
    }
    if pod.image_pull_policy:
        worker["imagePullPolicy"] = pod.image_pull_policy
    # With an external engine, the engine holds the model and the accelerator: the resources are its.
    if pod.resources is not None and spec.engine.kind != "sidecar":
        worker["resources"] = pod.resources.model_dump(by_alias=True, exclude_none=True)
    return worker


def _engine_container(target: Target, model_mount: Obj) -> Obj:
    """The external engine beside the warmpool sidecar (the worker's `sidecar` mode), which owns readiness."""
    spec = target.spec
    engine: Obj = {
        "name": ENGINE_CONTAINER,
        "image": spec.engine.image,
        "ports": [{"name": "engine", "containerPort": spec.engine.port, "protocol": "TCP"}],
        "env": _engine_env(spec),
        "volumeMounts": [model_mount, {"name": "tmp", "mountPath": "/tmp"}, *_user_volumes(spec)[0]],
        "securityContext": dict(RESTRICTED_CONTAINER_SECURITY),
    }
    if spec.engine.command:
        engine["command"] = list(spec.engine.command)
    args = list(spec.engine.args or [])
    if spec.pool.sleep is not None and not any(a == "--host" or a.startswith("--host=") for a in args):
        # Dev mode serves the engine's sleep and cache endpoints without authentication: the
        # engine listens on the pod's loopback only, and the sidecar passes the traffic on.
        args.append(f"--host={ENGINE_LOOPBACK}")
        del engine["ports"]
    if args:
        engine["args"] = args
    if spec.pod.resources is not None:
        engine["resources"] = spec.pod.resources.model_dump(by_alias=True, exclude_none=True)
    return engine


#: Seconds a stopping worker has to finish the requests in flight (after spec.pod.drainSeconds).
STOP_GRACE_SECONDS = 30


def _pod_spec(target: Target, containers: list[Obj], volumes: list[Obj]) -> Obj:
    pod = target.spec.pod
    if pod.drain_seconds:
        # Each container, the engine behind a sidecar too, waits before its SIGTERM while the pod
        # leaves every kube-proxy; the kubelet sleeps itself (no binary needed in the image).
        for container in containers:
            container["lifecycle"] = {"preStop": {"sleep": {"seconds": pod.drain_seconds}}}
    pod_spec: Obj = {
        "containers": containers,
        "volumes": volumes,
        "securityContext": dict(RESTRICTED_POD_SECURITY),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # Long enough to drain and finish a request in flight, short enough for rollouts.
        "terminationGracePeriodSeconds": pod.drain_seconds + STOP_GRACE_SECONDS,
    }
    if target.cache is not None:
        # The operator's own worker image, never the WarmModel's: the wait mounts the whole cache
        # (every tenant's revisions on the node), and must not run code a WarmModel author chose.
        pod_spec["initContainers"] = [object_store_pods.wait_container(
            target.cache, target.default_worker_image, RESTRICTED_CONTAINER_SECURITY)]
    affinity = _affinity(target)
    if affinity:
        pod_spec["affinity"] = affinity
    if pod.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [_spread(target, c) for c in pod.topology_spread_constraints]
    if pod.runtime_class_name:
        pod_spec["runtimeClassName"] = pod.runtime_class_name
    if pod.service_account_name:
        pod_spec["serviceAccountName"] = pod.service_account_name
    if pod.node_selector:
        pod_spec["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in pod.tolerations]
    if pod.priority_class_name:
        pod_spec["priorityClassName"] = pod.priority_class_name
    if pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in pod.image_pull_secrets]
    return pod_spec


def _affinity(target: Target) -> Obj:
    """spec.pod.affinity, with an object-store source's preference for nodes holding its revision
    after the user's own preferences."""
    affinity: Obj = (target.spec.pod.affinity.model_dump(by_alias=True, exclude_none=True)
                     if target.spec.pod.affinity is not None else {})
    if target.cache is not None:
        ours = object_store_pods.preferred_affinity(target.cache)["nodeAffinity"]
        key = "preferredDuringSchedulingIgnoredDuringExecution"
        node = affinity.setdefault("nodeAffinity", {})
        node[key] = [*node.get(key, []), *ours[key]]
    return affinity


def _spread(target: Target, constraint: TopologySpreadConstraint) -> Obj:
    """A topology spread constraint; without a labelSelector it counts this pool's pods."""
    out = constraint.model_dump(by_alias=True, exclude_none=True)
    out.setdefault("labelSelector", {"matchLabels": selector_labels(target.name)})
    return out


def build_pod_template(target: Target, cold_start_trace: str | None = None) -> Obj:
    """``cold_start_trace``: the hold a pool leaving zero starts its pods for (warmpool/contract/zero.py)."""
    spec = target.spec
    model_mount, mounts, volumes = _volumes(target)
    containers = [_worker_container(target, mounts)]
    if spec.engine.kind == "sidecar":
        containers.append(_engine_container(target, model_mount))
    annotations = {
        # The user's first: the API refuses keys of ours there, and ours win should one slip through.
        **(spec.pod.annotations or {}),
        ANNOTATION_REVISION: spec.model.revision or "",
        # Prompts are baked into warm-up: a change must roll the pool like a revision does.
        ANNOTATION_CONFIG_HASH: spec_hash({"prompts": prompts_payload(spec)}),
    }
    if target.cache is not None:  # the node agent's pin on the revision these pods mount
        annotations[ANNOTATION_CACHE_REVISION] = target.cache.digest
    if cold_start_trace is not None:
        annotations[ANNOTATION_COLD_START_TRACE] = cold_start_trace
    return {
        "metadata": {"labels": {**(spec.pod.labels or {}), **pod_labels(target.name)}, "annotations": annotations},
        "spec": _pod_spec(target, containers, volumes),
    }


def build_deployment(target: Target, replicas: int | None = None, cold_start_trace: str | None = None) -> Obj:
    """The worker Deployment.

    RollingUpdate with maxUnavailable 0 and maxSurge 1: a revision change brings up one new
    pod at a time and removes an old, warm pod only once the new one is Ready, which its
    readiness probe (/readyz) says only when it is warm.  ``replicas`` defaults to
    :func:`desired_replicas` of the spec; ``cold_start_trace``: see :func:`build_pod_template`.
    """
    count = desired_replicas(target.spec) if replicas is None else replicas
    return stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _metadata(target, deployment_name(target.name)),
            "spec": {
                "replicas": count,
                "selector": {"matchLabels": selector_labels(target.name)},
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                "revisionHistoryLimit": 3,
                # A pod counts as available only once it has stayed Ready (warm) a moment.
                "minReadySeconds": 0,
                "progressDeadlineSeconds": max(600, target.spec.warmup.timeout_seconds + 300),
                "template": build_pod_template(target, cold_start_trace),
            },
        }
    )
