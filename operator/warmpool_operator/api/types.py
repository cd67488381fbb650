"""The WarmModel API as typed pydantic models: the one source of truth for the CRD.

``crds/warmmodels.warmpool.dev.yaml`` is generated from these classes by
:mod:`warmpool_operator.api.crdgen` (a unit test fails when the committed file differs), so
field names, types, bounds, enums, defaults and descriptions cannot drift apart.

Every cross-field rule is declared once as a :class:`Rule`: its CEL expression goes into
the CRD (the API server refuses bad input at admission) and its Python twin runs when the
operator parses a spec, so an object admitted under an older CRD, or one written while
the CRD was missing, still fails with a message that names the field.  Transition rules
(``self == oldSelf``, immutability) need the old object and exist only in the CRD.

Parsing, for the operator::

    from warmpool_operator.api.types import InvalidWarmModel, parse_spec, parse_warmmodel

    wm = parse_warmmodel(body)          # the whole object (kopf's ``body``)
    spec = parse_spec(spec_mapping)     # or just ``spec``
    spec.gating.thresholds()            # -> warmpool.tiering.Thresholds
    spec.model_dump(by_alias=True, exclude_none=True)   # back to the API's camelCase form

Python attributes are snake_case; the API's camelCase names are their aliases and both
are accepted on input.  Validation is strict (no "3" for 3, no "yes" for true), like the
API server's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from itertools import pairwise
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from warmpool.contract.api import (
    API_GROUP,
    DEFAULT_HOT_LAYER_PERCENT,
    DEFAULT_HYSTERESIS_PERCENT,
    DEFAULT_LENGTH_BUCKETS,
    DEFAULT_PAUSE_AT_PERCENT,
    DEFAULT_TRUNCATE_AT_PERCENT,
    DEFAULT_WARMUP_TIMEOUT_SECONDS,
)
from warmpool.contract.files import CONFIGMAP_KEY_PROMPTS
from warmpool.contract.http import DEFAULT_ENGINE_HEALTH_PATH, DEFAULT_WORKER_PORT
from warmpool.contract.pods import (
    ANNOTATION_POD_DELETION_COST,
    LABEL_AWAKE,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_MODEL,
    LABEL_NAME,
)
from warmpool.tiering import Thresholds
from warmpool_operator.api.validation import ApiObject, Rule, immutable

DEFAULT_REPLICAS = 1
DEFAULT_MIN_WARM = 1
DEFAULT_MAX_REPLICAS = 8
#: Hard ceiling on pool sizes accepted at admission (a typo like 10000 is refused).
MAX_POOL_REPLICAS = 1000
#: Longest spec.pool.sleep.afterIdleSeconds accepted (a week).
MAX_SLEEP_AFTER_IDLE_SECONDS = 7 * 24 * 3600
#: Longest WarmModel name: children are named "<name>-<suffix>" and must stay DNS-1035 labels.
MAX_WARMMODEL_NAME_LENGTH = 48
#: Defaults of spec.pool.sleep: pods kept awake, and the level a pod sleeps at.
DEFAULT_SLEEP_MIN_AWAKE = 1
#: Where node-local model caches live on a node (a WarmModel's nodeCache.root default).
DEFAULT_NODE_CACHE_ROOT = "/var/lib/warmpool/models"
DEFAULT_ENGINE_PORT = 8000  # vLLM's and SGLang's usual port; TGI users set 80 or 3000
#: Defaults of spec.pool.predictive: the lead time planned for until one is measured, and the most
#: pods prediction adds above the reactive count.
DEFAULT_PREDICTIVE_HORIZON_SECONDS = 300
DEFAULT_PREDICTIVE_MAX_EXTRA_REPLICAS = 4
#: Defaults of spec.pool.scaleToZero: how long the activator holds a request for a pool at zero,
#: and how many it holds at once (then 429).  120 s covers a cold start of a mid-sized model from
#: a warm node cache; a first start onto a bare node can take longer (the runbook says so).
DEFAULT_ZERO_HOLD_TIMEOUT_SECONDS = 120
DEFAULT_ZERO_MAX_HELD_REQUESTS = 100
MAX_ZERO_HELD_REQUESTS = 10000


# --- Reusable constrained types ------------------------------------------------------------

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123Subdomain = Annotated[
    str, Field(min_length=1, max_length=253, pattern=rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
]
#: A path segment that is never "." or ".." (so no traversal) but may be hidden (".cache"):
#: at most two leading dots, then a character that is not a dot. No spaces.
_SEGMENT = r"\.{0,2}[A-Za-z0-9_@+=-][A-Za-z0-9._@+=-]*"
RelativePath = Annotated[str, Field(min_length=1, max_length=1024, pattern=rf"^{_SEGMENT}(/{_SEGMENT})*$")]
AbsolutePath = Annotated[str, Field(min_length=2, max_length=1024, pattern=rf"^(/{_SEGMENT})+$")]
Image = Annotated[str, Field(min_length=1, max_length=512, pattern=r"^\S+$")]
Port = Annotated[int, Field(ge=1, le=65535)]
Replicas = Annotated[int, Field(ge=0, le=MAX_POOL_REPLICAS)]
Argument = Annotated[str, Field(max_length=4096)]

#: The usual Kubernetes quantity grammar ("1", "500m", "16Gi", "1e3").
_DECIMAL = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY_PATTERN = rf"^(\+|-)?{_DECIMAL}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_DECIMAL}))?$"
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not _QUANTITY_RE.match(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 1, 500m, 16Gi)")
    return value


Quantity = Annotated[
    int | str,
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
        }
    ),
    AfterValidator(_check_quantity),
]

EngineKind = Literal["builtin", "sidecar"]
ModelFormat = Literal["safetensors"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
TolerationOperator = Literal["Exists", "Equal"]
TaintEffect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]
ConditionStatus = Literal["True", "False", "Unknown"]


# --- spec.model -------------------------------------------------------------------------------


class PvcSource(ApiObject):
    """Weights on a PersistentVolumeClaim in the WarmModel's namespace, mounted read-only."""

    claim_name: DNS1123Subdomain
    """Name of the PersistentVolumeClaim (same namespace as the WarmModel)."""
    path: RelativePath | None = None
    """Directory inside the claim that holds the checkpoint (config.json, tokenizer.json,
    *.safetensors); relative, no "..". Unset means the claim's root."""


class HostPathSource(ApiObject):
    """Weights in a directory that already exists on every node the pool may run on."""

    path: AbsolutePath
    """Absolute directory on the node that holds the checkpoint (config.json, tokenizer.json,
    *.safetensors); mounted read-only. No "." or ".." segments."""


class NodeCacheSource(ApiObject):
    """Weights in the node-local warmpool model cache: <root>/<key> on the node.

    Unlike hostPath this names a shared cache layout (one root per node, one directory per
    model), filled out of band, e.g. by `warmpool model fetch` or an image pre-puller.
    """

    root: AbsolutePath = DEFAULT_NODE_CACHE_ROOT
    """Absolute directory of the cache on the node."""
    key: RelativePath
    """Directory of this model under the cache root, e.g. "SmolLM2-135M-Instruct"; relative, no ".."."""


#: An http(s) URL's scheme, host and port, in a grammar every reader of it parses (Python's
#: urlsplit, botocore): a DNS name (labels of 63 at most, no underscore) or a bracketed IPv6
#: literal, then an optional port 1-65535.  Printable ASCII only, no credentials.
_URL_DNS_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_URL_H16 = r"[0-9A-Fa-f]{1,4}"
_URL_IPV6 = "|".join((
    rf"({_URL_H16}:){{7}}{_URL_H16}", rf"({_URL_H16}:){{1,7}}:", rf"({_URL_H16}:){{1,6}}:{_URL_H16}",
    *(rf"({_URL_H16}:){{1,{5 - n}}}(:{_URL_H16}){{1,{n + 2}}}" for n in range(5)),
    rf":((:{_URL_H16}){{1,7}}|:)",
))
_URL_PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
_URL_ORIGIN = rf"https?://({_URL_DNS_LABEL}(\.{_URL_DNS_LABEL})*|\[({_URL_IPV6})\])(:{_URL_PORT})?"


class HttpModelSource(ApiObject):
    """Weights served over plain HTTP, filled into each node's block cache by the node agent.

    ``<url>/<file>`` serves each file (with Range support) and ``<url>/warmpool-manifest.json``
    the revision's manifest (files, sizes, block SHA-256s; `warmpool model push` makes it).
    """

    url: Annotated[str, Field(min_length=8, max_length=2048, pattern=rf"^{_URL_ORIGIN}(/[!-~]*)?$")]
    """Base URL of the revision's files, http:// or https://."""


class SecretRef(ApiObject):
    """A Secret in the WarmModel's namespace."""

    name: DNS1123Subdomain
    """Name of the Secret."""


