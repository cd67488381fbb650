"""The warm-up core, shared by the built-in engine (`serve`) and the sidecar.

Two halves, kept apart so the sidecar can reuse the first with its own executor:

* **Plan** (pure): from the tier, the layer order, the length buckets and the prompt set,
  decide which buckets to pre-fill, how many prompts each, and which layers to force
  resident.  `plan_warmup`, `WarmupProgress.remaining` (a deeper plan only tops up what a
  shallower one already did), and prompt sizing to a bucket, both exactly with a tokenizer
  (`sized_prompt_tokens`) and approximately without one (`sized_prompt_text`, for an
  external engine reached over HTTP).
* **Execute**: `execute_plan` runs a plan on an `engine_api.Engine` (prefill + a short
  decode per prompt); the sidecar executes the same plan over `/v1/completions`.  A bucket
  stops early once its latency has settled (`SettleRule`): the plan's prompts per bucket is
  the ceiling, not a fixed count.

Depth by tier:

* ``full`` (and ``unknown``: no figure is no reason to hold back): every bucket, every layer
  forced resident in heat order, ``prompts_per_bucket`` prompts per bucket.
* ``truncated``: only the hottest ``hot_layer_percent`` of layers forced resident, only the
  shortest ``truncated_buckets`` bucket(s), one prompt each.  The forward pass of that
  prompt still passes every layer, and the engine loads a missing layer on first use (a
  request must never see a missing weight); what truncation saves is the long-bucket
  prefills (their activations and KV), the extra prompts, and the up-front ordered load.
* ``paused``: nothing optional: embeddings/norm/head mapped, no prefill (a prefill would
  pull every layer in), ready on core readiness alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from warmpool_worker.config import WarmupConfig
from warmpool_worker.defaults import (
    DEFAULT_CHARS_PER_TOKEN,
    DEFAULT_DECODE_TOKENS,
    DEFAULT_PROMPTS_PER_BUCKET,
    DEFAULT_SETTLE_MIN_PREFILLS,
    DEFAULT_SETTLE_TOLERANCE,
)
from warmpool_worker.engine_api import Engine, LayerProgress, ModelLoadError

from warmpool.contract.api import DEFAULT_HOT_LAYER_PERCENT, DEFAULT_LENGTH_BUCKETS, Tier
from warmpool.contract.files import LEARNED_BUCKETS_FORMAT
from warmpool.heatmap import hot_layers

log = logging.getLogger(__name__)

DEFAULT_TRUNCATED_BUCKETS = 1
MAX_PROMPTS = 1024
MAX_PROMPT_CHARS = 1 << 20

#: Built-in representative prompts: chat, instruction following, code, summarisation and
#: retrieval-style context, so the warm-up touches the token mix real traffic brings.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant. Answer the user's question clearly and concisely.\n\n"
    "User: What are the main differences between a process and a thread in an operating system?\n"
    "Assistant:",
    "Summarise the following text in three sentences.\n\nThe city council met on Tuesday to discuss "
    "the new budget for public transport. After a long debate, members agreed to increase funding "
    "for bus routes in the northern districts, while postponing a decision on the tram extension "
    "until an independent study of ridership has been published next spring.",
    "Write a Python function that returns the n-th Fibonacci number using iteration, with type "
    "hints and a docstring.\n\ndef fibonacci(n: int) -> int:\n",
    "Translate to French: The weather is lovely today, so we will have lunch in the garden and "
    "go for a walk by the river in the afternoon.",
    "Context: Kubernetes schedules pods onto nodes according to resource requests, affinity rules "
    "and taints. A readiness probe decides whether a pod receives traffic from a Service.\n\n"
    "Question: Why should a readiness probe only succeed once a model server is warm?\nAnswer:",
    "List five practical tips for writing clear technical documentation, one per line.",
)


class PromptsError(ValueError):
    """A prompts file that cannot be used; the message names the file and the problem."""


def load_prompts(path: Path | None) -> list[str]:
    """The prompt set: the built-in one, or a file (as mounted from the WarmModel's ConfigMap).

    Accepted: a JSON list of strings, a JSON object ``{"prompts": [...]}``, or plain text
    with prompts separated by blank lines (any file that does not start with ``[`` or ``{``).
    """
    if path is None:
        return list(DEFAULT_PROMPTS)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PromptsError(f"{path}: cannot read prompts: {error}") from None
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            body = json.loads(text)
        except json.JSONDecodeError as error:
            raise PromptsError(f"{path}: not JSON: {error}") from None
        items = body.get("prompts") if isinstance(body, dict) else body
        if not isinstance(items, list) or not all(isinstance(p, str) for p in items):
            raise PromptsError(f"{path}: expected a list of strings (or {{'prompts': [...]}})")
        prompts = [p for p in items if p.strip()]
    else:
        prompts = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not prompts:
        raise PromptsError(f"{path}: no prompts in the file")
    if len(prompts) > MAX_PROMPTS:
        raise PromptsError(f"{path}: {len(prompts)} prompts, at most {MAX_PROMPTS}")
    too_long = [i for i, p in enumerate(prompts) if len(p) > MAX_PROMPT_CHARS]
    if too_long:
        raise PromptsError(f"{path}: prompt {too_long[0]} is longer than {MAX_PROMPT_CHARS} characters")
    return prompts


def parse_buckets(text: str) -> tuple[int, ...]:
    """``"32,128,512"`` -> (32, 128, 512): positive, distinct, sorted."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"buckets must be comma-separated token counts, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"buckets must be positive token counts, got {text!r}")
    return tuple(sorted(set(values)))


#: Largest learned-buckets file read (a few numbers; anything bigger is not one).
MAX_LEARNED_BUCKETS_BYTES = 4096


def read_learned_buckets(path: Path | None) -> tuple[int, ...] | None:
    """The warm-up lengths the operator learned from traffic (spec.warmup.learnBuckets), written
    into the WarmModel's ConfigMap; None when there are none yet (no file: ``--buckets`` stands).

    A file that is there but unusable is logged, naming what is wrong, and ``--buckets`` stands:
    a bad learned file must never keep a pod from warming up."""
    if path is None or not path.exists():
        return None
    try:
        raw = path.read_bytes()[: MAX_LEARNED_BUCKETS_BYTES + 1]
        if len(raw) > MAX_LEARNED_BUCKETS_BYTES:
            raise ValueError(f"larger than {MAX_LEARNED_BUCKETS_BYTES} bytes")
        document = json.loads(raw)
        if not isinstance(document, dict) or document.get("format") != LEARNED_BUCKETS_FORMAT:
            raise ValueError(f"not a {LEARNED_BUCKETS_FORMAT} document")
        buckets = document.get("buckets")
        if (not isinstance(buckets, list) or not buckets or len(buckets) > 16
                or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in buckets)):
            raise ValueError(f"buckets must be 1..16 positive token counts, got {buckets!r}"[:200])
    except (OSError, ValueError) as error:
        log.warning("learned warm-up lengths %s not used (%s): warming at --buckets", path, error)
        return None
    learned = tuple(sorted(set(buckets)))
    log.info("warming at the lengths learned from traffic %s (from %s)", list(learned), path)
    return learned


# -- planning (pure) --------------------------------------------------------------------
@dataclass(frozen=True)
class WarmupPlan:
    tier: Tier
    buckets: tuple[int, ...]  # prompt lengths in tokens, shortest first
    prompts_per_bucket: int
    resident_layers: tuple[int, ...]  # layers forced resident, in load order (hottest first)
    decode_tokens: int

    def per_bucket(self) -> dict[int, int]:
        return {bucket: self.prompts_per_bucket for bucket in self.buckets}

    @property
    def total_prefills(self) -> int:
        return len(self.buckets) * self.prompts_per_bucket

    def is_empty(self) -> bool:
        return not self.buckets and not self.resident_layers

    def describe(self) -> dict[str, object]:
        return {
            "tier": self.tier.value,
            "buckets": list(self.buckets),
            "prompts_per_bucket": self.prompts_per_bucket,
            "forced_layers": len(self.resident_layers),
        }


def fit_buckets(buckets: Sequence[int], max_context: int | None, decode_tokens: int) -> tuple[int, ...]:
    """Buckets that fit prompt + decode in the context; an oversize bucket shrinks to the largest fit."""
    if max_context is None:
        return tuple(sorted(set(buckets)))
    limit = max_context - decode_tokens
    if limit < 1:
        return ()
    return tuple(sorted({min(bucket, limit) for bucket in buckets if bucket > 0}))


def plan_warmup(
    tier: Tier,
    *,
    layer_order: Sequence[int],
    buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
    hot_layer_percent: float = DEFAULT_HOT_LAYER_PERCENT,
    prompts_per_bucket: int = DEFAULT_PROMPTS_PER_BUCKET,
    decode_tokens: int = DEFAULT_DECODE_TOKENS,
    max_context: int | None = None,
    truncated_buckets: int = DEFAULT_TRUNCATED_BUCKETS,
) -> WarmupPlan:
    """What to warm at this tier (see the module docstring for the depth of each tier)."""
    if prompts_per_bucket < 1:
        raise ValueError(f"prompts_per_bucket must be >= 1, got {prompts_per_bucket}")
    fitted = fit_buckets(buckets, max_context, decode_tokens)
    if tier is Tier.PAUSED:
        return WarmupPlan(tier, (), 0, (), decode_tokens)
    if tier is Tier.TRUNCATED:
        return WarmupPlan(
            tier,
            fitted[: max(0, truncated_buckets)],
            1,
            tuple(hot_layers(layer_order, hot_layer_percent)),
            decode_tokens,
        )
    return WarmupPlan(tier, fitted, prompts_per_bucket, tuple(layer_order), decode_tokens)


def plan_for_tier(
    tier: Tier, config: WarmupConfig, layer_order: Sequence[int], max_context: int | None
) -> WarmupPlan:
    """The plan for this tier from the warm-up settings `serve` and `sidecar` share
    (--buckets, --hot-layer-percent, --prompts-per-bucket, --decode-tokens)."""
    return plan_warmup(
        tier,
        layer_order=layer_order,
        buckets=config.buckets,
        hot_layer_percent=config.hot_layer_percent,
        prompts_per_bucket=config.prompts_per_bucket,
        decode_tokens=config.decode_tokens,
        max_context=max_context,
    )


@dataclass(frozen=True)
class SettleRule:
    """When a bucket's warm-up has settled: its last two prefills (same length, different
    prompts) took times within `tolerance` of the faster one, after at least `min_prefills`.

    The first prefill of a length pays one-off costs a request must not meet; once two in a
    row agree, those are paid and another prefill would measure the same again.  The plan's
    prompts per bucket stays the ceiling: a bucket whose latency never settles (a noisy host)
    runs exactly as many prefills as before this rule.  The defaults, and why, are in
    `defaults` (DEFAULT_SETTLE_TOLERANCE, DEFAULT_SETTLE_MIN_PREFILLS).
    """

    tolerance: float = DEFAULT_SETTLE_TOLERANCE
    min_prefills: int = DEFAULT_SETTLE_MIN_PREFILLS

    def __post_init__(self) -> None:
        if not (self.tolerance >= 0 and math.isfinite(self.tolerance)):
            raise ValueError(f"settle tolerance must be a finite fraction >= 0, got {self.tolerance!r}")
        if self.min_prefills < 2:
            raise ValueError(f"settle min_prefills must be >= 2 (two in a row), got {self.min_prefills!r}")

    def settled(self, seconds: Sequence[float]) -> bool:
        """Whether a bucket whose prefills took `seconds` (in order) has settled."""
        if len(seconds) < self.min_prefills:
            return False
        previous, last = seconds[-2], seconds[-1]
        return abs(last - previous) <= self.tolerance * min(last, previous)


@dataclass
class WarmupProgress:
    """What warm-up has already done in this process, so a deeper plan only tops up."""

    layers_forced: set[int] = field(default_factory=set)
    prefills: dict[int, int] = field(default_factory=dict)  # bucket -> prompts done
    #: bucket -> prefills after which its latency settled (`SettleRule`); such a bucket is
    #: complete at any depth, whatever its plan's prompts per bucket
    settled: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, list[float]] = field(default_factory=dict)  # bucket -> each prefill's time
    kv_loaded: int = 0
    kv_saved: int = 0
    kv_save_errors: int = 0  # prefix KV files that could not be written (ENOSPC, read-only, ...)

    def bucket_done(self, bucket: int, plan: WarmupPlan) -> bool:
        """Settled, or at the plan's ceiling of prompts per bucket."""
        return bucket in self.settled or self.prefills.get(bucket, 0) >= plan.prompts_per_bucket

    def remaining(self, plan: WarmupPlan) -> WarmupPlan:
        """The part of `plan` not yet done (buckets keep only prompts beyond those done)."""
        layers = tuple(layer for layer in plan.resident_layers if layer not in self.layers_forced)
        buckets = tuple(b for b in plan.buckets if not self.bucket_done(b, plan))
        return replace(plan, resident_layers=layers, buckets=buckets)

    def record_prefill(self, bucket: int, seconds: float, settle: SettleRule) -> None:
        """One more prefill of `bucket`, which took `seconds`; the bucket settles when `settle` says so."""
        self.prefills[bucket] = self.prefills.get(bucket, 0) + 1
        timings = self.seconds.setdefault(bucket, [])
        timings.append(seconds)
        if settle.settled(timings):
            self.settled[bucket] = self.prefills[bucket]

    def settle_report(self, plan: WarmupPlan) -> str:
        """One line per the plan's buckets: settled after how many prefills, or at the ceiling."""
        parts = []
        for bucket in plan.buckets:
            done = self.prefills.get(bucket, 0)
            if bucket in self.settled:
                parts.append(f"{bucket}: settled after {self.settled[bucket]}/{plan.prompts_per_bucket}")
            elif done >= plan.prompts_per_bucket:
                parts.append(f"{bucket}: ceiling {done}/{plan.prompts_per_bucket}, not settled")
            else:
                parts.append(f"{bucket}: {done}/{plan.prompts_per_bucket}, cut short")
        return "; ".join(parts) or "no buckets"

    def describe(self) -> dict[str, object]:
        return {
            "layers_forced": len(self.layers_forced),
            "prefills": {str(b): n for b, n in sorted(self.prefills.items())},
            "settled": {str(b): n for b, n in sorted(self.settled.items())},
            "kv_loaded": self.kv_loaded,
            "kv_saved": self.kv_saved,
            "kv_save_errors": self.kv_save_errors,
        }


