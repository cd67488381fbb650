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
#: Written only with spec.pool.predictive.enabled: True while demand prediction sizes the
#: pool; False (the pool scales reactively) with the reason why not, e.g. request metrics missing.
CONDITION_PREDICTIVE = "Predictive"

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
#: Defaults of spec.pool.sleep: pods kept awake, and the level a pod sleeps at.
DEFAULT_SLEEP_MIN_AWAKE = 1
DEFAULT_SLEEP_LEVEL = 1
#: Longest spec.pool.sleep.afterIdleSeconds accepted (a week).
MAX_SLEEP_AFTER_IDLE_SECONDS = 7 * 24 * 3600
#: Defaults of spec.pool.predictive: the lead time planned for until one is measured, and the most
#: pods prediction adds above the reactive count.
DEFAULT_PREDICTIVE_HORIZON_SECONDS = 300
DEFAULT_PREDICTIVE_MAX_EXTRA_REPLICAS = 4

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

# --------------------------------------------------------------------------- 5. the worker's HTTP surface

PATH_LIVEZ = "/livez"
PATH_READYZ = "/readyz"
PATH_METRICS = "/metrics"
PATH_CONTROL_TIER = "/control/tier"
#: The health path vLLM, SGLang, TGI and llama.cpp answer: the built-in worker answers it too
#: (200 only when warm, like /readyz), so tools that probe /health work unchanged.
PATH_HEALTH = "/health"
#: Sleep: POST puts the engine to sleep ({"level": 1|2}), GET reports the state; POST
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
#: The worker container's port name, which its Service targets and the chart's NetworkPolicy opens.
WORKER_PORT_NAME = "http"
DEFAULT_ENGINE_PORT = 8000  # vLLM's and SGLang's usual port; TGI users set 80 or 3000
DEFAULT_ENGINE_HEALTH_PATH = "/health"
DEFAULT_OPERATOR_METRICS_PORT = 9090
DEFAULT_OPERATOR_LIVENESS_PORT = 8081

#: POST /control/tier: the bearer token's header and the body's keys ({"tier": "truncated", "ttl_seconds": 60}).
CONTROL_TOKEN_HEADER = "Authorization"  # "Bearer <token>"
CONTROL_FIELD_TIER = "tier"
CONTROL_FIELD_TTL = "ttl_seconds"
#: The operator's trace context in a tier directive's body (a W3C traceparent,
#: ``00-<trace id>-<span id>-<flags>``), so the worker's reaction joins the operator's trace.
CONTROL_FIELD_TRACEPARENT = "traceparent"

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
#: Completions received (counted on arrival, whatever their outcome): the operator's idle signal
#: (a pod whose count has not moved for spec.pool.sleep.afterIdleSeconds is idle).
METRIC_REQUESTS_TOTAL = "warmpool_requests_total"
#: Completions received and not yet answered (the operator drains these before a sleep).
METRIC_REQUESTS_IN_FLIGHT = "warmpool_requests_in_flight"
#: Requests admitted and waiting for the engine (bounded by --max-queued-requests).
METRIC_REQUESTS_QUEUED = "warmpool_requests_queued"
#: Prompt and generated tokens per served request (histograms over TOKEN_LENGTH_EDGES); the
#: operator's learned warm-up buckets read the prompt one.
METRIC_REQUEST_PROMPT_TOKENS = "warmpool_request_prompt_tokens"
METRIC_REQUEST_GENERATED_TOKENS = "warmpool_request_generated_tokens"
#: Seconds the engine spent generating for served requests (the built-in engine: wall time of
#: its batch steps, so concurrent requests are not counted twice).  Tokens/s is a rate the reader
#: takes: rate(generated_tokens_total) is the throughput served, and rate(generated_tokens_total)
#: / rate(engine_busy_seconds_total) the throughput while busy, a pod's measured capacity.
METRIC_ENGINE_BUSY_SECONDS = "warmpool_engine_busy_seconds_total"
#: Requests refused before any work, by reason (queue_full).
METRIC_REQUESTS_REJECTED = "warmpool_requests_rejected_total"  # label: reason
#: Requests whose client went away before the completion was done.
METRIC_REQUESTS_CANCELLED = "warmpool_requests_cancelled_total"
#: Decode steps run after the client was seen gone (at most one per cancelled request).
METRIC_TOKENS_AFTER_DISCONNECT = "warmpool_tokens_after_disconnect_total"
#: KV-cache token slots allocated for the requests in flight (grows with generated tokens).
METRIC_KV_CACHE_TOKENS = "warmpool_kv_cache_tokens"
#: Capacity of the built-in engine's continuous batching: requests in the running batch (the
#: waiting ones are METRIC_REQUESTS_QUEUED), and its KV-cache blocks: all of them, those holding
#: K/V now (used), those promised to running requests for their prompt + max_tokens (reserved),
#: and those a new request can still reserve (free = total - reserved).
METRIC_REQUESTS_RUNNING = "warmpool_requests_running"
METRIC_KV_BLOCKS_TOTAL = "warmpool_kv_blocks_total"
METRIC_KV_BLOCKS_USED = "warmpool_kv_blocks_used"
METRIC_KV_BLOCKS_RESERVED = "warmpool_kv_blocks_reserved"
METRIC_KV_BLOCKS_FREE = "warmpool_kv_blocks_free"
#: Tokens generated per second over the last TOKENS_PER_SECOND_WINDOW seconds (all requests).
METRIC_GENERATION_TOKENS_PER_SECOND = "warmpool_generation_tokens_per_second"
TOKENS_PER_SECOND_WINDOW = 10.0
#: Warm-prefix KV files that could not be saved (ENOSPC, read-only, ...), by errno name.
METRIC_KV_PREFIX_SAVE_ERRORS = "warmpool_kv_prefix_save_errors_total"  # label: reason
#: Requests (and warm-up prefills) whose logits held NaN/Inf.
METRIC_NON_FINITE_LOGITS = "warmpool_non_finite_logits_total"
#: Sleep: the level slept at (0 when awake); sleeps and wakes done; wake seconds; the
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
#: vLLM's request figures, re-exported by the sidecar under warmpool's names (sample names as
#: exposed; every series is summed over vLLM's model_name/engine labels).
VLLM_PROMPT_TOKENS_HISTOGRAM = "vllm:request_prompt_tokens"  # -> METRIC_REQUEST_PROMPT_TOKENS
VLLM_GENERATION_TOKENS_HISTOGRAM = "vllm:request_generation_tokens"  # -> METRIC_REQUEST_GENERATED_TOKENS
VLLM_REQUESTS_RUNNING = "vllm:num_requests_running"  # -> METRIC_REQUESTS_IN_FLIGHT
VLLM_REQUESTS_WAITING = "vllm:num_requests_waiting"  # -> METRIC_REQUESTS_QUEUED
VLLM_GENERATION_TOKENS = "vllm:generation_tokens_total"  # -> METRIC_GENERATED_TOKENS
VLLM_REQUEST_SUCCESS = "vllm:request_success_total"  # summed over finished_reason -> METRIC_REQUESTS_TOTAL

