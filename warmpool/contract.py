"""The one place that owns every name the operator and the worker must agree on.

Metric names, label names, tier names, default thresholds, annotation keys, HTTP paths
and environment variables live here and nowhere else.  Both sides import this module;
it imports nothing heavy, so it costs nothing on the worker's start path.

Grouped by topic, each name defined once:

1. the WarmModel API: identity, status conditions, what kopf stores on it;
2. the WarmModel's defaults and bounds;
3. tiers and their thresholds, and the operator's directives;
4. the WarmModel's children: names, containers, labels and annotations;
5. the worker's HTTP surface: paths, ports, the control body, /readyz stages;
6. environment variables;
7. metrics: names (worker, sidecar, external engines, operator) and label names;
8. files: ConfigMap keys, the heat map format, mount paths in worker pods.
"""

from __future__ import annotations

from enum import StrEnum

# --------------------------------------------------------------------------- 1. the WarmModel API

API_GROUP = "warmpool.dev"
API_VERSION = "v1alpha1"
KIND = "WarmModel"
PLURAL = "warmmodels"
SINGULAR = "warmmodel"
SHORT_NAME = "wm"
CRD_NAME = f"{PLURAL}.{API_GROUP}"

#: Status condition types of a WarmModel (each has a CamelCase reason and a message).
CONDITION_READY = "Ready"  # at least pool.minWarm pods verified warm
CONDITION_PROGRESSING = "Progressing"  # a rollout or scale is under way
CONDITION_DEGRADED = "Degraded"  # something is wrong that retrying will not fix (bad spec, ...)
CONDITION_WARMUP_GATED = "WarmupGated"  # some pods run a truncated or paused warm-up
CONDITION_TYPES = (CONDITION_READY, CONDITION_PROGRESSING, CONDITION_DEGRADED, CONDITION_WARMUP_GATED)

#: Prefix of kopf's own annotations on WarmModels (progress and diff-base storage).
KOPF_ANNOTATION_PREFIX = API_GROUP
#: kopf's finalizer on WarmModels (timers need one so they are stopped before deletion).
OPERATOR_FINALIZER = f"{API_GROUP}/operator"

# --------------------------------------------------------------------------- 2. defaults and bounds

DEFAULT_REPLICAS = 1
DEFAULT_MIN_WARM = 1
DEFAULT_MAX_REPLICAS = 8
#: Hard ceiling on pool sizes accepted at admission (a typo like 10000 is refused).
MAX_POOL_REPLICAS = 1000
DEFAULT_WARMUP_TIMEOUT_SECONDS = 600
#: Longest WarmModel name: children are named "<name>-<suffix>" and must stay DNS-1035 labels.
MAX_WARMMODEL_NAME_LENGTH = 48
#: Default image of the warmpool worker (the whole worker for builtin, the sidecar for sidecar).
DEFAULT_WORKER_IMAGE = "ghcr.io/warmpool/worker:0.1.0"
#: Default seconds between scrapes of a WarmModel's worker pods.
DEFAULT_SCRAPE_INTERVAL_SECONDS = 10.0

# --------------------------------------------------------------------------- 3. tiers and thresholds


class Tier(StrEnum):
    """How much warm-up a worker does, from the live accelerator-memory level."""

    FULL = "full"
    TRUNCATED = "truncated"
    PAUSED = "paused"
    UNKNOWN = "unknown"  # metrics missing, stale or garbage: never read as 0 % used

    @property
    def strictness(self) -> int:
        """Higher is stricter; the stricter of the local guard and the operator wins."""
        return _STRICTNESS[self]


_STRICTNESS = {Tier.FULL: 0, Tier.UNKNOWN: 0, Tier.TRUNCATED: 1, Tier.PAUSED: 2}

#: Tiers a worker can be told to apply (UNKNOWN is an observation, not a directive).
DIRECTIVE_TIERS = (Tier.FULL, Tier.TRUNCATED, Tier.PAUSED)

# Defaults of the WarmModel's gating block (the CRD's defaults are generated from these).
DEFAULT_TRUNCATE_AT_PERCENT = 70
DEFAULT_PAUSE_AT_PERCENT = 90
DEFAULT_HYSTERESIS_PERCENT = 5
DEFAULT_HOT_LAYER_PERCENT = 30
DEFAULT_LENGTH_BUCKETS = (32, 128, 512)

#: How long an operator directive holds if the operator stops re-sending it.
DEFAULT_DIRECTIVE_TTL_SECONDS = 60.0
MAX_DIRECTIVE_TTL_SECONDS = 3600.0