class S3CaBundle(ApiObject):
    """A key of a Secret in the WarmModel's namespace holding PEM CA certificates."""

    name: DNS1123Subdomain
    """Name of the Secret (it may be the secretRef's)."""
    key: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")] = "ca.crt"
    """Key inside it."""


class S3ModelSource(ApiObject):
    """Weights in an S3-compatible bucket, filled into each node's block cache by the node agent.

    ``<prefix>/<file>`` holds each file and ``<prefix>/warmpool-manifest.json`` the revision's manifest.
    """

    #: 262: "http://" and the 255 characters botocore allows a host name (https: one fewer).
    endpoint: Annotated[str, Field(min_length=8, max_length=262, pattern=rf"^{_URL_ORIGIN}/?$")]
    """The store's endpoint URL, e.g. https://s3.eu-west-1.amazonaws.com or http://127.0.0.1:8333."""
    bucket: Annotated[str, Field(min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]*[a-z0-9]$")]
    """Bucket name (S3 naming: lower case, digits, dots and dashes)."""
    prefix: RelativePath | None = None
    """Key prefix of the revision's files inside the bucket, no ".." segments; unset means the bucket's root."""
    secret_ref: SecretRef | None = None
    """Secret (same namespace) with the credentials; the node agent reads it. Keys: AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY, optionally AWS_SESSION_TOKEN (temporary credentials); or instead a shared
    credentials file under the key "credentials" (with spec.model.s3.profile naming its section).
    Unset: the node agent's own credentials (boto3's default chain: environment, web identity such as
    IRSA, profile, container or instance metadata) when the platform lent them
    (--s3-default-credentials), else unsigned requests (a public bucket)."""
    profile: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.+=,@-]+$")] | None = None
    """Section of the shared credentials file in the Secret's "credentials" key to use; unset means
    [default]. Needs secretRef."""
    region: Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")] | None = None
    """Region the requests are signed for (SigV4), e.g. eu-west-1; unset means the node agent's default
    chain's region where it lends its credentials, else us-east-1."""
    ca_bundle: S3CaBundle | None = None
    """PEM certificates (a key of a Secret in the same namespace) the endpoint's TLS certificate must
    chain to, instead of the node's system trust store: for a store behind a private CA."""

    cel_rules = (
        Rule(
            cel="!has(self.profile) || has(self.secretRef)",
            message="spec.model.s3.profile needs spec.model.s3.secretRef (the Secret holding the credentials file)",
            check=lambda s: s.profile is None or s.secret_ref is not None,
            field_path=".profile",
        ),
        Rule(
            cel="!has(self.caBundle) || self.endpoint.startsWith('https://')",
            message="spec.model.s3.caBundle needs an https:// spec.model.s3.endpoint",
            check=lambda s: s.ca_bundle is None or s.endpoint.startswith("https://"),
            field_path=".caBundle",
        ),
    )


def _count_set(*values: object) -> int:
    return sum(value is not None for value in values)


