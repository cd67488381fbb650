"""A worker's ``/metrics`` text read into a :class:`~warmpool_operator.model.Sample` (pure).

Parsing is ``prometheus_client.parser`` on the text format.  Whatever we cannot trust
(unreachable, a non-200, a body cut short or over the bound, text that does not parse, a
body with none of our series, a memory figure that is absent, NaN, infinite or negative)
leaves ``used_ratio`` None, and the tier rule turns None into Unknown: never "0 % used".

The body arrives whole (io/worker_client.py reads it to EOF under a byte bound), so a
worker that sends ``...used_ratio 0.`` and ``95`` a moment later is read as 95 %, never
0 %.  Every other figure is clamped to what it can mean (layers within
``[0, layers_total]``, counts and durations not negative), so one pod's nonsense cannot
make a value the API server refuses and stop the tick for every pod.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from warmpool.contract.api import Tier
from warmpool.contract.metrics import (
    BATCH_SIZE_EDGES,
    LABEL_BATCH,
    LABEL_BUCKET,
    LABEL_DIGEST,
    LABEL_LAYER,
    LABEL_LAYERS,
    LABEL_PHASE,
    LABEL_TIER,
    METRIC_ENGINE_BATCH_FINISHED,
    METRIC_ENGINE_BATCH_SECONDS,
    METRIC_ENGINE_BUSY_SECONDS,
    METRIC_LAYER_HEAT,
    METRIC_LAYERS_RESIDENT,
    METRIC_LAYERS_TOTAL,
    METRIC_MEMORY_CAPACITY_BYTES,
    METRIC_MEMORY_USED_BYTES,
    METRIC_MEMORY_USED_RATIO,
    METRIC_MODEL_INFO,
    METRIC_PHASE_DURATION,
    METRIC_PHASE_TIMESTAMP,
    METRIC_READY,
    METRIC_REQUEST_PROMPT_TOKENS,
    METRIC_REQUESTS_IN_FLIGHT,
    METRIC_REQUESTS_TOTAL,
    METRIC_SLEEP_CAPABLE,
    METRIC_SLEEP_LEVEL,
    METRIC_TIER,
    METRIC_WAKE_DURATION,
    METRIC_WARMUP_NEEDED,
    METRIC_WARMUP_PLANNED,
    METRIC_WARMUP_PREFILLS,
    METRIC_WARMUP_TIER,
)
from warmpool.contract.numerals import ascii_int_or_none, bucket_bound
from warmpool.tiering import clean_ratio
from warmpool_operator.model import Sample

METRIC_PREFIX = "warmpool_"


#: Most layers a model can report (the largest checkpoints have ~130): a sanity bound on
#: layer counts and indices, so a number like 1e300 never becomes a 300-digit integer.
MAX_LAYERS = 100_000
#: Largest per-layer heat kept: a sum over every pod of a pool stays finite (no ``inf``).
MAX_LAYER_HEAT = 1e15


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
    """A layer index (or count) from a label: ASCII digits in ``[0, MAX_LAYERS]``, else None."""
    return ascii_int_or_none(text, MAX_LAYERS)


@dataclass
class _Reading:
    """A sample being read, with the figures that are settled only once every line is in."""

    sample: Sample = field(default_factory=Sample)
    tiers: dict[str, float] = field(default_factory=dict)
    warmup_tiers: dict[str, float] = field(default_factory=dict)
    ratios: list[float] = field(default_factory=list)


def _read(reading: _Reading, name: str, labels: Mapping[str, str], value: float, family_type: str) -> None:
    """One line of a worker's metrics into the sample, each figure clamped to what it can mean."""
    if name == METRIC_MEMORY_USED_RATIO:
        ratio = clean_ratio(value)
        if ratio is not None:
            reading.ratios.append(ratio)
    elif name == METRIC_MEMORY_USED_BYTES and _finite(value):
        reading.sample.used_bytes = value
    elif name == METRIC_MEMORY_CAPACITY_BYTES and _finite(value):
        reading.sample.capacity_bytes = value
    elif name == METRIC_READY:
        reading.sample.ready = value == 1
    elif name == METRIC_TIER:
        reading.tiers[labels.get(LABEL_TIER, "")] = value
    elif name == METRIC_WARMUP_TIER:
        reading.warmup_tiers[labels.get(LABEL_TIER, "")] = value
    elif name == METRIC_LAYERS_RESIDENT and _finite(value):
        reading.sample.layers_resident = _layer_count(value)
    elif name == METRIC_LAYERS_TOTAL and _finite(value):
        reading.sample.layers_total = _layer_count(value)
    elif name == METRIC_PHASE_DURATION and _non_negative(value):
        reading.sample.phase_durations[labels.get(LABEL_PHASE, "")] = value
    elif name == METRIC_PHASE_TIMESTAMP and _non_negative(value):
        reading.sample.phase_timestamps[labels.get(LABEL_PHASE, "")] = value
    elif (
        name == METRIC_WARMUP_PREFILLS + "_total"
        or (name == METRIC_WARMUP_PREFILLS and family_type == "counter")
    ) and _non_negative(value):
        reading.sample.prefills[labels.get(LABEL_BUCKET, "")] = value
    elif name == METRIC_WARMUP_PLANNED and _non_negative(value):
        reading.sample.planned_prefills[labels.get(LABEL_BUCKET, "")] = value
    elif name == METRIC_WARMUP_NEEDED and _non_negative(value):
        reading.sample.needed_prefills[labels.get(LABEL_BUCKET, "")] = value
    elif name == METRIC_LAYER_HEAT and _non_negative(value):
        layer = _layer_index(labels.get(LABEL_LAYER, ""))
        if layer is not None:
            reading.sample.heat[layer] = min(value, MAX_LAYER_HEAT)
    elif name == METRIC_SLEEP_LEVEL and _non_negative(value):
        reading.sample.sleep_level = int(min(value, 9))
    elif name == METRIC_SLEEP_CAPABLE and _finite(value):
        reading.sample.sleep_capable = value == 1
    elif name == METRIC_REQUESTS_TOTAL and _non_negative(value):
        reading.sample.requests_total = value
    elif name == METRIC_REQUESTS_IN_FLIGHT and _finite(value):
        reading.sample.requests_in_flight = max(0.0, value)
    elif name == METRIC_REQUEST_PROMPT_TOKENS + "_bucket" and _non_negative(value):
        bound = bucket_bound(labels.get("le", ""))
        if bound is not None:
            reading.sample.prompt_buckets[bound] = value
    elif name == METRIC_REQUEST_PROMPT_TOKENS + "_count" and _non_negative(value):
        reading.sample.prompt_count = value
    elif name == METRIC_ENGINE_BUSY_SECONDS and _non_negative(value):
        reading.sample.busy_seconds = value
    elif name in (METRIC_ENGINE_BATCH_SECONDS, METRIC_ENGINE_BATCH_FINISHED) and _non_negative(value):
        edge = _batch_edge(labels.get(LABEL_BATCH, ""))
        if edge is not None:
            seconds = name == METRIC_ENGINE_BATCH_SECONDS
            (reading.sample.batch_seconds if seconds else reading.sample.batch_finished)[edge] = value
    elif name == METRIC_WAKE_DURATION + "_bucket" and _non_negative(value):
        bound = bucket_bound(labels.get("le", ""))
        if bound is not None:
            reading.sample.wake_buckets[bound] = value
    elif name == METRIC_MODEL_INFO and value == 1:
        reading.sample.digest = labels.get(LABEL_DIGEST) or None
        layers = _layer_index(labels.get(LABEL_LAYERS, ""))
        reading.sample.num_layers = layers if layers else None


def _batch_edge(label: str) -> int | None:
    """A batch-size bucket label, when it is one of the contract's edges (anything else is garbage)."""
    edge = ascii_int_or_none(label, max(BATCH_SIZE_EDGES))
    return edge if edge in BATCH_SIZE_EDGES else None


def parse_metrics(text: str) -> Sample:
    """A worker's /metrics text -> Sample (pure)."""
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as error:
        return Sample(error=f"garbage: {str(error)[:120]}")
    reading = _Reading()
    seen = False
    for family in families:
        for s in family.samples:
            if s.name.startswith(METRIC_PREFIX):
                seen = True
                _read(reading, s.name, s.labels, float(s.value), family.type)
    if not seen:
        return Sample(error="garbage: no warmpool metrics in the body")
    sample = reading.sample
    # Several sources at once would be a worker bug; the fullest one is the safe reading.
    sample.used_ratio = max(reading.ratios) if reading.ratios else None
    sample.tier = _active_tier(reading.tiers)
    sample.warmup_tier = _active_tier(reading.warmup_tiers)
    if sample.layers_resident is not None and sample.layers_total is not None:
        sample.layers_resident = min(sample.layers_resident, sample.layers_total)
    return sample
