"""Scrape worker pods' ``/metrics`` and the tier directive's way back to them.

Parsing is ``prometheus_client.parser`` on the text format.  Whatever we cannot trust
(unreachable, a non-200, a body cut short or over the bound, text that does not parse, a
body with none of our series, a memory figure that is absent, NaN, infinite or negative)
leaves ``used_ratio`` None, and the tier rule turns None into Unknown: never "0 % used".

Bodies are read whole, to EOF, under a byte bound (:mod:`warmpool.http_body`), then
parsed: a worker that sends ``...used_ratio 0.`` and ``95`` a moment later is read as
95 %, never 0 %.  Every other figure is clamped to what it can mean (layers within
``[0, layers_total]``, counts and durations not negative), so one pod's nonsense cannot
make a value the API server refuses and stop the tick for every pod.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from warmpool import contract
from warmpool.contract import Tier
from warmpool.http_body import BodyTooLarge, read_bounded_text
from warmpool.tiering import clean_ratio

#: Largest metrics body we read (a worker's is a few kB; per-layer heat of a big model ~20 kB).
MAX_BODY_BYTES = 2 * 1024 * 1024
#: Largest error body of a refused tier directive we read (we keep 200 characters of it).
MAX_DIRECTIVE_ERROR_BYTES = 16 * 1024
#: Most layers a model can report (the largest checkpoints have ~130): a sanity bound on
#: layer counts and indices, so a number like 1e300 never becomes a 300-digit integer.
MAX_LAYERS = 100_000
#: Largest per-layer heat kept: a sum over every pod of a pool stays finite (no ``inf``).
MAX_LAYER_HEAT = 1e15


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
    heat: dict[int, float] = field(default_factory=dict)
    digest: str | None = None
    num_layers: int | None = None
    #: sleep (#15): the level slept at (0 awake; None: the worker has no sleep metric), whether
    #: the engine can sleep (None: not known yet), completions received and in flight
    sleep_level: int | None = None
    sleep_capable: bool | None = None
    requests_total: float | None = None
    requests_in_flight: float | None = None
    #: the wake-duration histogram: upper bound (seconds, inf last) -> cumulative count
    wake_buckets: dict[float, float] = field(default_factory=dict)
    #: demand prediction (#16): the prompt-token histogram of served requests (upper bound in
    #: tokens, inf last -> cumulative count), its count, and the engine's busy seconds
    prompt_buckets: dict[float, float] = field(default_factory=dict)
    prompt_count: float | None = None
    busy_seconds: float | None = None
    #: when the scrape was sent (monotonic; 0 when not from :func:`scrape_one`): a sample sent
    #: before a sleep or wake of the pod finished says nothing of its state after it
    sent_at: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def _active_tier(values: Mapping[str, float]) -> Tier | None:
    active = [name for name, value in values.items() if value == 1]
    if len(active) != 1:
        return None
    try:
        return Tier(active[0])
    except ValueError:
        return None


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def _layer_count(value: float) -> int:
    """A finite layer count, clamped into ``[0, MAX_LAYERS]``."""
    return int(min(max(value, 0.0), MAX_LAYERS))


def _layer_index(text: str) -> int | None:
    """A layer index (or count) from a label: a plain integer in ``[0, MAX_LAYERS]``, else None."""
    try:
        number = int(text)
    except ValueError:
        return None
    return number if 0 <= number <= MAX_LAYERS else None


def _bucket_bound(text: str) -> float | None:
    """A histogram bucket's ``le`` bound (``+Inf`` included), None for garbage."""
    try:
        bound = float(text)
    except ValueError:
        return None
    return bound if bound >= 0 else None