class ModelSpec(ApiObject):
    """Where the weights are and which revision to serve. Exactly one source must be set;
    whichever it is, worker pods see the model's directory at /warmpool/model."""

    pvc: PvcSource | None = None
    """Weights on a PersistentVolumeClaim."""
    host_path: HostPathSource | None = None
    """Weights in a directory on the node."""
    node_cache: NodeCacheSource | None = None
    """Weights in the node-local warmpool model cache."""
    http: HttpModelSource | None = None
    """Weights over HTTP, cached on each node by the node agent (hottest blocks first)."""
    s3: S3ModelSource | None = None
    """Weights in an S3-compatible bucket, cached on each node by the node agent (hottest blocks first)."""
    format: Annotated[ModelFormat, Field(json_schema_extra=immutable("spec.model.format"))] = "safetensors"
    """Checkpoint format. Only safetensors: pickle checkpoints are never loaded. Immutable."""
    revision: Annotated[str, Field(max_length=128, pattern=r"^\S+$")] | None = None
    """Free-form revision of the weights (a commit hash, a date). Changing it rolls the pool,
    keeping warm pods until new ones are warm."""
    served_name: Annotated[str, Field(max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$")] | None = None
    """Model name clients send in OpenAI-style requests; unset means the WarmModel's name."""
    start_on_partial_cache: bool = False
    """http/s3 sources with the builtin engine: worker pods start while their node's cache is
    still filling (the node agent fetches what a worker needs first, then the hottest layers) and
    wait for each layer's bytes as they load it, instead of waiting for the whole revision.  The
    worker mounts only its own revision's partial view (read-only), as it would the published
    revision."""

    cel_rules = (
        Rule(
            cel="[has(self.pvc), has(self.hostPath), has(self.nodeCache), has(self.http), has(self.s3)]"
            ".filter(x, x).size() == 1",
            message="exactly one of spec.model.pvc, spec.model.hostPath, spec.model.nodeCache, "
            "spec.model.http or spec.model.s3 must be set",
            check=lambda m: _count_set(m.pvc, m.host_path, m.node_cache, m.http, m.s3) == 1,
        ),
        Rule(
            cel="!has(self.startOnPartialCache) || !self.startOnPartialCache || has(self.http) || has(self.s3)",
            message="spec.model.startOnPartialCache needs spec.model.http or spec.model.s3 (a node cache the "
            "node agent fills)",
            check=lambda m: not m.start_on_partial_cache or m.object_store() is not None,
            field_path=".startOnPartialCache",
        ),
    )

    def object_store(self) -> dict[str, Any] | None:
        """The http/s3 source block as the API writes it ({"http": {...}} or {"s3": {...}}), or None."""
        for key, value in (("http", self.http), ("s3", self.s3)):
            if value is not None:
                return {key: value.model_dump(by_alias=True, exclude_none=True)}
        return None


# --- spec.engine ------------------------------------------------------------------------------


class KeySelector(ApiObject):
    """A key of a Secret or ConfigMap in the WarmModel's namespace."""

    name: DNS1123Subdomain
    """Name of the Secret or ConfigMap."""
    key: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]
    """Key inside it."""
    optional: bool | None = None
    """Start the pod even if the object or key is missing."""


class EnvVarSource(ApiObject):
    """Where an environment variable's value comes from. Exactly one source must be set."""

    secret_key_ref: KeySelector | None = None
    """A key of a Secret (e.g. HF_TOKEN)."""
    config_map_key_ref: KeySelector | None = None
    """A key of a ConfigMap."""

    cel_rules = (
        Rule(
            cel="has(self.secretKeyRef) != has(self.configMapKeyRef)",
            message="valueFrom needs exactly one of secretKeyRef or configMapKeyRef",
            check=lambda s: _count_set(s.secret_key_ref, s.config_map_key_ref) == 1,
        ),
    )


class EnvVar(ApiObject):
    """An environment variable for the external engine's container."""

    name: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")]
    """Variable name."""
    value: Annotated[str, Field(max_length=32768)] | None = None
    """Literal value."""
    value_from: EnvVarSource | None = None
    """Take the value from a Secret or ConfigMap instead."""

    cel_rules = (
        Rule(
            cel="!(has(self.value) && has(self.valueFrom))",
            message="env: set value or valueFrom, not both",
            check=lambda e: not (e.value is not None and e.value_from is not None),
        ),
    )


_SIDECAR_ONLY = ("image", "command", "args", "env")


class EngineSpec(ApiObject):
    """Which engine serves the model."""

    kind: Annotated[EngineKind, Field(json_schema_extra=immutable("spec.engine.kind"))] = "builtin"
    """builtin: the warmpool worker loads, warms and serves the model itself. sidecar: an
    external OpenAI-compatible engine (vLLM, SGLang, TGI) serves it and the warmpool sidecar
    beside it prefetches weights, sends the warm-up prompts and owns readiness. Immutable."""
    image: Image | None = None
    """Container image of the external engine (sidecar only; required there)."""
    command: Annotated[list[Argument], Field(max_length=16)] | None = None
    """Entrypoint of the external engine (sidecar only); unset keeps the image's."""
    args: Annotated[list[Argument], Field(max_length=64)] | None = None
    """Arguments of the external engine (sidecar only). The model's directory is mounted at
    /warmpool/model, e.g. ["--model=/warmpool/model", "--port=8000"]."""
    env: (
        Annotated[
            list[EnvVar],
            Field(
                max_length=64,
                json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
            ),
        ]
        | None
    ) = None
    """Environment of the external engine's container (sidecar only)."""
    port: Port = DEFAULT_ENGINE_PORT
    """Port the external engine serves its OpenAI-compatible API on (sidecar only; ignored by builtin)."""
    health_path: Annotated[str, Field(max_length=256, pattern=r"^/\S*$")] = DEFAULT_ENGINE_HEALTH_PATH
    """Path the sidecar polls until the external engine answers (sidecar only; ignored by builtin)."""

    cel_rules = (
        Rule(
            cel="self.kind != 'sidecar' || has(self.image)",
            message="spec.engine.image is required when spec.engine.kind is sidecar",
            check=lambda e: e.kind != "sidecar" or e.image is not None,
            field_path=".image",
        ),
        Rule(
            cel="self.kind == 'sidecar' || !(has(self.image) || has(self.command) || has(self.args) || has(self.env))",
            message="spec.engine.image, command, args and env apply only when spec.engine.kind is sidecar",
            check=lambda e: e.kind == "sidecar" or all(getattr(e, f) is None for f in _SIDECAR_ONLY),
        ),
    )


# --- spec.pool --------------------------------------------------------------------------------


SleepLevel = Literal[1, 2]


class SleepSpec(ApiObject):
    """Put idle worker pods' engines to sleep (their accelerator memory given back) and wake them
    when they are needed again; sleeping pods stay Ready, out of the Service until awake.

    Sleeping pods count against replicas and minWarm (they are warm: a wake is well under a
    cold start). The operator never sleeps an engine that reports it cannot sleep."""

    after_idle_seconds: Annotated[int, Field(ge=1, le=MAX_SLEEP_AFTER_IDLE_SECONDS)] | None = None
    """A pod that received no request for this long is put to sleep, down to minAwake awake
    pods. Unset: no pod sleeps for idleness (memory pressure may still put idle pods to sleep)."""
    min_awake: Replicas = DEFAULT_SLEEP_MIN_AWAKE
    """Pods kept awake whatever happens; 0 lets the whole pool sleep (accelerator memory to zero:
    the sleeping pods then stay in the Service, and a request wakes the one it reaches)."""
    level: SleepLevel = 1  # DEFAULT_SLEEP_LEVEL (a Literal needs the literal here)
    """1: weights moved to host memory, KV cache and graphs freed (fastest wake). 2: weights
    dropped too and re-read from the files on wake (frees host memory as well)."""


class PredictiveSpec(ApiObject):
    """Warm capacity ahead of demand: the operator forecasts the pool's request rate from its own
    history and runs ⌈forecast p90 ÷ measured per-pod capacity⌉ pods one lead time (the measured
    cold-start p95, or the wake p95 while pods sleep) ahead. With an HPA or KEDA scaling the
    WarmModel it only raises the floor under their count, never lowers it."""

    enabled: bool = False
    """Act on the forecast; false keeps only the reactive count (replicas, minWarm)."""
    horizon_seconds: Annotated[int, Field(ge=1, le=86400)] = DEFAULT_PREDICTIVE_HORIZON_SECONDS
    """The lead time planned for until a cold start (or wake) has been measured."""
    max_extra_replicas: Annotated[int, Field(ge=0, le=MAX_POOL_REPLICAS)] = (
        DEFAULT_PREDICTIVE_MAX_EXTRA_REPLICAS
    )
    """Most pods prediction adds above what replicas (or the autoscaler) asks for."""


class ScaleToZeroSpec(ApiObject):
    """Run no pod at all while the pool has no traffic: the WarmModel's Service then routes to the
    activator, which holds each request, asks the operator for a pod (a sleeping one is woken
    first, else one is started) and forwards the request to the first pod that turns warm."""

    after_idle_seconds: Annotated[int, Field(ge=1, le=MAX_SLEEP_AFTER_IDLE_SECONDS)]
    """The pool goes to zero (sleeping pods released too) after this long with no request."""
    hold_timeout_seconds: Annotated[int, Field(ge=1, le=3600)] = DEFAULT_ZERO_HOLD_TIMEOUT_SECONDS
    """How long the activator holds a request before answering 503 (naming what it waited for)."""
    max_held_requests: Annotated[int, Field(ge=1, le=MAX_ZERO_HELD_REQUESTS)] = DEFAULT_ZERO_MAX_HELD_REQUESTS
    """Requests one activator replica holds for the pool at once; one more is answered 429 with Retry-After."""


class PoolSpec(ApiObject):
    """How many worker pods, and how many of them must be verified warm."""

    replicas: Replicas = DEFAULT_REPLICAS
    """Desired number of worker pods; the scale subresource (kubectl scale, HPA, KEDA) writes here."""
    min_warm: Replicas = DEFAULT_MIN_WARM
    """Pods that must be verified warm (not merely Ready) for the WarmModel to be Ready; the
    operator scales up, within maxReplicas, while fewer are warm."""
    max_replicas: Annotated[int, Field(ge=1, le=MAX_POOL_REPLICAS)] = DEFAULT_MAX_REPLICAS
    """Upper bound on worker pods, for scaling by hand, by an autoscaler or to reach minWarm."""
    sleep: SleepSpec | None = None
    """Sleep and wake of idle pods; unset: pods never sleep (and sleeping ones are woken)."""
    predictive: PredictiveSpec | None = None
    """Demand prediction (pre-warm ahead of a burst); unset: reactive only."""
    scale_to_zero: ScaleToZeroSpec | None = None
    """Scale to zero when idle, and back on the first request; unset: replicas and minWarm always run.
    With it, replicas and minWarm are the pool's size while it has traffic."""

    cel_rules = (
        Rule(
            cel="!has(self.scaleToZero) || !has(self.sleep) || self.sleep.minAwake == 0",
            message="spec.pool.sleep.minAwake must be 0 with spec.pool.scaleToZero (a pool at zero has no pod awake)",
            check=lambda p: p.scale_to_zero is None or p.sleep is None or p.sleep.min_awake == 0,
            field_path=".sleep.minAwake",
        ),
        Rule(
            cel="!has(self.scaleToZero) || !has(self.sleep) || !has(self.sleep.afterIdleSeconds) "
            "|| self.sleep.afterIdleSeconds < self.scaleToZero.afterIdleSeconds",
            message="spec.pool.sleep.afterIdleSeconds must be below spec.pool.scaleToZero.afterIdleSeconds "
            "(otherwise the pool goes to zero before any pod sleeps)",
            check=lambda p: p.scale_to_zero is None or p.sleep is None or p.sleep.after_idle_seconds is None
            or p.sleep.after_idle_seconds < p.scale_to_zero.after_idle_seconds,
            field_path=".sleep.afterIdleSeconds",
        ),
        Rule(
            cel="!has(self.sleep) || self.sleep.minAwake <= self.maxReplicas",
            message="spec.pool.sleep.minAwake must not exceed spec.pool.maxReplicas",
            check=lambda p: p.sleep is None or p.sleep.min_awake <= p.max_replicas,
            field_path=".sleep.minAwake",
        ),
        Rule(
            cel="self.minWarm <= self.maxReplicas",
            message="spec.pool.minWarm must not exceed spec.pool.maxReplicas",
            check=lambda p: p.min_warm <= p.max_replicas,
            field_path=".minWarm",
        ),
        Rule(
            cel="self.replicas <= self.maxReplicas",
            message="spec.pool.replicas must not exceed spec.pool.maxReplicas",
            check=lambda p: p.replicas <= p.max_replicas,
            field_path=".replicas",
        ),
    )


# --- spec.warmup ------------------------------------------------------------------------------


class ConfigMapKeyRef(ApiObject):
    """A key of a ConfigMap in the WarmModel's namespace."""

    name: DNS1123Subdomain
    """Name of the ConfigMap."""
    key: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")] = (
        CONFIGMAP_KEY_PROMPTS
    )
    """Key whose value is a JSON list of prompt strings."""


MAX_BUCKET_TOKENS = 131072