# -- sizing prompts to a bucket ----------------------------------------------------------
def _rotated(prompts: Sequence[str], variant: int) -> list[str]:
    if not prompts:
        raise ValueError("no prompts to size")
    start = variant % len(prompts)
    return [*prompts[start:], *prompts[:start]]


def sized_prompt_text(
    prompts: Sequence[str], bucket: int, variant: int = 0, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
) -> str:
    """About `bucket` tokens of text without a tokenizer (cut at a word boundary).

    Variant i starts from prompt i, so the prompts of one bucket differ from their first
    token (an engine's prefix cache cannot turn the second into a no-op).
    """
    target = max(1, math.floor(bucket * chars_per_token))
    ordered = _rotated(prompts, variant)
    pieces: list[str] = []
    length = 0
    index = 0
    while length < target:
        piece = ordered[index % len(ordered)]
        pieces.append(piece)
        length += len(piece) + 2
        index += 1
    text = "\n\n".join(pieces)[:target]
    cut = text.rfind(" ")
    return text[:cut] if cut > target // 2 else text


def sized_prompt_tokens(
    prompts: Sequence[str], bucket: int, encode: Callable[[str], list[int]], variant: int = 0
) -> list[int]:
    """Exactly `bucket` token ids, from the prompts encoded with the model's own tokenizer."""
    text = sized_prompt_text(prompts, bucket, variant, chars_per_token=6.0)
    for _ in range(12):  # doubling: bounded, and 6 chars/token already over-covers most text
        ids = encode(text)
        if len(ids) >= bucket:
            return ids[:bucket]
        text = f"{text}\n\n{text}" if text else " ".join(prompts) or "warm up"
    raise ValueError(f"cannot reach {bucket} tokens from the prompt set")