def parse_metrics(text: str) -> Sample:
    """A worker's /metrics text -> Sample (pure)."""
    sample = Sample()
    seen = False
    tiers: dict[str, float] = {}
    warmup_tiers: dict[str, float] = {}
    ratios: list[float] = []
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as error:
        return Sample(error=f"garbage: {str(error)[:120]}")
    for family in families:
        for s in family.samples:
            name, labels, value = s.name, s.labels, float(s.value)
            if not name.startswith(contract.METRIC_PREFIX):
                continue
            seen = True
            if name == contract.METRIC_MEMORY_USED_RATIO:
                ratio = clean_ratio(value)
                if ratio is not None:
                    ratios.append(ratio)
            elif name == contract.METRIC_MEMORY_USED_BYTES and _finite(value):
                sample.used_bytes = value
            elif name == contract.METRIC_MEMORY_CAPACITY_BYTES and _finite(value):
                sample.capacity_bytes = value
            elif name == contract.METRIC_READY:
                sample.ready = value == 1
            elif name == contract.METRIC_TIER:
                tiers[labels.get(contract.LABEL_TIER, "")] = value
            elif name == contract.METRIC_WARMUP_TIER:
                warmup_tiers[labels.get(contract.LABEL_TIER, "")] = value
            elif name == contract.METRIC_LAYERS_RESIDENT and _finite(value):
                sample.layers_resident = _layer_count(value)
            elif name == contract.METRIC_LAYERS_TOTAL and _finite(value):
                sample.layers_total = _layer_count(value)
            elif name == contract.METRIC_PHASE_DURATION and _non_negative(value):
                sample.phase_durations[labels.get(contract.LABEL_PHASE, "")] = value
            elif name == contract.METRIC_PHASE_TIMESTAMP and _non_negative(value):
                sample.phase_timestamps[labels.get(contract.LABEL_PHASE, "")] = value
            elif (
                name == contract.METRIC_WARMUP_PREFILLS + "_total"
                or (name == contract.METRIC_WARMUP_PREFILLS and family.type == "counter")
            ) and _non_negative(value):
                sample.prefills[labels.get(contract.LABEL_BUCKET, "")] = value
            elif name == contract.METRIC_LAYER_HEAT and _non_negative(value):
                layer = _layer_index(labels.get(contract.LABEL_LAYER, ""))
                if layer is not None:
                    sample.heat[layer] = min(value, MAX_LAYER_HEAT)
            elif name == contract.METRIC_SLEEP_LEVEL and _non_negative(value):
                sample.sleep_level = int(min(value, 9))
            elif name == contract.METRIC_SLEEP_CAPABLE and _finite(value):
                sample.sleep_capable = value == 1
            elif name == contract.METRIC_REQUESTS_TOTAL and _non_negative(value):
                sample.requests_total = value
            elif name == contract.METRIC_REQUESTS_IN_FLIGHT and _finite(value):
                sample.requests_in_flight = max(0.0, value)
            elif name == contract.METRIC_REQUEST_PROMPT_TOKENS + "_bucket" and _non_negative(value):
                bound = _bucket_bound(labels.get("le", ""))
                if bound is not None:
                    sample.prompt_buckets[bound] = value
            elif name == contract.METRIC_REQUEST_PROMPT_TOKENS + "_count" and _non_negative(value):
                sample.prompt_count = value
            elif name == contract.METRIC_ENGINE_BUSY_SECONDS and _non_negative(value):
                sample.busy_seconds = value
            elif name == contract.METRIC_WAKE_DURATION + "_bucket" and _non_negative(value):
                bound = _bucket_bound(labels.get("le", ""))
                if bound is not None:
                    sample.wake_buckets[bound] = value
            elif name == contract.METRIC_MODEL_INFO and value == 1:
                sample.digest = labels.get(contract.LABEL_DIGEST) or None
                layers = _layer_index(labels.get(contract.LABEL_LAYERS, ""))
                sample.num_layers = layers if layers else None
    if not seen:
        return Sample(error="garbage: no warmpool metrics in the body")
    # Several sources at once would be a worker bug; the fullest one is the safe reading.
    sample.used_ratio = max(ratios) if ratios else None
    sample.tier = _active_tier(tiers)
    sample.warmup_tier = _active_tier(warmup_tiers)
    if sample.layers_resident is not None and sample.layers_total is not None:
        sample.layers_resident = min(sample.layers_resident, sample.layers_total)
    return sample