class WarmupSpec(ApiObject):
    """What a worker does to become warm before it reports Ready."""

    buckets: Annotated[list[Annotated[int, Field(ge=1, le=MAX_BUCKET_TOKENS)]], Field(min_length=1, max_length=16)] = (
        list(DEFAULT_LENGTH_BUCKETS)  # noqa: RUF012 (a pydantic default, copied per object)
    )
    """Prompt lengths in tokens to pre-fill at warm-up, strictly ascending. A truncated tier
    runs only the shortest."""
    prompts: (
        Annotated[list[Annotated[str, Field(min_length=1, max_length=16384)]], Field(min_length=1, max_length=64)]
        | None
    ) = None
    """Representative warm-up prompts, inline. Unset (and no promptsConfigMapRef) means the
    worker's built-in prompts."""
    prompts_config_map_ref: ConfigMapKeyRef | None = None
    """Take the warm-up prompts from a ConfigMap key instead of inline."""
    graph_capture: bool = True
    """Capture compute graphs (CUDA graphs / torch.compile) during warm-up, if the engine can."""
    kv_prefix_persistence: bool = False
    """Persist the warm prompts' prefix KV cache and reload it on the next start instead of
    recomputing it."""
    timeout_seconds: Annotated[int, Field(ge=1, le=3600)] = DEFAULT_WARMUP_TIMEOUT_SECONDS
    """Longest a worker may spend warming up before it reports Ready anyway (with fewer
    warm buckets) so a pool never stays cold forever."""
    learn_buckets: bool = False
    """Learn the warm-up lengths from the prompts the pool really gets (p50/p90/p99 of the
    prompt-length histogram, rounded up to graph-friendly sizes); pods started afterwards warm
    at those lengths instead of buckets (reported in status.learnedBuckets)."""

    cel_rules = (
        Rule(
            # isSorted() alone allows repeats; exists_one makes it strict (cost: maxItems^2).
            cel="self.buckets.isSorted() && self.buckets.all(b, self.buckets.exists_one(c, c == b))",
            message="spec.warmup.buckets must be strictly ascending, e.g. [32, 128, 512]",
            check=lambda w: all(a < b for a, b in pairwise(w.buckets)),
            field_path=".buckets",
        ),
        Rule(
            cel="!(has(self.prompts) && has(self.promptsConfigMapRef))",
            message="set spec.warmup.prompts or spec.warmup.promptsConfigMapRef, not both",
            check=lambda w: not (w.prompts is not None and w.prompts_config_map_ref is not None),
        ),
    )


# --- spec.gating ------------------------------------------------------------------------------


class GatingSpec(ApiObject):
    """How much warm-up to do, from the live accelerator-memory level (in percent used).

    Below truncateAtPercent: full warm-up. From truncateAtPercent: truncated (only the
    hottest hotLayerPercent of layers, shortest buckets). From pauseAtPercent: paused
    (no optional warm-up). A tier is left only hysteresisPercent points below its entry.
    """

    truncate_at_percent: Annotated[int, Field(ge=1, le=99)] = DEFAULT_TRUNCATE_AT_PERCENT
    """Memory used (percent) at which warm-up is truncated."""
    pause_at_percent: Annotated[int, Field(ge=2, le=100)] = DEFAULT_PAUSE_AT_PERCENT
    """Memory used (percent) at which optional warm-up pauses; above truncateAtPercent."""
    hysteresis_percent: Annotated[int, Field(ge=0, le=50)] = DEFAULT_HYSTERESIS_PERCENT
    """Points below a tier's entry threshold the level must fall before the tier is left."""
    hot_layer_percent: Annotated[int, Field(ge=1, le=100)] = DEFAULT_HOT_LAYER_PERCENT
    """Share of layers (the hottest first) a truncated warm-up touches."""

    cel_rules = (
        Rule(
            cel="self.truncateAtPercent < self.pauseAtPercent",
            message="spec.gating.truncateAtPercent must be below spec.gating.pauseAtPercent",
            check=lambda g: g.truncate_at_percent < g.pause_at_percent,
            field_path=".truncateAtPercent",
        ),
        Rule(
            cel="self.hysteresisPercent < self.truncateAtPercent",
            message="spec.gating.hysteresisPercent must be below spec.gating.truncateAtPercent",
            check=lambda g: g.hysteresis_percent < g.truncate_at_percent,
            field_path=".hysteresisPercent",
        ),
    )

    def thresholds(self) -> Thresholds:
        """The tier thresholds in the form the shared tier rule takes."""
        return Thresholds(
            truncate_at=self.truncate_at_percent,
            pause_at=self.pause_at_percent,
            hysteresis=self.hysteresis_percent,
        )


# --- spec.pod ---------------------------------------------------------------------------------


class Toleration(ApiObject):
    """A Kubernetes toleration, as in a Pod spec."""

    key: Annotated[str, Field(max_length=316)] | None = None
    """Taint key to tolerate; unset with operator Exists tolerates every taint."""
    operator: TolerationOperator | None = None
    """Exists or Equal (the default in Kubernetes)."""
    value: Annotated[str, Field(max_length=63)] | None = None
    """Taint value to match (operator Equal only)."""
    effect: TaintEffect | None = None
    """Taint effect to match; unset matches all effects."""
    toleration_seconds: Annotated[int, Field(ge=0, le=31536000, json_schema_extra={"format": "int64"})] | None = None
    """How long a NoExecute taint is tolerated before eviction; unset means forever."""

    cel_rules = (
        Rule(
            cel="!has(self.operator) || self.operator != 'Exists' || !has(self.value)",
            message="spec.pod.tolerations: value must be empty when operator is Exists",
            check=lambda t: t.operator != "Exists" or t.value is None,
        ),
    )


ResourceList = Annotated[dict[str, Quantity], Field(max_length=16)]
GPU_RESOURCE = "nvidia.com/gpu"


class ResourceRequirements(ApiObject):
    """Compute resources of the container that holds the model, as in a Pod spec."""

    requests: ResourceList | None = None
    """Minimum resources, e.g. {"cpu": "2", "memory": "8Gi"}."""
    limits: ResourceList | None = None
    """Maximum resources, e.g. {"nvidia.com/gpu": 1}."""

    cel_rules = (
        Rule(
            # Extended resources cannot be overcommitted: Kubernetes refuses a request with no limit.
            cel=f"!has(self.requests) || !('{GPU_RESOURCE}' in self.requests) "
            f"|| (has(self.limits) && '{GPU_RESOURCE}' in self.limits)",
            message=f"spec.pod.resources.limits must set {GPU_RESOURCE} when requests does "
            "(accelerators cannot be overcommitted)",
            check=lambda r: (
                r.requests is None
                or GPU_RESOURCE not in r.requests
                or (r.limits is not None and GPU_RESOURCE in r.limits)
            ),
        ),
    )


class LocalObjectReference(ApiObject):
    """A reference to an object by name in the WarmModel's namespace."""

    name: DNS1123Subdomain
    """Name of the object."""


#: A label or annotation key: an optional DNS-subdomain prefix and "/", then a name of at most 63.
_QUALIFIED_NAME = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                   r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")
_QUALIFIED_NAME_RE = re.compile(_QUALIFIED_NAME)
#: The same pattern inside a CEL string literal (where a backslash is itself escaped).
_QUALIFIED_NAME_CEL = _QUALIFIED_NAME.replace("\\", "\\\\")
LabelKey = Annotated[str, Field(min_length=1, max_length=317, pattern=_QUALIFIED_NAME)]
LabelValue = Annotated[str, Field(max_length=63, pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")]
DNS1123Label = Annotated[str, Field(min_length=1, max_length=63, pattern=rf"^{_DNS1123_LABEL}$")]
#: Keys the operator sets on its worker pods (and selects them by), which spec.pod.labels and
#: spec.pod.annotations may not set: a pod's identity is the operator's to say.
RESERVED_POD_LABELS = (LABEL_MODEL, LABEL_COMPONENT, LABEL_NAME, LABEL_INSTANCE, LABEL_MANAGED_BY, LABEL_AWAKE)
RESERVED_POD_ANNOTATIONS = (ANNOTATION_POD_DELETION_COST,)
#: Key prefixes of the API group (warmpool.dev/..., cache.warmpool.dev/...): the operator's and the agents'.
RESERVED_KEY_DOMAIN = API_GROUP
#: Volume names and container paths the operator's own pod layout uses (rules/builders.py).
RESERVED_VOLUME_NAMES = ("model", "config", "control", "tmp", "prompts", "kv-prefix", "shm")
RESERVED_MOUNT_PATHS = ("/warmpool", "/tmp", "/dev/shm")


def reserved_key(key: str, exact: tuple[str, ...]) -> bool:
    """Whether a label or annotation key is one the operator owns (exactly, or by its domain)."""
    prefix = key.rpartition("/")[0]
    return key in exact or prefix == RESERVED_KEY_DOMAIN or prefix.endswith(f".{RESERVED_KEY_DOMAIN}")


def _reserved_cel(var: str, exact: tuple[str, ...]) -> str:
    names = ", ".join(f"'{k}'" for k in exact)
    return (f"!({var} in [{names}]) && !{var}.startsWith('{RESERVED_KEY_DOMAIN}/') "
            f"&& !({var}.contains('.{RESERVED_KEY_DOMAIN}/'))")


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root + "/") for root in roots)


def _under_cel(var: str, roots: tuple[str, ...]) -> str:
    return " || ".join(f"{var} == '{r}' || {var}.startsWith('{r}/')" for r in roots)


LabelSelectorOperator = Literal["In", "NotIn", "Exists", "DoesNotExist"]
NodeSelectorOperator = Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
_Values = Annotated[list[Annotated[str, Field(max_length=253)]], Field(max_length=32)]


class LabelSelectorRequirement(ApiObject):
    """A label selector requirement, as in Kubernetes."""

    key: LabelKey
    """The label key."""
    operator: LabelSelectorOperator
    """In, NotIn, Exists or DoesNotExist."""
    values: _Values | None = None
    """Values for In and NotIn; empty for Exists and DoesNotExist."""


