"""Scrape worker pods' ``/metrics`` and the tier directive's way back to them.

Parsing is ``prometheus_client.parser`` on the text format.  Whatever we cannot trust
(unreachable, a non-200, text that does not parse, a body with none of our series, a
memory figure that is absent, NaN, infinite or negative) leaves ``used_ratio`` None, and
the tier rule turns None into Unknown: never "0 % used".
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from warmpool import contract
from warmpool.contract import Tier
from warmpool.tiering import clean_ratio

#: Largest metrics body we read (a worker's is a few kB; per-layer heat of a big model ~20 kB).
MAX_BODY_BYTES = 2 * 1024 * 1024


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
                sample.layers_resident = int(value)
            elif name == contract.METRIC_LAYERS_TOTAL and _finite(value):
                sample.layers_total = int(value)
            elif name == contract.METRIC_PHASE_DURATION and _finite(value):
                sample.phase_durations[labels.get(contract.LABEL_PHASE, "")] = value
            elif name == contract.METRIC_PHASE_TIMESTAMP and _finite(value):
                sample.phase_timestamps[labels.get(contract.LABEL_PHASE, "")] = value
            elif name == contract.METRIC_WARMUP_PREFILLS + "_total" or (
                name == contract.METRIC_WARMUP_PREFILLS and family.type == "counter"
            ):
                sample.prefills[labels.get(contract.LABEL_BUCKET, "")] = value
            elif name == contract.METRIC_LAYER_HEAT and _finite(value) and value >= 0:
                try:
                    sample.heat[int(labels.get(contract.LABEL_LAYER, ""))] = value
                except ValueError:
                    continue
            elif name == contract.METRIC_MODEL_INFO and value == 1:
                sample.digest = labels.get(contract.LABEL_DIGEST) or None
                try:
                    sample.num_layers = int(labels.get(contract.LABEL_LAYERS, ""))
                except ValueError:
                    sample.num_layers = None
    if not seen:
        return Sample(error="garbage: no warmpool metrics in the body")
    # Several sources at once would be a worker bug; the fullest one is the safe reading.
    sample.used_ratio = max(ratios) if ratios else None
    sample.tier = _active_tier(tiers)
    sample.warmup_tier = _active_tier(warmup_tiers)
    return sample


async def scrape_one(session: aiohttp.ClientSession, url: str, limit: float) -> Sample:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=limit, connect=limit)) as response:
            if response.status != 200:
                return Sample(error=f"http {response.status}")
            body = await response.content.read(MAX_BODY_BYTES + 1)
            if len(body) > MAX_BODY_BYTES:
                return Sample(error="garbage: body too large")
            text = body.decode("utf-8", errors="replace")
    except TimeoutError:
        return Sample(error="timeout")
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
    session: aiohttp.ClientSession, url: str, token: str, tier: Tier, ttl: float, limit: float
) -> str | None:
    """POST the tier to a worker's control endpoint; None on success, else why not."""
    body = {contract.CONTROL_FIELD_TIER: tier.value, contract.CONTROL_FIELD_TTL: ttl}
    headers = {contract.CONTROL_TOKEN_HEADER: f"Bearer {token}"}
    try:
        async with session.post(
            url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=limit)
        ) as response:
            if response.status >= 300:
                return f"http {response.status}: {(await response.text())[:200]}"
            return None
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
) -> dict[str, str | None]:
    """Send (key, url, tier) directives, bounded in concurrency; key -> error or None."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(key: str, url: str, tier: Tier) -> tuple[str, str | None]:
        async with gate:
            return key, await send_directive(session, url, token, tier, ttl, limit)

    results = await asyncio.gather(*(one(k, u, t) for k, u, t in directives))
    return dict(results)