# --------------------------------------------------------------------------- 4. children, labels, annotations

#: Suffixes of a WarmModel's children ("<name><suffix>"); the Deployment, Service and PDB take the bare name.
CONFIGMAP_SUFFIX = "-warmup"
CONTROL_SECRET_SUFFIX = "-control"
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

# Annotations written by the operator.
ANNOTATION_TIER = f"{API_GROUP}/tier"  # on pods: the tier the operator decided
ANNOTATION_REVISION = f"{API_GROUP}/revision"
ANNOTATION_POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
#: Pod-template annotation: hash of what is baked into the pods besides the spec (prompts).
ANNOTATION_CONFIG_HASH = f"{API_GROUP}/config-hash"
#: Annotation on each child: hash of the desired object, so reconcile compares one string.
ANNOTATION_SPEC_HASH = f"{API_GROUP}/spec-hash"

# --------------------------------------------------------------------------- 5. the worker's HTTP surface

PATH_LIVEZ = "/livez"
PATH_READYZ = "/readyz"
PATH_METRICS = "/metrics"
PATH_CONTROL_TIER = "/control/tier"
#: The health path vLLM, SGLang, TGI and llama.cpp answer: the built-in worker answers it too
#: (200 only when warm, like /readyz), so tools that probe /health work unchanged.
PATH_HEALTH = "/health"
#: Sleep (#15): POST puts the engine to sleep ({"level": 1|2}), GET reports the state; POST
#: /control/wake takes the memory back.  Authenticated like /control/tier.
PATH_CONTROL_SLEEP = "/control/sleep"
PATH_CONTROL_WAKE = "/control/wake"
CONTROL_FIELD_SLEEP_LEVEL = "level"
SLEEP_LEVELS = (1, 2)
#: vLLM's dev-mode sleep API (VLLM_SERVER_DEV_MODE=1): POST /sleep?level=N, POST /wake_up,
#: GET /is_sleeping -> {"is_sleeping": bool}.  The built-in worker serves it too.
PATH_VLLM_SLEEP = "/sleep"
PATH_VLLM_WAKE_UP = "/wake_up"
PATH_VLLM_IS_SLEEPING = "/is_sleeping"
DEFAULT_WORKER_PORT = 8080
DEFAULT_ENGINE_PORT = 8000  # vLLM's and SGLang's usual port; TGI users set 80 or 3000
DEFAULT_ENGINE_HEALTH_PATH = "/health"
DEFAULT_OPERATOR_METRICS_PORT = 9090
DEFAULT_OPERATOR_LIVENESS_PORT = 8081

#: POST /control/tier: the bearer token's header and the body's keys ({"tier": "truncated", "ttl_seconds": 60}).
CONTROL_TOKEN_HEADER = "Authorization"  # "Bearer <token>"
CONTROL_FIELD_TIER = "tier"
CONTROL_FIELD_TTL = "ttl_seconds"

#: Stages a worker goes through, reported in the /readyz body as "stage".
STAGE_STARTING = "starting"  # HTTP bound, engine not yet mapped
STAGE_LOADING = "loading"  # weights mapped, layers loading in heat order
STAGE_WARMING = "warming"  # warm-up prompts running
STAGE_READY = "ready"  # warm: /readyz answers 200
STAGE_FAILED = "failed"  # load failed: the process is exiting non-zero
STAGE_UNHEALTHY = "unhealthy"  # was ready, then the model produced non-finite logits: unready for good
STAGES = (STAGE_STARTING, STAGE_LOADING, STAGE_WARMING, STAGE_READY, STAGE_FAILED, STAGE_UNHEALTHY)
#: Stage of a sidecar while its engine does not answer its health endpoint (at start, or
#: after the engine restarted or stopped answering: /readyz is 503 and warm-up runs again).
STAGE_WAITING_ENGINE = "waiting_engine"

# --------------------------------------------------------------------------- 6. environment variables

# Set by the operator on worker pods.
ENV_POD_IP = "POD_IP"
ENV_POD_NAME = "POD_NAME"
ENV_NODE_NAME = "NODE_NAME"

# --------------------------------------------------------------------------- 7. metrics

METRIC_PREFIX = "warmpool_"

