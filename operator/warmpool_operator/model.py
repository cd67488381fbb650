"""The nouns every layer of the operator shares, each defined once.

* :data:`Obj`: a Kubernetes object as the API server sends it and the builders make it (JSON);
* :class:`Target`: what the builders and the pass need of one WarmModel (identity, parsed spec,
  and where an object-store source's pods find their revision: :class:`CacheRevision`);
* :class:`Sample`: what one scrape of one worker's ``/metrics`` said (io/worker_metrics.py reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from warmpool.contract.api import Tier
from warmpool.contract.files import MODEL_MOUNT_PATH
from warmpool.contract.nodecache import (
    CACHE_DOMAINS_DIR,
    CACHE_GRANTED_DIR,
    CACHE_PARTIAL_DIR,
    CACHE_ROOT_MOUNT_PATH,
)
from warmpool_operator.api.types import WarmModelSpec

#: Default image of the warmpool worker (the whole worker for builtin, the sidecar for sidecar).
DEFAULT_WORKER_IMAGE = "ghcr.io/warmpool/worker:0.1.0"


Obj = dict[str, Any]


@dataclass(frozen=True)
class CacheRevision:
    """Where the worker pods find the revision: the node cache root, the revision's digest, and the
    trust domain whose link to it they mount (the WarmModel's namespace; the node agent links a
    revision there only once that namespace's own source sent every byte of it)."""

    root: str
    digest: str  # sha256:<64 hex>
    domain: str  # the WarmModel's namespace
    #: spec.model.startOnPartialCache: the pods start on the revision's partial view
    partial: bool = False

    @property
    def hex(self) -> str:
        return self.digest.removeprefix("sha256:")

    @property
    def host_dir(self) -> str:
        """The node directory the pod's volume names: the cache root (only the operator's init
        container mounts it whole; the worker mounts ``link`` in it)."""
        return self.root.rstrip("/")

    @property
    def link(self) -> str:
        """The domain's link to the revision (to its partial view, for a partial start), relative to
        the cache root: the worker's ``subPath``, which the kubelet resolves when the container starts."""
        kind = CACHE_PARTIAL_DIR if self.partial else CACHE_GRANTED_DIR
        return f"{CACHE_DOMAINS_DIR}/{self.domain}/{kind}/{self.hex}"

    @property
    def model_path(self) -> str:
        """The worker's --model inside the container."""
        return MODEL_MOUNT_PATH

    @property
    def wait_mount(self) -> str:
        return CACHE_ROOT_MOUNT_PATH

    @property
    def waited_path(self) -> str:
        """What the init container waits for (inside its mount): the domain's link to the published
        revision, or for a partial start to its view."""
        return f"{CACHE_ROOT_MOUNT_PATH}/{self.link}"


@dataclass(frozen=True)
class Target:
    """What the builders need about one WarmModel: its identity and its parsed spec."""

    name: str
    namespace: str
    spec: WarmModelSpec
    #: For an http/s3 source: the node cache root and the revision's digest (rules/object_store_pods.py).
    cache: CacheRevision | None = None
    #: The operator's default worker image (--worker-image), for a spec that names none.
    default_worker_image: str = DEFAULT_WORKER_IMAGE

    @property
    def worker_image(self) -> str:
        return self.spec.pod.image or self.default_worker_image


@dataclass
class Sample:
    """What one scrape of one worker told us (``error`` set: nothing usable)."""

    error: str | None = None
    used_ratio: float | None = None
    used_bytes: float | None = None
    capacity_bytes: float | None = None
    ready: bool = False
    tier: Tier | None = None  # the worker's effective tier
    warmup_tier: Tier | None = None  # the tier its last warm-up ran at
    layers_resident: int | None = None
    layers_total: int | None = None
    #: phase -> seconds since process start / unix timestamp
    phase_durations: dict[str, float] = field(default_factory=dict)
    phase_timestamps: dict[str, float] = field(default_factory=dict)
    prefills: dict[str, float] = field(default_factory=dict)  # bucket -> count
    #: bucket -> warm-up prompts the worker's last warm-up plan asked for
    planned_prefills: dict[str, float] = field(default_factory=dict)
    #: bucket -> warm-up prompts that plan needs, a settled bucket's early stop counted (older workers: none)
    needed_prefills: dict[str, float] = field(default_factory=dict)
    heat: dict[int, float] = field(default_factory=dict)
    digest: str | None = None
    num_layers: int | None = None
    #: sleep: the level slept at (0 awake; None: the worker has no sleep metric), whether
    #: the engine can sleep (None: not known yet), completions received and in flight
    sleep_level: int | None = None
    sleep_capable: bool | None = None
    requests_total: float | None = None
    requests_in_flight: float | None = None
    #: the wake-duration histogram: upper bound (seconds, inf last) -> cumulative count
    wake_buckets: dict[float, float] = field(default_factory=dict)
    #: demand prediction: the prompt-token histogram of served requests (upper bound in
    #: tokens, inf last -> cumulative count), its count, and the engine's busy seconds
    prompt_buckets: dict[float, float] = field(default_factory=dict)
    prompt_count: float | None = None
    busy_seconds: float | None = None
    #: the capacity curve's counters, by batch-size bucket (its lower edge): engine-busy seconds
    #: and requests finished at that batch size (empty: the worker does not batch or export them)
    batch_seconds: dict[int, float] = field(default_factory=dict)
    batch_finished: dict[int, float] = field(default_factory=dict)
    #: when the scrape was sent (monotonic; 0 when not from a scrape): a sample sent
    #: before a sleep or wake of the pod finished says nothing of its state after it
    sent_at: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None
