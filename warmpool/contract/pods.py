"""What the operator puts on a WarmModel's children and their pods: child names, container
names, labels, annotations and environment variables.

Part of the contract: names both sides must agree on, each defined once (see warmpool/contract/__init__.py)."""

from __future__ import annotations

from warmpool.contract.api import API_GROUP

# --------------------------------------------------------------------------- 4. children, labels, annotations

#: Suffixes of a WarmModel's children ("<name><suffix>"); the Deployment, Service and PDB take the bare name.
CONFIGMAP_SUFFIX = "-warmup"
CONTROL_SECRET_SUFFIX = "-control"
#: The ConfigMap persisting a WarmModel's request history (operator/warmpool_operator/io/history_store.py).
HISTORY_CONFIGMAP_SUFFIX = "-history"
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
#: app.kubernetes.io/component of the ConfigMap holding a WarmModel's request history.
COMPONENT_HISTORY = "history"
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

# OpenTelemetry's own variables (the standard names): tracing is on only when an endpoint is set.
ENV_OTEL_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTEL_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
#: The share of requests after the first that the worker traces (0..1).
ENV_OTEL_SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"
DEFAULT_REQUEST_SAMPLE_RATIO = 0.01
#: Service names in traces (OTEL_SERVICE_NAME overrides).
TRACE_SERVICE_WORKER = "warmpool-worker"
TRACE_SERVICE_OPERATOR = "warmpool-operator"

# Span names: the worker's cold start (one trace per pod start; children in phase order) ...
SPAN_COLD_START = "cold_start"
SPAN_IMPORTS = "interpreter_and_imports"
SPAN_WEIGHTS_MAPPED = "weights_mapped"
SPAN_LAYER = "layer_materialised"
SPAN_PREFILL = "warmup_prefill"
SPAN_GRAPH_CAPTURE = "graph_capture"
SPAN_READY = "ready"
SPAN_FIRST_REQUEST = "first_request"
SPAN_REQUEST = "request"
SPAN_TIER_APPLIED = "tier_directive_applied"
# ... and the operator's reconcile pass.
SPAN_RECONCILE = "reconcile"
SPAN_APPLY = "apply"
SPAN_SCRAPE = "scrape"
SPAN_DECIDE = "decide"
SPAN_STATUS = "status"

# Span attributes.
ATTR_POD = "k8s.pod.name"
ATTR_DIGEST = "warmpool.model.digest"
ATTR_TIER = "warmpool.tier"
ATTR_DEVICE = "warmpool.device"
ATTR_LAYER = "warmpool.layer"
ATTR_BUCKET = "warmpool.bucket"
ATTR_TOKENS = "warmpool.tokens"
ATTR_WARMMODEL_UID = "warmpool.warmmodel.uid"
ATTR_WARMMODEL = "warmpool.warmmodel"

#: ``--log-format`` values of `warmpool worker ...` and `warmpool operator`.
LOG_FORMAT_TEXT = "text"
LOG_FORMAT_JSON = "json"
LOG_FORMATS = (LOG_FORMAT_TEXT, LOG_FORMAT_JSON)