class LabelSelector(ApiObject):
    """A label selector, as in Kubernetes (the requirements are ANDed)."""

    match_labels: Annotated[dict[str, LabelValue], Field(max_length=16)] | None = None
    """Labels a pod must carry, key to value."""
    match_expressions: Annotated[list[LabelSelectorRequirement], Field(max_length=16)] | None = None
    """Requirements a pod's labels must meet."""


class NodeSelectorRequirement(ApiObject):
    """A node selector requirement, as in Kubernetes."""

    key: LabelKey
    """The node label key."""
    operator: NodeSelectorOperator
    """In, NotIn, Exists, DoesNotExist, Gt or Lt."""
    values: _Values | None = None
    """Values for In and NotIn; one integer for Gt and Lt; empty for Exists and DoesNotExist."""


class NodeSelectorTerm(ApiObject):
    """Node selector requirements, ANDed."""

    match_expressions: Annotated[list[NodeSelectorRequirement], Field(max_length=16)] | None = None
    """Requirements on the node's labels."""
    match_fields: Annotated[list[NodeSelectorRequirement], Field(max_length=16)] | None = None
    """Requirements on the node's fields (metadata.name)."""


class NodeSelector(ApiObject):
    """Node selector terms, ORed."""

    node_selector_terms: Annotated[list[NodeSelectorTerm], Field(min_length=1, max_length=8)]
    """A node matching any of the terms qualifies."""


class PreferredSchedulingTerm(ApiObject):
    """A weighted node preference."""

    weight: Annotated[int, Field(ge=1, le=100)]
    """Weight of the preference, 1-100."""
    preference: NodeSelectorTerm
    """The nodes preferred."""


class NodeAffinity(ApiObject):
    """Node affinity, as in Kubernetes."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    """Nodes a worker pod must run on."""
    preferred_during_scheduling_ignored_during_execution: (
        Annotated[list[PreferredSchedulingTerm], Field(max_length=8)] | None
    ) = None
    """Nodes a worker pod prefers (object-store sources add their own preference for nodes holding
    the revision after these)."""


class PodAffinityTerm(ApiObject):
    """Pods (by label, in namespaces) near which, per topology domain, a pod is placed or not."""

    label_selector: LabelSelector | None = None
    """The pods this term is about."""
    namespaces: Annotated[list[DNS1123Label], Field(max_length=16)] | None = None
    """Namespaces of those pods; unset means the WarmModel's."""
    namespace_selector: LabelSelector | None = None
    """Namespaces of those pods, by label."""
    topology_key: LabelKey
    """Node label whose value is the domain (e.g. kubernetes.io/hostname, topology.kubernetes.io/zone)."""


class WeightedPodAffinityTerm(ApiObject):
    """A weighted pod (anti-)affinity preference."""

    weight: Annotated[int, Field(ge=1, le=100)]
    """Weight of the preference, 1-100."""
    pod_affinity_term: PodAffinityTerm
    """The term."""


class PodAffinity(ApiObject):
    """Pod affinity or anti-affinity, as in Kubernetes."""

    required_during_scheduling_ignored_during_execution: (
        Annotated[list[PodAffinityTerm], Field(max_length=8)] | None
    ) = None
    """Terms a placement must meet."""
    preferred_during_scheduling_ignored_during_execution: (
        Annotated[list[WeightedPodAffinityTerm], Field(max_length=8)] | None
    ) = None
    """Terms a placement should meet."""


class Affinity(ApiObject):
    """Scheduling affinity of the worker pods, as in a Pod spec."""

    node_affinity: NodeAffinity | None = None
    """Which nodes."""
    pod_affinity: PodAffinity | None = None
    """Near which pods."""
    pod_anti_affinity: PodAffinity | None = None
    """Away from which pods."""


class TopologySpreadConstraint(ApiObject):
    """How the worker pods spread over topology domains, as in a Pod spec."""

    max_skew: Annotated[int, Field(ge=1, le=1000)]
    """Most the pod count of two domains may differ."""
    topology_key: LabelKey
    """Node label whose value is the domain, e.g. topology.kubernetes.io/zone."""
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    """DoNotSchedule (a hard rule) or ScheduleAnyway (a preference)."""
    label_selector: LabelSelector | None = None
    """The pods counted; unset means this WarmModel's worker pods."""
    min_domains: Annotated[int, Field(ge=1, le=1000)] | None = None
    """Fewest eligible domains (DoNotSchedule only)."""
    node_affinity_policy: Literal["Honor", "Ignore"] | None = None
    """Whether the pod's node affinity limits the domains counted."""
    node_taints_policy: Literal["Honor", "Ignore"] | None = None
    """Whether node taints limit the domains counted."""

    cel_rules = (
        Rule(
            cel="!has(self.minDomains) || self.whenUnsatisfiable == 'DoNotSchedule'",
            message="spec.pod.topologySpreadConstraints: minDomains needs whenUnsatisfiable DoNotSchedule",
            check=lambda t: t.min_domains is None or t.when_unsatisfiable == "DoNotSchedule",
            field_path=".minDomains",
        ),
    )


HostPathType = Literal["", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket",
                       "CharDevice", "BlockDevice"]


class HostPathVolume(ApiObject):
    """A node directory or file; it must lie under the operator's allowed host paths."""

    path: AbsolutePath
    """Absolute path on the node, no "." or ".." segments."""
    type: HostPathType | None = None
    """What must be there, as in Kubernetes (e.g. Directory); unset means no check."""


class EmptyDirVolume(ApiObject):
    """Scratch space that lives as long as the pod."""

    medium: Literal["", "Memory"] | None = None
    """"" (the node's disk) or Memory (tmpfs, counted against the pod's memory)."""
    size_limit: Quantity | None = None
    """Most the volume may hold, e.g. 10Gi."""


class ConfigMapVolume(ApiObject):
    """A ConfigMap of the WarmModel's namespace, its keys as files."""

    name: DNS1123Subdomain
    """Name of the ConfigMap."""
    optional: bool | None = None
    """Start the pod even if the ConfigMap is missing."""


class SecretVolume(ApiObject):
    """A Secret of the WarmModel's namespace, its keys as files."""

    secret_name: DNS1123Subdomain
    """Name of the Secret."""
    optional: bool | None = None
    """Start the pod even if the Secret is missing."""


class ClaimVolume(ApiObject):
    """A PersistentVolumeClaim of the WarmModel's namespace."""

    claim_name: DNS1123Subdomain
    """Name of the claim."""
    read_only: bool | None = None
    """Mount it read-only."""


class ExtraVolume(ApiObject):
    """A volume added to the worker pods. Exactly one source must be set."""

    name: DNS1123Label
    """Volume name, referred to by spec.pod.extraVolumeMounts; not one of the operator's own."""
    host_path: HostPathVolume | None = None
    """A node path (checked against the allowed host paths like a hostPath model; mounted read-only)."""
    empty_dir: EmptyDirVolume | None = None
    """Scratch space."""
    config_map: ConfigMapVolume | None = None
    """A ConfigMap's keys."""
    secret: SecretVolume | None = None
    """A Secret's keys."""
    persistent_volume_claim: ClaimVolume | None = None
    """A PersistentVolumeClaim."""

    cel_rules = (
        Rule(
            cel="[has(self.hostPath), has(self.emptyDir), has(self.configMap), has(self.secret), "
            "has(self.persistentVolumeClaim)].filter(x, x).size() == 1",
            message="spec.pod.extraVolumes: each volume needs exactly one of hostPath, emptyDir, configMap, "
            "secret or persistentVolumeClaim",
            check=lambda v: _count_set(v.host_path, v.empty_dir, v.config_map, v.secret,
                                       v.persistent_volume_claim) == 1,
        ),
        Rule(
            cel=f"!(self.name in [{', '.join(repr(n) for n in RESERVED_VOLUME_NAMES)}])",
            message="spec.pod.extraVolumes: the names " + ", ".join(RESERVED_VOLUME_NAMES)
            + " are the operator's own volumes",
            check=lambda v: v.name not in RESERVED_VOLUME_NAMES,
            field_path=".name",
        ),
    )


class ExtraVolumeMount(ApiObject):
    """A mount of one of spec.pod.extraVolumes into the container that holds the model (and, for
    sidecar, the warmpool sidecar too)."""

    name: DNS1123Label
    """Name of the volume in spec.pod.extraVolumes."""
    mount_path: AbsolutePath
    """Where in the container; not under /warmpool, /tmp or /dev/shm (the operator's own)."""
    read_only: bool | None = None
    """Mount read-only."""
    sub_path: RelativePath | None = None
    """A path inside the volume to mount instead of its root."""

    cel_rules = (
        Rule(
            cel=f"!({_under_cel('self.mountPath', RESERVED_MOUNT_PATHS)})",
            message="spec.pod.extraVolumeMounts: mountPath may not be " + ", ".join(RESERVED_MOUNT_PATHS)
            + " or lie under them (the operator's own mounts)",
            check=lambda m: not _under(m.mount_path, RESERVED_MOUNT_PATHS),
            field_path=".mountPath",
        ),
    )