async def scrape_one(session: aiohttp.ClientSession, url: str, limit: float) -> Sample:
    sent_at = time.monotonic()
    sample = await _scrape(session, url, limit)
    sample.sent_at = sent_at
    return sample


async def _scrape(session: aiohttp.ClientSession, url: str, limit: float) -> Sample:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=limit, connect=limit)) as response:
            if response.status != 200:
                return Sample(error=f"http {response.status}")
            text = await read_bounded_text(response, MAX_BODY_BYTES)
    except BodyTooLarge as error:
        return Sample(error=f"garbage: {error}")
    except TimeoutError:
        return Sample(error="timeout")
    except aiohttp.ClientPayloadError as error:
        # The connection ended before the body did (e.g. short of its Content-Length).
        return Sample(error=f"truncated: {str(error)[:120]}")
    except aiohttp.ClientError as error:
        return Sample(error=f"unreachable: {type(error).__name__}")
    except OSError as error:
        return Sample(error=f"unreachable: {error.strerror or error}")
    return parse_metrics(text)


async def scrape_all(
    session: aiohttp.ClientSession, urls: Mapping[str, str], limit: float, concurrency: int
) -> dict[str, Sample]:
    """Scrape every url (key -> url) with at most ``concurrency`` in flight, each bounded in time."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(key: str, url: str) -> tuple[str, Sample]:
        async with gate:
            return key, await scrape_one(session, url, limit)

    results = await asyncio.gather(*(one(k, u) for k, u in urls.items()))
    return dict(results)


async def send_directive(
    session: aiohttp.ClientSession, url: str, token: str, tier: Tier, ttl: float, limit: float,
    traceparent: str | None = None,
) -> str | None:
    """POST the tier to a worker's control endpoint; None on success, else why not.

    ``traceparent``: the deciding pass's trace context, so the worker's reaction joins its trace."""
    body: dict[str, object] = {contract.CONTROL_FIELD_TIER: tier.value, contract.CONTROL_FIELD_TTL: ttl}
    if traceparent is not None:
        body[contract.CONTROL_FIELD_TRACEPARENT] = traceparent
    return await post_control(session, url, token, body, limit)


async def post_control(
    session: aiohttp.ClientSession, url: str, token: str, body: Mapping[str, object], limit: float
) -> str | None:
    """POST a JSON body to one of a worker's authenticated control endpoints (tier, sleep,
    wake); None on success, else why not (status and the head of the worker's answer)."""
    headers = {contract.CONTROL_TOKEN_HEADER: f"Bearer {token}"}
    try:
        async with session.post(
            url, json=dict(body), headers=headers, timeout=aiohttp.ClientTimeout(total=limit)
        ) as response:
            if response.status < 300:
                return None
            status = response.status
            try:
                detail = (await read_bounded_text(response, MAX_DIRECTIVE_ERROR_BYTES))[:200]
            except BodyTooLarge as error:
                detail = f"({error})"
            except aiohttp.ClientPayloadError:
                detail = "(body cut short)"
            return f"http {status}: {detail}"
    except TimeoutError:
        return "timeout"
    except (aiohttp.ClientError, OSError) as error:
        return f"unreachable: {type(error).__name__}"


async def send_all(
    session: aiohttp.ClientSession,
    directives: Iterable[tuple[str, str, Tier]],
    token: str,
    ttl: float,
    limit: float,
    concurrency: int,
    traceparent: str | None = None,
) -> dict[str, str | None]:
    """Send (key, url, tier) directives, bounded in concurrency; key -> error or None."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(key: str, url: str, tier: Tier) -> tuple[str, str | None]:
        async with gate:
            return key, await send_directive(session, url, token, tier, ttl, limit, traceparent)

    results = await asyncio.gather(*(one(k, u, t) for k, u, t in directives))
    return dict(results)