# The worker's (built-in and sidecar), scraped by the operator.
METRIC_PHASE_TIMESTAMP = "warmpool_coldstart_phase_timestamp_seconds"  # label: phase
METRIC_PHASE_DURATION = "warmpool_coldstart_phase_duration_seconds"  # label: phase (since process start)
METRIC_TTFT = "warmpool_time_to_first_token_seconds"  # histogram
METRIC_MEMORY_USED_RATIO = "warmpool_accelerator_memory_used_ratio"
METRIC_MEMORY_USED_BYTES = "warmpool_accelerator_memory_used_bytes"
METRIC_MEMORY_CAPACITY_BYTES = "warmpool_accelerator_memory_capacity_bytes"
METRIC_TIER = "warmpool_tier"  # gauge per tier label: 1 for the active tier
#: The tier the worker's last warm-up ran at (gauge per tier label, 1 for that tier);
#: differs from METRIC_TIER while a deeper warm-up is still catching up after a relaxation.
METRIC_WARMUP_TIER = "warmpool_warmup_tier"
#: The tier the worker's own guard decided from its probe (gauge per tier label).
METRIC_LOCAL_TIER = "warmpool_local_tier"
#: 1 while an operator directive is in force (not expired).
METRIC_DIRECTIVE_ACTIVE = "warmpool_directive_active"
METRIC_LAYERS_RESIDENT = "warmpool_layers_resident"
METRIC_LAYERS_TOTAL = "warmpool_layers_total"
METRIC_WARMUP_PREFILLS = "warmpool_warmup_prefills_total"  # label: bucket
#: Warm-up prompts per bucket the worker's last warm-up plan asked for.
METRIC_WARMUP_PLANNED = "warmpool_warmup_planned_prefills"  # label: bucket
METRIC_LAYER_HEAT = "warmpool_layer_heat"  # label: layer
#: 1, labelled with the checkpoint digest and layer count, so the operator can write a
#: heat map that applies to the model the workers loaded.
METRIC_MODEL_INFO = "warmpool_model_info"  # labels: digest, layers
METRIC_READY = "warmpool_ready"  # 1 when warm and serving
#: Tokens generated for served requests (warm-up excluded).
METRIC_GENERATED_TOKENS = "warmpool_generated_tokens_total"
#: Requests admitted and waiting for the engine (bounded by --max-queued-requests).
METRIC_REQUESTS_QUEUED = "warmpool_requests_queued"
#: Requests refused before any work, by reason (queue_full).
METRIC_REQUESTS_REJECTED = "warmpool_requests_rejected_total"  # label: reason
#: Requests whose client went away before the completion was done.
METRIC_REQUESTS_CANCELLED = "warmpool_requests_cancelled_total"
#: Decode steps run after the client was seen gone (at most one per cancelled request).
METRIC_TOKENS_AFTER_DISCONNECT = "warmpool_tokens_after_disconnect_total"
#: KV-cache token slots allocated for the requests in flight (grows with generated tokens).
METRIC_KV_CACHE_TOKENS = "warmpool_kv_cache_tokens"
#: Warm-prefix KV files that could not be saved (ENOSPC, read-only, ...), by errno name.
METRIC_KV_PREFIX_SAVE_ERRORS = "warmpool_kv_prefix_save_errors_total"  # label: reason
#: Requests (and warm-up prefills) whose logits held NaN/Inf.
METRIC_NON_FINITE_LOGITS = "warmpool_non_finite_logits_total"
#: Sleep (#15): the level slept at (0 when awake); sleeps and wakes done; wake seconds; the
#: memory the last sleep released (measured: process RSS on CPU, the allocator on CUDA);
#: completions that found the worker asleep and woke it.
METRIC_SLEEP_LEVEL = "warmpool_sleep_level"
METRIC_SLEEPS = "warmpool_sleeps_total"
METRIC_WAKES = "warmpool_wakes_total"
METRIC_WAKE_DURATION = "warmpool_wake_duration_seconds"  # histogram
METRIC_SLEEP_RELEASED_BYTES = "warmpool_sleep_released_bytes"
METRIC_WAKES_ON_REQUEST = "warmpool_wakes_on_request_total"
#: 1 when the engine can sleep, 0 when it has no sleep API (llama.cpp, TGI: never put it to
#: sleep); absent while the sidecar has not found out yet.
METRIC_SLEEP_CAPABLE = "warmpool_sleep_capable"
#: The sidecar's flag naming the engine's sleep API (auto: probe vLLM's GET /is_sleeping).
ENGINE_SLEEP_APIS = ("auto", "vllm", "sglang", "none")
PATH_SGLANG_RELEASE_MEMORY = "/release_memory_occupation"
PATH_SGLANG_RESUME_MEMORY = "/resume_memory_occupation"