#: A shared-memory size: a positive whole number of bytes with an optional binary or decimal suffix.
ShmSize = Annotated[str, Field(min_length=1, max_length=16, pattern=r"^[1-9][0-9]*(Ki|Mi|Gi|Ti|k|M|G|T)?$")]


#: spec.pod.drainSeconds' default: a few kube-proxy syncs on a busy node.
DEFAULT_DRAIN_SECONDS = 5


class PodSpec(ApiObject):
    """Pod-level settings of the worker pods."""

    resources: ResourceRequirements | None = None
    """Resources of the container holding the model (the worker for builtin, the engine for
    sidecar), including accelerators such as nvidia.com/gpu."""
    node_selector: Annotated[dict[str, Annotated[str, Field(max_length=63)]], Field(max_length=32)] | None = None
    """Node labels a worker pod's node must have."""
    tolerations: Annotated[list[Toleration], Field(max_length=32)] | None = None
    """Taints the worker pods tolerate (e.g. nvidia.com/gpu:NoSchedule)."""
    priority_class_name: DNS1123Subdomain | None = None
    """PriorityClass of the worker pods."""
    image: Image | None = None
    """Override of the warmpool worker image (the whole worker for builtin, the sidecar for
    sidecar); unset means the operator's default."""
    image_pull_policy: PullPolicy | None = None
    """Pull policy of the pod's images; unset means Kubernetes' default."""
    image_pull_secrets: Annotated[list[LocalObjectReference], Field(max_length=8)] | None = None
    """Secrets for pulling the pod's images."""
    port: Port = DEFAULT_WORKER_PORT
    """Port of the warmpool worker's HTTP server (/readyz, /metrics, control and, for builtin,
    the OpenAI-style API)."""
    worker_args: Annotated[list[Argument], Field(max_length=32)] | None = None
    """Extra command-line arguments appended to the warmpool worker's own (for example
    ["--device=cuda", "--memory-capacity-bytes=17179869184"]); the operator's arguments come
    first, so a repeated flag given here wins."""
    worker_env: (
        Annotated[
            list[EnvVar],
            Field(
                max_length=32,
                json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
            ),
        ]
        | None
    ) = None
    """Extra environment of the warmpool worker's container (e.g. HF_HOME, CUDA_VISIBLE_DEVICES)."""
    runtime_class_name: DNS1123Subdomain | None = None
    """RuntimeClass of the worker pods (e.g. nvidia, for the NVIDIA container runtime)."""
    service_account_name: DNS1123Subdomain | None = None
    """ServiceAccount the worker pods run as (e.g. one bound to a cloud role); unset means the
    namespace's default. Its API token is still not mounted (automountServiceAccountToken false)."""
    affinity: Affinity | None = None
    """Node and pod (anti-)affinity of the worker pods."""
    topology_spread_constraints: Annotated[list[TopologySpreadConstraint], Field(max_length=8)] | None = None
    """How the worker pods spread over zones or nodes."""
    labels: Annotated[dict[str, LabelValue], Field(max_length=32)] | None = None
    """Extra labels of the worker pods; never the operator's own (app.kubernetes.io/name, instance,
    component, managed-by, or any key under warmpool.dev)."""
    annotations: Annotated[dict[str, Annotated[str, Field(max_length=4096)]], Field(max_length=32)] | None = None
    """Extra annotations of the worker pods; never the operator's own (any key under warmpool.dev,
    controller.kubernetes.io/pod-deletion-cost)."""
    drain_seconds: Annotated[int, Field(ge=0, le=300)] = DEFAULT_DRAIN_SECONDS
    """Seconds a deleted worker pod (a drain's eviction, a scale-down, a rollout) keeps serving before
    its containers are told to stop: it leaves the Service's endpoints at once, and every node's
    kube-proxy stops sending it new connections within a sync or two, so requests routed to it
    meanwhile still land. 0: stop at once (batch pools nobody reaches through a Service)."""
    shm_size: ShmSize | None = None
    """Size of a shared-memory tmpfs at /dev/shm (an emptyDir of medium Memory), e.g. 8Gi: NCCL and
    PyTorch's data loaders need more than the runtime's 64 MB. Counted against the pod's memory."""
    extra_volumes: (
        Annotated[
            list[ExtraVolume],
            Field(
                max_length=16,
                json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
            ),
        ]
        | None
    ) = None
    """Volumes added to the worker pods. A hostPath among them must lie under the operator's allowed
    host paths, as a hostPath model must."""
    extra_volume_mounts: Annotated[list[ExtraVolumeMount], Field(max_length=32)] | None = None
    """Mounts of spec.pod.extraVolumes into the container holding the model (for sidecar, the engine's
    and the sidecar's)."""

    cel_rules = (
        Rule(
            cel=f"!has(self.labels) || self.labels.all(k, k.matches('{_QUALIFIED_NAME_CEL}') && "
            f"{_reserved_cel('k', RESERVED_POD_LABELS)})",
            message="spec.pod.labels: each key must be a label key (prefix/name) and not one of the operator's own ("
            + ", ".join(RESERVED_POD_LABELS) + f" or any key under {RESERVED_KEY_DOMAIN})",
            check=lambda p: all(_QUALIFIED_NAME_RE.match(k) and not reserved_key(k, RESERVED_POD_LABELS)
                                for k in p.labels or {}),
            field_path=".labels",
        ),
        Rule(
            cel=f"!has(self.annotations) || self.annotations.all(k, k.matches('{_QUALIFIED_NAME_CEL}') && "
            f"{_reserved_cel('k', RESERVED_POD_ANNOTATIONS)})",
            message="spec.pod.annotations: each key must be an annotation key (prefix/name) and not one of the "
            f"operator's own ({', '.join(RESERVED_POD_ANNOTATIONS)} or any key under {RESERVED_KEY_DOMAIN})",
            check=lambda p: all(_QUALIFIED_NAME_RE.match(k) and not reserved_key(k, RESERVED_POD_ANNOTATIONS)
                                for k in p.annotations or {}),
            field_path=".annotations",
        ),
        Rule(
            cel="!has(self.extraVolumeMounts) || self.extraVolumeMounts.all(m, has(self.extraVolumes) "
            "&& self.extraVolumes.exists(v, v.name == m.name))",
            message="spec.pod.extraVolumeMounts: each mount must name a volume of spec.pod.extraVolumes",
            check=lambda p: all(any(v.name == m.name for v in p.extra_volumes or ())
                                for m in p.extra_volume_mounts or ()),
            field_path=".extraVolumeMounts",
        ),
        Rule(
            # A writable node directory under the allowed prefixes could rewrite another WarmModel's
            # hostPath weights (they share those prefixes): node paths are mounted read-only.
            cel="!has(self.extraVolumeMounts) || !has(self.extraVolumes) || self.extraVolumeMounts.all(m, "
            "(has(m.readOnly) && m.readOnly) || !self.extraVolumes.exists(v, v.name == m.name && has(v.hostPath)))",
            message="spec.pod.extraVolumeMounts: a hostPath volume is mounted readOnly: true (another WarmModel's "
            "weights may lie under the same allowed host paths); use an emptyDir or a PersistentVolumeClaim to write",
            check=lambda p: all(m.read_only or not any(v.name == m.name and v.host_path is not None
                                                       for v in p.extra_volumes or ())
                                for m in p.extra_volume_mounts or ()),
            field_path=".extraVolumeMounts",
        ),
        Rule(
            cel="!has(self.extraVolumeMounts) || self.extraVolumeMounts.all(m, "
            "self.extraVolumeMounts.exists_one(n, n.mountPath == m.mountPath))",
            message="spec.pod.extraVolumeMounts: two mounts share a mountPath",
            check=lambda p: len({m.mount_path for m in p.extra_volume_mounts or ()})
            == len(p.extra_volume_mounts or ()),
            field_path=".extraVolumeMounts",
        ),
        Rule(
            # The API server checks this through the list-map key; the operator's parse must too.
            cel="!has(self.extraVolumes) "
            "|| self.extraVolumes.all(v, self.extraVolumes.exists_one(w, w.name == v.name))",
            message="spec.pod.extraVolumes: two volumes share a name",
            check=lambda p: len({v.name for v in p.extra_volumes or ()}) == len(p.extra_volumes or ()),
            field_path=".extraVolumes",
        ),
    )

    def extra_host_paths(self) -> tuple[str, ...]:
        """The node paths spec.pod.extraVolumes names."""
        return tuple(v.host_path.path for v in self.extra_volumes or () if v.host_path is not None)