# The operator's own.
METRIC_OPERATOR_RECONCILE_SECONDS = "warmpool_operator_reconcile_duration_seconds"  # label: kind
METRIC_OPERATOR_RECONCILE_ERRORS = "warmpool_operator_reconcile_errors_total"  # labels: kind, reason
METRIC_OPERATOR_SCRAPE_FAILURES = "warmpool_operator_scrape_failures_total"  # label: reason
METRIC_OPERATOR_TIER_DECISIONS = "warmpool_operator_tier_decisions_total"  # labels: scope, tier
METRIC_OPERATOR_WARM_PODS = "warmpool_operator_warm_pods"  # labels: namespace, warmmodel
#: The WarmModel's pool.minWarm, beside the warm count (the below-minWarm alert compares them).
METRIC_OPERATOR_MIN_WARM_PODS = "warmpool_operator_min_warm_pods"  # labels: namespace, warmmodel
METRIC_OPERATOR_WRITE_FAILURES = "warmpool_operator_write_failures_total"  # label: target (pod_annotation, heat_map)
#: Demand prediction's figures (status.forecast), per WarmModel with spec.pool.predictive (shadow
#: mode included); a figure not known yet has no series.  Labels: namespace, warmmodel.
#: The mean request rate over the last closed history step.
METRIC_OPERATOR_FORECAST_RATE_NOW = "warmpool_operator_forecast_rate_now_requests_per_second"
#: The forecast one lead time ahead, label quantile "0.5" (p50) and "0.9" (p90, what the pool is sized
#: for): of each step's PEAK rate (its busiest sub-step), the forecaster's default target; of the step's
#: mean only where the history holds no peaks.
METRIC_OPERATOR_FORECAST_PEAK = "warmpool_operator_forecast_peak_requests_per_second"
#: Requests per second one pod serves while busy, measured from the workers' throughput.
METRIC_OPERATOR_FORECAST_CAPACITY_PER_POD = "warmpool_operator_forecast_capacity_per_pod_requests_per_second"
#: Pods the forecast asks for (acted on only when spec.pool.predictive.enabled).
METRIC_OPERATOR_FORECAST_DESIRED_REPLICAS = "warmpool_operator_forecast_desired_replicas"

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
LABEL_QUANTILE = "quantile"  # warmpool_operator_forecast_peak_requests_per_second: the forecast's quantile
#: Values of LABEL_QUANTILE: the forecast's p50 and p90.
FORECAST_QUANTILE_P50 = "0.5"
FORECAST_QUANTILE_P90 = "0.9"

