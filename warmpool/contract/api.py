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

#: The operator's finalizer on WarmModels (kopf's; users meet it on a WarmModel stuck deleting
#: while no operator runs: the runbooks name it).
OPERATOR_FINALIZER = f"{API_GROUP}/operator"

#: Status condition types of a WarmModel (each has a CamelCase reason and a message).
CONDITION_READY = "Ready"  # at least pool.minWarm pods verified warm
CONDITION_PROGRESSING = "Progressing"  # a rollout or scale is under way
CONDITION_DEGRADED = "Degraded"  # something is wrong that retrying will not fix (bad spec, ...)
CONDITION_WARMUP_GATED = "WarmupGated"  # some pods run a truncated or paused warm-up
CONDITION_TYPES = (CONDITION_READY, CONDITION_PROGRESSING, CONDITION_DEGRADED, CONDITION_WARMUP_GATED)
#: Written only with spec.pool.predictive.enabled: True while demand prediction sizes the
#: pool; False (the pool scales reactively) with the reason why not, e.g. request metrics missing.
CONDITION_PREDICTIVE = "Predictive"


# --------------------------------------------------------------------------- 2. defaults and bounds

DEFAULT_WARMUP_TIMEOUT_SECONDS = 600
DEFAULT_SLEEP_LEVEL = 1

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