# --- spec ------------------------------------------------------------------------------------


def _default_of(cls: type[ApiObject]) -> dict[str, Any]:
    """Schema extras giving an optional sub-object its full default.

    Not just ``{}``: the API server checks a default against the CEL rules without first
    filling in the defaults nested inside it, so ``{}`` would fail "no such key".
    """
    return {"default": cls().model_dump(by_alias=True, exclude_none=True)}


class WarmModelSpec(ApiObject):
    """The desired state of a pool of warm inference workers for one model."""

    model: ModelSpec
    """Where the weights are, their format and revision."""
    engine: Annotated[EngineSpec, Field(json_schema_extra=_default_of(EngineSpec))] = Field(default_factory=EngineSpec)
    """Which engine serves the model."""
    pool: Annotated[PoolSpec, Field(json_schema_extra=_default_of(PoolSpec))] = Field(default_factory=PoolSpec)
    """Pool size and warm minimum."""
    warmup: Annotated[WarmupSpec, Field(json_schema_extra=_default_of(WarmupSpec))] = Field(default_factory=WarmupSpec)
    """What warm-up means for this model."""
    gating: Annotated[GatingSpec, Field(json_schema_extra=_default_of(GatingSpec))] = Field(default_factory=GatingSpec)
    """Memory thresholds that scale warm-up down when the accelerator is busy."""
    pod: Annotated[PodSpec, Field(json_schema_extra=_default_of(PodSpec))] = Field(default_factory=PodSpec)
    """Pod-level settings of the worker pods."""

    cel_rules = (
        Rule(
            cel="self.engine.kind != 'sidecar' || self.engine.port != self.pod.port",
            message="spec.engine.port must differ from spec.pod.port: "
            "the engine and the sidecar share the pod's network",
            check=lambda s: s.engine.kind != "sidecar" or s.engine.port != s.pod.port,
            field_path=".engine.port",
        ),
        Rule(
            cel="!has(self.model.startOnPartialCache) || !self.model.startOnPartialCache "
            "|| self.engine.kind == 'builtin'",
            message="spec.model.startOnPartialCache needs spec.engine.kind builtin: an external engine reads "
            "its files whole and cannot wait for the bytes still filling",
            check=lambda s: not s.model.start_on_partial_cache or s.engine.kind == "builtin",
            field_path=".model.startOnPartialCache",
        ),
    )


# --- status ----------------------------------------------------------------------------------


class Condition(ApiObject):
    """One aspect of the WarmModel's state, as metav1.Condition."""

    type: Annotated[
        str,
        Field(
            min_length=1,
            max_length=316,
            pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
            r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
        ),
    ]
    """Ready, Progressing, Degraded or WarmupGated."""
    status: ConditionStatus
    """True, False or Unknown."""
    observed_generation: Annotated[int, Field(ge=0, json_schema_extra={"format": "int64"})] | None = None
    """metadata.generation the condition was computed from."""
    last_transition_time: Annotated[str, Field(max_length=64, json_schema_extra={"format": "date-time"})]
    """When the status last changed (RFC 3339)."""
    reason: Annotated[str, Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")]
    """Why, in one CamelCase word (e.g. MinWarmReached, WarmingUp, MemoryPressure)."""
    message: Annotated[str, Field(max_length=32768)]
    """Why, for people."""


class TierCounts(ApiObject):
    """Worker pods in each warm-up tier."""

    full: Annotated[int, Field(ge=0)] = 0
    """Pods running the full warm-up."""
    truncated: Annotated[int, Field(ge=0)] = 0
    """Pods running a truncated warm-up (memory above truncateAtPercent)."""
    paused: Annotated[int, Field(ge=0)] = 0
    """Pods with optional warm-up paused (memory above pauseAtPercent)."""
    unknown: Annotated[int, Field(ge=0)] = 0
    """Pods whose memory figure is missing, stale or garbage."""

    def summary(self) -> str:
        """The short form shown in `kubectl get wm` (status.tierSummary)."""
        text = f"full={self.full} truncated={self.truncated} paused={self.paused}"
        return f"{text} unknown={self.unknown}" if self.unknown else text


NonNegativeSeconds = Annotated[float, Field(ge=0)]


class ColdStart(ApiObject):
    """Cold-start durations of worker pods, process start to warm and Ready, in seconds."""

    last_seconds: NonNegativeSeconds | None = None
    """The most recent pod's cold start."""
    p50_seconds: NonNegativeSeconds | None = None
    """Median over the pool's recent cold starts."""
    p95_seconds: NonNegativeSeconds | None = None
    """95th percentile over the pool's recent cold starts."""

    @model_validator(mode="after")
    def _finite(self) -> Self:
        for value in (self.last_seconds, self.p50_seconds, self.p95_seconds):
            if value is not None and not math.isfinite(value):
                raise ValueError("status.coldStart figures must be finite")
        return self


class WakeFigures(ApiObject):
    """How long the pool's pods took to wake, from the workers' wake histograms (seconds)."""

    p50_seconds: NonNegativeSeconds | None = None
    """Median wake over the wakes the live pods recorded."""
    p95_seconds: NonNegativeSeconds | None = None
    """95th percentile wake (a histogram bucket's upper bound, interpolated)."""

    @model_validator(mode="after")
    def _finite(self) -> Self:
        for value in (self.p50_seconds, self.p95_seconds):
            if value is not None and not math.isfinite(value):
                raise ValueError("status.wake figures must be finite")
        return self


class NodeCacheProgress(ApiObject):
    """One node's cache of the model's revision, as that node's agent last reported it."""

    node: Annotated[str, Field(min_length=1, max_length=253)]
    """The node's name."""
    source: Annotated[str, Field(min_length=16, max_length=16, pattern=r"^[0-9a-f]{16}$")]
    """Fingerprint of the spec.model.http/s3 block the entry is for (older entries are ignored)."""
    revision: Annotated[str, Field(max_length=71, pattern=r"^sha256:[0-9a-f]{64}$")] | None = None
    """The revision's digest (SHA-256 of its manifest), once the agent has read the manifest."""
    bytes_cached: Annotated[int, Field(ge=0, json_schema_extra={"format": "int64"})] = 0
    """Bytes of the revision's blocks present in the node's cache."""
    bytes_total: Annotated[int, Field(ge=0, json_schema_extra={"format": "int64"})] = 0
    """Bytes of the revision's blocks in all."""
    published: bool = False
    """The revision is published on the node (complete; worker pods there may start)."""
    message: Annotated[str, Field(max_length=1024)] | None = None
    """Why the fill failed, when it did."""
    path: Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^/")] | None = None
    """The real path, on the node, of the revision's directory pods mount (links resolved)."""


NonNegativeFloat = Annotated[float, Field(ge=0)]
LeadTimeSource = Literal["wake_p95", "cold_start_p95", "horizon_seconds"]


class ForecastStatus(ApiObject):
    """Demand prediction's latest figures (spec.pool.predictive)."""

    rate_now: NonNegativeFloat | None = None
    """Requests per second over the last full history step."""
    predicted_rate: NonNegativeFloat | None = None
    """Forecast p90 requests per second one lead time ahead."""
    predicted_rate_p50: NonNegativeFloat | None = None
    """Forecast p50 requests per second one lead time ahead."""
    horizon_seconds: NonNegativeFloat | None = None
    """The lead time forecast for: how long capacity asked for now takes to serve."""
    lead_time_source: LeadTimeSource | None = None
    """Where the lead time comes from: the measured wake p95, cold-start p95, or horizonSeconds."""
    model: Annotated[str, Field(max_length=64)] | None = None
    """The forecaster used: the best recent performer of lightgbm and the baselines."""
    recent_error: NonNegativeFloat | None = None
    """The used forecaster's recent mean quantile (pinball) loss, in requests per step."""
    capacity_per_pod: NonNegativeFloat | None = None
    """Requests per second one pod serves while busy, measured from the workers' throughput: the
    best point of their capacity curve (requests finished per busy second at one batch size)."""
    desired_replicas: Annotated[int, Field(ge=0)] | None = None
    """Pods the forecast asks for (after maxExtraReplicas and maxReplicas); unset: no action."""
    history_steps: Annotated[int, Field(ge=0)] | None = None
    """Steps of request history held (persisted in ConfigMap <name>-history)."""
    step_seconds: Annotated[int, Field(ge=1)] | None = None
    """The history's resolution."""
    reason: Annotated[str, Field(max_length=1024)] | None = None
    """Why the forecaster and the decision did what they did."""


class LearnedBucketsStatus(ApiObject):
    """Warm-up lengths learned from the prompt-length histogram (spec.warmup.learnBuckets)."""

    buckets: Annotated[list[Annotated[int, Field(ge=1)]], Field(max_length=16)] | None = None
    """The learned lengths new pods warm at (unset: none learned yet, spec.warmup.buckets used)."""
    prompts_per_bucket: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=16)] | None = None
    """Observed prompts each learned length serves (longer than the one below, no longer than it)."""
    longer_than_all: Annotated[int, Field(ge=0)] | None = None
    """Observed prompts longer than every learned length."""
    observed: Annotated[int, Field(ge=0)] | None = None
    """Prompts in the histogram the lengths were learned from."""
    reason: Annotated[str, Field(max_length=1024)] | None = None
    """How they were chosen, or why none were."""