# -- executing on the built-in engine ---------------------------------------------------
def kv_prefix_path(kv_dir: Path, model_digest: str, token_ids: Sequence[int]) -> Path:
    """File of a persisted warm prefix: keyed by model digest and a hash of its tokens."""
    digest = re.sub(r"[^A-Za-z0-9]", "", model_digest.partition(":")[2] or model_digest)[:16] or "model"
    token_hash = hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]
    return kv_dir / f"{digest}-{token_hash}.safetensors"


def _save_prefix(
    engine: Engine,
    ids: Sequence[int],
    kv_path: Path,
    progress: WarmupProgress,
    on_error: Callable[[OSError], None] | None,
) -> None:
    """Persist one warm prefix; a filesystem failure costs only the persistence."""
    try:
        kv_path.parent.mkdir(parents=True, exist_ok=True)
        engine.save_prefix_kv(ids, kv_path)
    except OSError as error:
        progress.kv_save_errors += 1
        log.warning("cannot persist warm prefix KV to %s (continuing without it): %s", kv_path, error)
        if on_error is not None:
            on_error(error)
        return
    progress.kv_saved += 1


def _load_prefix(engine: Engine, ids: Sequence[int], kv_path: Path, progress: WarmupProgress) -> None:
    """Reuse a persisted warm prefix; a stale or unusable one is logged and ignored."""
    try:
        if engine.load_prefix_kv(ids, kv_path):
            progress.kv_loaded += 1
        else:
            log.warning("warm prefix %s is stale or mismatched: ignored", kv_path)
    except ModelLoadError as error:
        log.warning("warm prefix unusable: %s", error)