#: Cold-start phases in the order they happen (each a timestamp and a duration since start).
PHASES = ("process_start", "weights_mapped", "first_layer_ready", "warmup_done", "ready")

# --------------------------------------------------------------------------- 8. files

#: Keys of the WarmModel's ConfigMap (mounted into worker pods as files of these names).
CONFIGMAP_KEY_PROMPTS = "prompts.json"
CONFIGMAP_KEY_HEATMAP = "heatmap.json"
#: The heat map file's format tag (see warmpool.heatmap).
HEATMAP_FORMAT = "warmpool.heatmap/v1"
#: Key of the history ConfigMap holding the serialised history (predict/history.py's format).
CONFIGMAP_KEY_HISTORY = "history"
#: Key of the WarmModel's ConfigMap holding the warm-up lengths learned from traffic
#: (spec.warmup.learnBuckets): a JSON object {"format": LEARNED_BUCKETS_FORMAT, "buckets": [...]};
#: a worker started while it is there warms at those lengths instead of --buckets.
CONFIGMAP_KEY_LEARNED_BUCKETS = "learned-buckets.json"
LEARNED_BUCKETS_FORMAT = "warmpool.learned-buckets/v1"

#: Token lengths, as upper edges (inclusive) of bins: the buckets of the workers' token
#: histograms and the bins of the operator's history, so a learned warm-up bucket read off
#: either is a size engines pad graphs to: powers of two and the 1.5x step between them.
#: A length above the last edge falls in the overflow bin (+Inf).
TOKEN_LENGTH_EDGES: tuple[int, ...] = (
    16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
    8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072,
)

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
#: Where the node agent's content-addressed block cache lives on a node (warmpool_nodecache);
#: under /var/lib/warmpool, so inside host_paths.DEFAULT_ALLOWED_HOST_PATHS.
DEFAULT_BLOCK_CACHE_ROOT = "/var/lib/warmpool/cache"
#: A revision manifest's format tag and its file name beside the model's files at a source.
MANIFEST_FORMAT = "warmpool.manifest/v1"
MANIFEST_FILENAME = "warmpool-manifest.json"
#: The block size revisions are split into (and hashed by) unless a manifest says otherwise.
DEFAULT_BLOCK_SIZE = 4 * 1024 * 1024
#: Keys of the Secret that spec.model.s3.secretRef names (the AWS SDKs' own names, as
#: KServe's S3 secrets use them): the node agent reads these two and nothing else.
S3_SECRET_ACCESS_KEY_ID_KEY = "AWS_ACCESS_KEY_ID"
S3_SECRET_SECRET_ACCESS_KEY_KEY = "AWS_SECRET_ACCESS_KEY"

# --- The node agent and the operator, about object-store model sources ----------------
#: Where worker pods of an http/s3 source see the node cache's published revisions (the
#: cache's ``revisions/`` directory, read-only); the model is ``<this>/<digest hex>``.
CACHE_REVISIONS_MOUNT_PATH = "/warmpool/cache-revisions"
#: The cache root's subdirectory of published revisions (warmpool_nodecache.layout names it too).
CACHE_REVISIONS_DIR = "revisions"
#: The cache root's subdirectory of links to partial views: ``<this>/<digest hex>`` names a fill's
#: view while it fills, then the published revision (spec.model.startOnPartialCache).
CACHE_PARTIAL_DIR = "partial"
#: Where worker pods that start on a partial view see the whole node cache (read-only): the
#: model is ``<this>/partial/<digest hex>``, and the fill's progress record is beside its view.
CACHE_ROOT_MOUNT_PATH = "/warmpool/node-cache"
#: Node label saying the node's cache holds a published revision: key ``<prefix>/sha256-<56 hex>``
#: (a label name is at most 63 characters; 56 hex digits = 224 bits still name one revision).
CACHE_NODE_LABEL_PREFIX = f"cache.{API_GROUP}"
CACHE_NODE_LABEL_HEX = 56
CACHE_NODE_LABEL_VALUE = "published"
#: Field manager of a node agent's server-side apply of its WarmModel status entry; one per node
#: (``<this>.<node-hash>``), so one agent's apply never drops another node's entry.
NODE_AGENT_FIELD_MANAGER = "warmpool-node-agent"
#: Prefix of the coordination.k8s.io Lease guarding one (node, revision) fill.
FILL_LEASE_PREFIX = "warmpool-fill"
#: Name of the init container that holds a worker pod until its revision is published on the node.
CACHE_WAIT_CONTAINER = "wait-cache"
#: A fill's partial view of a revision (its files while blocks land, hottest first; see
#: warmpool.fill_progress): the progress record's format tag, and the suffix that names the record
#: beside the view's directory (``<view dir name><suffix>``, in the same parent directory).
FILL_PROGRESS_FORMAT = "warmpool.fill-progress/v1"
FILL_PROGRESS_SUFFIX = ".fill-progress.json"

