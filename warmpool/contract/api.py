"""The WarmModel API: its identity, status conditions, what kopf stores on it, the spec's
defaults and bounds, and the tiers with their thresholds and the operator's directives.

Part of the contract: names both sides must agree on, each defined once (see warmpool/contract/__init__.py)."""

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
#: A WarmModel's apiVersion.
API_GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"

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