#: Most pods listed in status.pods: a large pool's status stays small; the rest are counted.
MAX_LISTED_PODS = 16


class PodProgress(ApiObject):
    """One worker pod's cold start, as its own metrics (and, before it reports any, the kubelet) show it."""

    name: Annotated[str, Field(min_length=1, max_length=253)]
    """The pod's name."""
    stage: Annotated[str, Field(min_length=1, max_length=64)]
    """Where its cold start is: the worker's last phase reached (process_start, imports_done,
    weights_mapped, first_layer_ready, weights_loaded, warmup_done, ready), "asleep", or before the
    worker reports, the pod's own state (Pending, ContainerCreating, CrashLoopBackOff, Starting...)."""
    warm: bool = False
    """Verified warm: Ready, and its own metrics say so."""
    layers_resident: Annotated[int, Field(ge=0)] | None = None
    """Model layers resident in memory."""
    layers_total: Annotated[int, Field(ge=0)] | None = None
    """Model layers in all."""
    prefills_done: Annotated[int, Field(ge=0)] | None = None
    """Warm-up prefills done (at most prefillsPlanned)."""
    prefills_planned: Annotated[int, Field(ge=0)] | None = None
    """Warm-up prefills its warm-up plan needs: a bucket whose latency settled early counts the
    prefills it ran, the others what the plan asked for."""
    seconds_left: Annotated[int, Field(ge=0)] | None = None
    """Estimated seconds until warm: the pool's own median past cold start less this pod's time so
    far (unset: warm, failing, or no past cold start to go by)."""
    message: Annotated[str, Field(max_length=1024)] | None = None
    """Why it is failing, when it is (its container's last termination message when there is one)."""


class WarmModelStatus(ApiObject):
    """The observed state, written by the operator (cacheNodes: by the node agents).
    Decisions never read it back, except the revision digest the node agents report."""

    observed_generation: Annotated[int, Field(ge=0, json_schema_extra={"format": "int64"})] | None = None
    """metadata.generation the operator last acted on."""
    conditions: (
        Annotated[
            list[Condition],
            Field(
                max_length=16,
                json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
            ),
        ]
        | None
    ) = None
    """Ready, Progressing, Degraded and WarmupGated, one entry per type."""
    replicas: Annotated[int, Field(ge=0)] | None = None
    """Worker pods that exist (the scale subresource's current replicas)."""
    ready_replicas: Annotated[int, Field(ge=0)] | None = None
    """Worker pods whose readiness probe passes."""
    warm_replicas: Annotated[int, Field(ge=0)] | None = None
    """Worker pods verified warm from their own metrics."""
    tier_counts: TierCounts | None = None
    """Worker pods in each warm-up tier."""
    tier_summary: Annotated[str, Field(max_length=128)] | None = None
    """Tier mix in one line for `kubectl get wm`, e.g. "full=2 truncated=1 paused=0"."""
    cold_start: ColdStart | None = None
    """Cold-start figures from the workers' phase metrics."""
    awake_replicas: Annotated[int, Field(ge=0)] | None = None
    """Worker pods whose engine is awake (what the Service routes to)."""
    sleeping_replicas: Annotated[int, Field(ge=0)] | None = None
    """Worker pods whose engine sleeps (spec.pool.sleep): Ready, woken when needed."""
    held: Annotated[int, Field(ge=0)] | None = None
    """Requests the activator replicas hold for the pool while no pod is awake and warm (spec.pool.scaleToZero)."""
    wake: WakeFigures | None = None
    """Wake durations from the workers' metrics (spec.pool.sleep)."""
    selector: Annotated[str, Field(max_length=1024)] | None = None
    """Label selector of the worker pods, for the scale subresource (HPA)."""
    cache_nodes: (
        Annotated[
            list[NodeCacheProgress],
            Field(
                max_length=5000,
                json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["node"]},
            ),
        ]
        | None
    ) = None
    """Per node, the node-local cache's fill of this revision (http/s3 sources): one entry per
    node, each written by that node's agent (its own server-side-apply field manager)."""
    forecast: ForecastStatus | None = None
    """Demand prediction's figures (spec.pool.predictive)."""
    learned_buckets: LearnedBucketsStatus | None = None
    """Warm-up lengths learned from traffic (spec.warmup.learnBuckets)."""
    url: Annotated[str, Field(max_length=512)] | None = None
    """The pool's in-cluster address, http://<service>.<namespace>.svc:<port> (the cluster's DNS search
    path completes the domain), as KServe and Knative give theirs."""
    pods: (
        Annotated[
            list[PodProgress],
            Field(
                max_length=MAX_LISTED_PODS,
                json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
            ),
        ]
        | None
    ) = None
    """Each worker pod's cold-start progress: pods not yet warm first (failing, then warming), then
    warm ones, by name; at most 16 (podsNotListed counts the rest)."""
    pods_not_listed: Annotated[int, Field(ge=0)] | None = None
    """Worker pods left out of status.pods (a large pool)."""

    def condition(self, type_: str) -> Condition | None:
        """The condition of this type, if present."""
        return next((c for c in self.conditions or () if c.type == type_), None)


# --- the object ------------------------------------------------------------------------------

_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _name_ok(metadata: Mapping[str, Any]) -> bool:
    name = metadata.get("name")
    if name is None:  # a template or a generateName object not yet named
        return True
    return (
        isinstance(name, str) and len(name) <= MAX_WARMMODEL_NAME_LENGTH and bool(_DNS1035_LABEL.match(name))
    )


class WarmModel(ApiObject):
    """A pool of inference workers for one model that counts a worker Ready only when it is
    warm: weights mapped hottest first, representative prompts pre-filled, graphs captured,
    with warm-up scaled to the live accelerator-memory level."""

    api_version: Literal["warmpool.dev/v1alpha1"] = "warmpool.dev/v1alpha1"
    """APIVersion of this object."""
    kind: Literal["WarmModel"] = "WarmModel"
    """Kind of this object."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Standard object metadata."""
    spec: WarmModelSpec
    """The desired state."""
    status: WarmModelStatus | None = None
    """The observed state."""

    cel_rules = (
        Rule(
            # Children are "<name>-<suffix>" Services and labels: DNS-1035 with room to spare.
            cel=f"self.metadata.name.size() <= {MAX_WARMMODEL_NAME_LENGTH} "
            "&& self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
            message=f"metadata.name must be a DNS-1035 label (lower case, starting with a letter) of at most "
            f"{MAX_WARMMODEL_NAME_LENGTH} characters",
            check=lambda w: _name_ok(w.metadata),
        ),
    )


# --- parsing for the operator -----------------------------------------------------------------


class InvalidWarmModel(ValueError):
    """A WarmModel that breaks the API's rules; ``errors`` holds one line per problem."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


def _plain(value: Any) -> Any:
    """Deep-copy kopf's mapping views into plain dicts and lists (strict mode wants those)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _location(prefix: str, loc: tuple[int | str, ...]) -> str:
    text = prefix
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<root>"


def _errors(error: ValidationError, prefix: str) -> list[str]:
    lines = []
    for item in error.errors(include_url=False):
        message = str(item["msg"]).removeprefix("Value error, ")
        lines.append(f"{_location(prefix, tuple(item['loc']))}: {message}")
    return lines


def parse_warmmodel(body: Mapping[str, Any]) -> WarmModel:
    """Parse a whole WarmModel object; raises :class:`InvalidWarmModel` naming each bad field."""
    try:
        return WarmModel.model_validate(_plain(body))
    except ValidationError as error:
        raise InvalidWarmModel(_errors(error, "")) from None


def parse_spec(spec: Mapping[str, Any]) -> WarmModelSpec:
    """Parse a WarmModel's spec; raises :class:`InvalidWarmModel` naming each bad field."""
    try:
        return WarmModelSpec.model_validate(_plain(spec))
    except ValidationError as error:
        raise InvalidWarmModel(_errors(error, "spec")) from None


def dump_status(status: WarmModelStatus) -> dict[str, Any]:
    """The status in the API's camelCase form, unset fields left out (for a status patch)."""
    return status.model_dump(by_alias=True, exclude_none=True)