class WarmupStopped(Exception):
    """The plan was cut short because the tier became stricter."""


def execute_plan(
    engine: Engine,
    plan: WarmupPlan,
    prompts: Sequence[str],
    progress: WarmupProgress,
    *,
    engine_lock: AbstractContextManager[Any] | None = None,
    on_layer: LayerProgress | None = None,
    on_prefill: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    kv_dir: Path | None = None,
    on_kv_save_error: Callable[[OSError], None] | None = None,
    settle: SettleRule = SettleRule(),
    clock: Callable[[], float] = time.monotonic,
) -> WarmupProgress:
    """Run `plan` on `engine`, recording into `progress`; stops early (WarmupStopped) when told to.

    Each bucket runs prefills until its latency has settled (`settle`) or it reaches the plan's
    prompts per bucket, whichever comes first; the time of each prefill (prefill + decode, the
    engine lock's wait excluded), read from `clock`, is what `settle` judges.

    `engine_lock` (e.g. a threading.Lock) is held around each engine call, so live requests
    interleave between warm-up steps instead of waiting for the whole warm-up.

    Every prefill checks its logits: a model that yields NaN/Inf raises
    `engine_api.NonFiniteLogitsError` (a ModelLoadError naming the model), which fails the
    start.  Persisting a warm prefix is optional: a save that fails (disk full, read-only
    directory) is logged, counted and reported to `on_kv_save_error`, never fatal.
    """
    todo = progress.remaining(plan)
    lock: AbstractContextManager[Any] = engine_lock if engine_lock is not None else nullcontext()

    if todo.resident_layers or not progress.layers_forced:
        started = time.monotonic()
        for layer in todo.resident_layers:
            # one layer per call: requests interleave, and a stricter tier stops the load
            if should_stop():
                raise WarmupStopped(f"tier became stricter than {plan.tier.value}")
            with lock:
                engine.load_layers([layer], progress=on_layer)
            progress.layers_forced.add(layer)
        with lock:  # an empty order: embeddings, norm and the head, after the plan's layers (core readiness)
            engine.load_layers([], progress=on_layer)
        log.info(
            "warm-up (%s): %d layer(s) resident of %d in %.2fs",
            plan.tier.value,
            engine.layers_resident(),
            engine.num_layers,
            time.monotonic() - started,
        )
    for bucket in todo.buckets:
        while not progress.bucket_done(bucket, plan):
            if should_stop():
                raise WarmupStopped(f"tier became stricter than {plan.tier.value}")
            variant = progress.prefills.get(bucket, 0)
            started = clock()
            with lock:
                locked_at = clock()
                ids = sized_prompt_tokens(prompts, bucket, engine.encode, variant=variant)
                kv_path = kv_prefix_path(kv_dir, engine.model_digest, ids) if kv_dir is not None else None
                if kv_path is not None and kv_path.exists():
                    _load_prefix(engine, ids, kv_path, progress)
                generate_started = clock()
                for _step in engine.generate(ids, max_new_tokens=plan.decode_tokens):
                    pass
                seconds = clock() - generate_started
                if kv_path is not None and not kv_path.exists():
                    _save_prefix(engine, ids, kv_path, progress, on_kv_save_error)
            progress.record_prefill(bucket, seconds, settle)
            if on_prefill is not None:
                on_prefill(bucket)
            log.info("warm-up (%s): bucket %d prompt %d/%d in %.3fs (prefill+decode %.3fs, waited %.3fs)%s",
                     plan.tier.value, bucket, variant + 1, plan.prompts_per_bucket, clock() - started, seconds,
                     locked_at - started, ": settled" if bucket in progress.settled else "")
    return progress
