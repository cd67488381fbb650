"""What the operator puts on a WarmModel's children and their pods: child names, container
names, labels, annotations and environment variables.

Part of the contract: names both sides must agree on, each defined once (see warmpool/contract/__init__.py)."""

from __future__ import annotations

from warmpool.contract.api import API_GROUP

# --------------------------------------------------------------------------- 4. children, labels, annotations

#: Suffixes of a WarmModel's children ("<name><suffix>"); the Deployment, Service and PDB take the bare name.
CONFIGMAP_SUFFIX = "-warmup"
CONTROL_SECRET_SUFFIX = "-control"
#: The pool's worker NetworkPolicy in cluster-wide mode (not the bare name, which a team's own policy
#: for those pods may hold, nor the chart's "<release>-workers").
WORKER_POLICY_SUFFIX = "-worker-policy"
#: Key of the control-token Secret holding the bearer token of POST /control/tier.
CONTROL_SECRET_KEY = "token"
#: Name of the worker container in worker pods (the one that holds the model for builtin).
WORKER_CONTAINER = "worker"
#: Name of the external engine's container (sidecar engine only).
ENGINE_CONTAINER = "engine"

# Labels the operator puts on its children and their pods.
LABEL_MODEL = f"{API_GROUP}/model"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
APP_NAME = "warmpool"
#: app.kubernetes.io/component of worker pods.
COMPONENT_WORKER = "worker"
MANAGED_BY = "warmpool-operator"

#: On worker pods: "true" while the pod takes the Service's traffic.  The pod template sets
#: it true (so with the operator down every Ready pod serves); the operator sets it false before
#: a pod sleeps and true again once it is awake.  Never part of the Deployment's selector.
LABEL_AWAKE = f"{API_GROUP}/awake"
AWAKE_TRUE = "true"
AWAKE_FALSE = "false"

# Annotations written by the operator.
ANNOTATION_TIER = f"{API_GROUP}/tier"  # on pods: the tier the operator decided
ANNOTATION_REVISION = f"{API_GROUP}/revision"
ANNOTATION_POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
#: Pod-template annotation: hash of what is baked into the pods besides the spec (prompts).
ANNOTATION_CONFIG_HASH = f"{API_GROUP}/config-hash"
#: Pod-template annotation of an http/s3 source's pods: the digest (sha256:<hex>) of the node-cache
#: revision they mount.  The node agent never evicts a revision a pod on its node names here
#: (an older revision's pods during a rollout included), so it needs no view of their processes.
ANNOTATION_CACHE_REVISION = f"{API_GROUP}/cache-revision"
#: Annotation on each child: hash of the desired object, so reconcile compares one string.
ANNOTATION_SPEC_HASH = f"{API_GROUP}/spec-hash"

# --------------------------------------------------------------------------- 6. environment variables

# Set by the operator on worker pods.
ENV_POD_IP = "POD_IP"
ENV_POD_NAME = "POD_NAME"
ENV_NODE_NAME = "NODE_NAME"
#: vLLM serves its sleep API only with this set to 1: the operator sets it on the engine
#: container of a sidecar pool with spec.pool.sleep.
ENV_VLLM_SERVER_DEV_MODE = "VLLM_SERVER_DEV_MODE"

# --------------------------------------------------------------------------- termination message

#: Where the worker container writes its last error when it exits on one (the pod spec's
#: terminationMessagePath): the kubelet copies it into the container's lastState.terminated.message,
#: which the operator carries into the WarmModel's conditions.
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
#: The most of that file the kubelet keeps (it truncates past this): the worker writes no more.
TERMINATION_MESSAGE_MAX_BYTES = 4096