# The sidecar's own (`warmpool worker sidecar`).
METRIC_ENGINE_MEMORY_RATIO = "warmpool_engine_memory_used_ratio"  # the engine's own figure
#: 1 while the external engine answers its health endpoint, 0 while it does not.
METRIC_ENGINE_UP = "warmpool_engine_up"
#: Times the sidecar saw its engine restart or stop answering after it had answered.
METRIC_ENGINE_RESTARTS = "warmpool_engine_restarts_total"
#: Warm-up requests to the engine that failed, by reason (unavailable, http_5xx, ...).
METRIC_WARMUP_ERRORS = "warmpool_warmup_errors_total"  # label: reason
#: Weight bytes the sidecar's page-cache prefetch means to read at the current tier.
METRIC_PREFETCH_TARGET_BYTES = "warmpool_prefetch_target_bytes"
#: Weight bytes read so far by the prefetch.
METRIC_PREFETCH_READ_BYTES = "warmpool_prefetch_read_bytes"
#: Weight bytes of the prefetch's target found resident in the page cache (mincore).
METRIC_PREFETCH_RESIDENT_BYTES = "warmpool_prefetch_resident_bytes"
#: Weight files the prefetch could not use (missing, truncated, bad header).
METRIC_PREFETCH_FILE_ERRORS = "warmpool_prefetch_file_errors"

# An external engine's, read by the sidecar.
#: vLLM's KV-cache usage gauge (a 0..1 fraction despite "perc"), under both of its names:
#: `gpu_cache_usage_perc` up to v0.10, `kv_cache_usage_perc` from then on.  Read both.
VLLM_KV_CACHE_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")

# The operator's own.
METRIC_OPERATOR_RECONCILE_SECONDS = "warmpool_operator_reconcile_duration_seconds"  # label: kind
METRIC_OPERATOR_RECONCILE_ERRORS = "warmpool_operator_reconcile_errors_total"  # labels: kind, reason
METRIC_OPERATOR_SCRAPE_FAILURES = "warmpool_operator_scrape_failures_total"  # label: reason
METRIC_OPERATOR_TIER_DECISIONS = "warmpool_operator_tier_decisions_total"  # labels: scope, tier
METRIC_OPERATOR_WARM_PODS = "warmpool_operator_warm_pods"  # labels: namespace, warmmodel
METRIC_OPERATOR_WRITE_FAILURES = "warmpool_operator_write_failures_total"  # label: target (pod_annotation, heat_map)

# Label names of the metrics above.
LABEL_PHASE = "phase"
LABEL_TIER = "tier"
LABEL_BUCKET = "bucket"
LABEL_LAYER = "layer"
LABEL_SOURCE = "source"
LABEL_REASON = "reason"
LABEL_DIGEST = "digest"
LABEL_LAYERS = "layers"
LABEL_KIND = "kind"
LABEL_SCOPE = "scope"
LABEL_TARGET = "target"  # warmpool_operator_write_failures_total: what the skipped write was for
LABEL_NAMESPACE = "namespace"
LABEL_WARMMODEL = "warmmodel"

#: Cold-start phases in the order they happen (each a timestamp and a duration since start).
PHASES = ("process_start", "weights_mapped", "first_layer_ready", "warmup_done", "ready")

# --------------------------------------------------------------------------- 8. files

#: Keys of the WarmModel's ConfigMap (mounted into worker pods as files of these names).
CONFIGMAP_KEY_PROMPTS = "prompts.json"
CONFIGMAP_KEY_HEATMAP = "heatmap.json"
#: The heat map file's format tag (see warmpool.heatmap).
HEATMAP_FORMAT = "warmpool.heatmap/v1"

# Where worker pods see things.
#: The model's directory, whatever its source (an external engine's args point here,
#: e.g. `--model=/warmpool/model`).
MODEL_MOUNT_PATH = "/warmpool/model"
CONFIG_MOUNT_PATH = "/warmpool/config"  # the WarmModel's ConfigMap (prompts + heat map)
PROMPTS_MOUNT_PATH = "/warmpool/prompts"  # a user's prompts ConfigMap (promptsConfigMapRef)
CONTROL_MOUNT_PATH = "/warmpool/control"  # the control-token Secret
KV_PREFIX_MOUNT_PATH = "/warmpool/kv"  # warm-prefix KV persistence (emptyDir)
#: Where node-local model caches live on a node (a WarmModel's nodeCache.root default).
DEFAULT_NODE_CACHE_ROOT = "/var/lib/warmpool/models"
