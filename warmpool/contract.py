"""The one place that owns every name the operator and the worker must agree on.

Metric names, label names, tier names, default thresholds, annotation keys, HTTP paths
and environment variables live here and nowhere else.  Both sides import this module;
it imports nothing heavy, so it costs nothing on the worker's start path.
"""

from __future__ import annotations

from enum import Enum

API_GROUP = "warmpool.dev"
API_VERSION = "v1alpha1"
KIND = "WarmModel"
PLURAL = "warmmodels"


class Tier(str, Enum):
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

# Pod annotations and labels written by the operator.
ANNOTATION_TIER = f"{API_GROUP}/tier"
ANNOTATION_REVISION = f"{API_GROUP}/revision"
ANNOTATION_POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LABEL_MODEL = f"{API_GROUP}/model"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "warmpool-operator"

# The worker's HTTP surface.
PATH_LIVEZ = "/livez"
PATH_READYZ = "/readyz"
PATH_METRICS = "/metrics"
PATH_CONTROL_TIER = "/control/tier"
CONTROL_TOKEN_HEADER = "Authorization"  # "Bearer <token>"
DEFAULT_WORKER_PORT = 8080

# Environment variables the operator sets on worker pods.
ENV_POD_IP = "POD_IP"
ENV_POD_NAME = "POD_NAME"
ENV_NODE_NAME = "NODE_NAME"

# Prometheus metric names (the worker exports, the operator scrapes).
METRIC_PREFIX = "warmpool_"
METRIC_PHASE_TIMESTAMP = "warmpool_coldstart_phase_timestamp_seconds"  # label: phase
METRIC_PHASE_DURATION = "warmpool_coldstart_phase_duration_seconds"  # label: phase (since process start)
METRIC_TTFT = "warmpool_time_to_first_token_seconds"  # histogram
METRIC_MEMORY_USED_RATIO = "warmpool_accelerator_memory_used_ratio"
METRIC_MEMORY_USED_BYTES = "warmpool_accelerator_memory_used_bytes"
METRIC_MEMORY_CAPACITY_BYTES = "warmpool_accelerator_memory_capacity_bytes"
METRIC_TIER = "warmpool_tier"  # gauge per tier label: 1 for the active tier
METRIC_LAYERS_RESIDENT = "warmpool_layers_resident"
METRIC_LAYERS_TOTAL = "warmpool_layers_total"
METRIC_WARMUP_PREFILLS = "warmpool_warmup_prefills_total"  # label: bucket
METRIC_LAYER_HEAT = "warmpool_layer_heat"  # label: layer
METRIC_READY = "warmpool_ready"  # 1 when warm and serving
METRIC_ENGINE_MEMORY_RATIO = "warmpool_engine_memory_used_ratio"  # sidecar: the engine's own figure

LABEL_PHASE = "phase"
LABEL_TIER = "tier"
LABEL_BUCKET = "bucket"
LABEL_LAYER = "layer"
LABEL_SOURCE = "source"

#: Cold-start phases in the order they happen (each a timestamp and a duration since start).
PHASES = ("process_start", "weights_mapped", "first_layer_ready", "warmup_done", "ready")
