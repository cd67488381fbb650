"""An external engine's request figures, read from its /metrics and re-exported under warmpool's names.

The built-in worker measures its requests itself (:mod:`.metrics`); beside vLLM the sidecar
serves no requests, so it reads the engine's own figures (names in :mod:`warmpool.contract`):

=================================  ====================================
vLLM (sample names as exposed)     re-exported as
=================================  ====================================
``vllm:request_success_total``     ``warmpool_requests_total`` (summed over ``finished_reason``)
``vllm:num_requests_running``      ``warmpool_requests_in_flight``
``vllm:num_requests_waiting``      ``warmpool_requests_queued``
``vllm:generation_tokens_total``   ``warmpool_generated_tokens_total``
``vllm:request_prompt_tokens``     ``warmpool_request_prompt_tokens`` (histogram)
``vllm:request_generation_tokens`` ``warmpool_request_generated_tokens`` (histogram)
=================================  ====================================

Every figure is summed over vLLM's ``model_name``/``engine`` labels (one pod is one server,
whatever its data-parallel engines).  vLLM counts the sidecar's own warm-up requests too; they
are sent before the pod is Ready, so any rate taken while it is Ready leaves them out.

vLLM buckets its token histograms at 1-2-5 steps up to ``max_model_len``; warmpool's buckets
are :data:`~warmpool.contract.TOKEN_LENGTH_EDGES`.  So that every pool exports one shape, the
engine's cumulative counts are re-binned onto warmpool's edges by linear interpolation within
the engine's bucket (the convention of Prometheus's ``histogram_quantile``): the count and the
sum stay exact, a bucket's count is an estimate within the engine's bucket width (hence not
always an integer), and lengths past the engine's largest finite bucket go to ``+Inf``.

A figure the engine does not export (llama.cpp, TGI, an older vLLM), or exports as garbage
(negative, non-finite, a histogram whose cumulative counts fall), is *absent*, never 0; so is
every figure while the engine's /metrics does not answer.  ``warmpool_engine_busy_seconds_total``
has no counterpart in an external engine and is never exported by the sidecar.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from warmpool.contract.files import TOKEN_LENGTH_EDGES
from warmpool.contract.metrics import (
    METRIC_ENGINE_BUSY_SECONDS,
    METRIC_GENERATED_TOKENS,
    METRIC_REQUEST_GENERATED_TOKENS,
    METRIC_REQUEST_PROMPT_TOKENS,
    METRIC_REQUESTS_IN_FLIGHT,
    METRIC_REQUESTS_QUEUED,
    METRIC_REQUESTS_TOTAL,
)
from warmpool.contract.numerals import bucket_bound

VLLM_GENERATION_TOKENS = "vllm:generation_tokens_total"  # -> METRIC_GENERATED_TOKENS
VLLM_GENERATION_TOKENS_HISTOGRAM = "vllm:request_generation_tokens"  # -> METRIC_REQUEST_GENERATED_TOKENS
#: vLLM's request figures, re-exported by the sidecar under warmpool's names (sample names as
#: exposed; every series is summed over vLLM's model_name/engine labels).
VLLM_PROMPT_TOKENS_HISTOGRAM = "vllm:request_prompt_tokens"  # -> METRIC_REQUEST_PROMPT_TOKENS
VLLM_REQUESTS_RUNNING = "vllm:num_requests_running"  # -> METRIC_REQUESTS_IN_FLIGHT
VLLM_REQUESTS_WAITING = "vllm:num_requests_waiting"  # -> METRIC_REQUESTS_QUEUED
VLLM_REQUEST_SUCCESS = "vllm:request_success_total"  # summed over finished_reason -> METRIC_REQUESTS_TOTAL


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenHistogram:
    """A token-length histogram on warmpool's edges: cumulative counts per edge, then +Inf."""

    cumulative: tuple[float, ...]  # one per TOKEN_LENGTH_EDGES edge, non-decreasing
    count: float  # the +Inf bucket: every request observed
    total: float  # the sum of the lengths

    def buckets(self) -> list[tuple[str, float]]:
        """(le, cumulative count) pairs in the exposition's own formatting, +Inf last."""
        pairs = [(floatToGoString(edge), value)  # type: ignore[no-untyped-call]  # as Histogram writes le
                 for edge, value in zip(TOKEN_LENGTH_EDGES, self.cumulative, strict=True)]
        return [*pairs, ("+Inf", self.count)]


@dataclass(frozen=True)
class EngineSignals:
    """The engine's request figures; None where it exports none (absent, never 0)."""

    requests: float | None = None
    in_flight: float | None = None
    queued: float | None = None
    generated_tokens: float | None = None
    prompt_lengths: TokenHistogram | None = None
    generated_lengths: TokenHistogram | None = None


@dataclass
class _HistogramParts:
    """One engine histogram's samples, summed over its series (le -> cumulative count)."""

    buckets: dict[float, float] = field(default_factory=dict)
    count: float | None = None
    total: float | None = None

    def add(self, suffix: str, sample: Sample) -> None:
        value = float(sample.value)
        if suffix == "_bucket":
            le = bucket_bound(sample.labels.get("le", ""))
            if le is None:
                return  # a bucket without a readable bound is garbage: the histogram is refused below
            self.buckets[le] = self.buckets.get(le, 0.0) + value
        elif suffix == "_count":
            self.count = (self.count or 0.0) + value
        elif suffix == "_sum":
            self.total = (self.total or 0.0) + value


def rebin(points: list[tuple[float, float]], count: float, total: float) -> TokenHistogram | None:
    """The engine's finite (le, cumulative) points and its count on warmpool's edges; None if garbage."""
    points = sorted(points)
    les = [le for le, _ in points]
    values = [value for _, value in points]
    if not points or any(v < 0 for v in values) or total < 0 or count < (values[-1] if values else 0.0):
        return None
    if any(later < earlier for earlier, later in itertools.pairwise(values)):
        return None  # cumulative counts cannot fall as the bound grows
    cumulative: list[float] = []
    for edge in TOKEN_LENGTH_EDGES:
        index = bisect.bisect_left(les, edge)
        if index < len(les) and les[index] == edge:
            value = values[index]
        elif index == len(les):  # past the engine's largest finite bucket: only what it counted below it
            value = values[-1]
        else:
            low_le, low_value = (0.0, 0.0) if index == 0 else points[index - 1]
            high_le, high_value = points[index]
            value = low_value + (high_value - low_value) * (edge - low_le) / (high_le - low_le)
        cumulative.append(value)
    return TokenHistogram(tuple(cumulative), count, total)


def _histogram(parts: _HistogramParts | None) -> TokenHistogram | None:
    if parts is None or not parts.buckets:
        return None
    infinite = parts.buckets.pop(math.inf, None)
    count = infinite if infinite is not None else parts.count
    if count is None or parts.total is None:
        return None
    return rebin(list(parts.buckets.items()), count, parts.total)


_GAUGES_AND_COUNTERS = {
    VLLM_REQUEST_SUCCESS: "requests",
    VLLM_REQUESTS_RUNNING: "in_flight",
    VLLM_REQUESTS_WAITING: "queued",
    VLLM_GENERATION_TOKENS: "generated_tokens",
}
_HISTOGRAMS = (VLLM_PROMPT_TOKENS_HISTOGRAM, VLLM_GENERATION_TOKENS_HISTOGRAM)
_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def signals_from_samples(samples: Iterable[Sample]) -> EngineSignals:
    """The request figures among an engine's parsed samples (``prometheus_client.parser``)."""
    sums: dict[str, float] = {}
    refused: set[str] = set()
    histograms: dict[str, _HistogramParts] = {}
    for sample in samples:
        value = sample.value
        name = sample.name
        field_name = _GAUGES_AND_COUNTERS.get(name)
        histogram = next((h for h in _HISTOGRAMS if name.startswith(h) and name[len(h):] in _HISTOGRAM_SUFFIXES),
                         None)
        if field_name is None and histogram is None:
            continue
        key = field_name or histogram or name
        if not isinstance(value, float | int) or not math.isfinite(value) or value < 0:
            refused.add(key)
            continue
        if field_name is not None:
            sums[field_name] = sums.get(field_name, 0.0) + float(value)
        elif histogram is not None:
            histograms.setdefault(histogram, _HistogramParts()).add(name[len(histogram):], sample)
    if refused:
        log.debug("engine figures refused (negative or not finite): %s", sorted(refused))
    for key in refused:
        sums.pop(key, None)
        histograms.pop(key, None)

    def figure(name: str) -> float | None:
        return sums.get(name)

    return EngineSignals(
        requests=figure("requests"),
        in_flight=figure("in_flight"),
        queued=figure("queued"),
        generated_tokens=figure("generated_tokens"),
        prompt_lengths=_histogram(histograms.get(VLLM_PROMPT_TOKENS_HISTOGRAM)),
        generated_lengths=_histogram(histograms.get(VLLM_GENERATION_TOKENS_HISTOGRAM)),
    )


_REQUESTS_HELP = "Requests the engine finished (the engine's own count)"
_IN_FLIGHT_HELP = "Requests the engine is running now"
_QUEUED_HELP = "Requests waiting for the engine"
_GENERATED_HELP = "Tokens the engine generated"
_PROMPT_LENGTHS_HELP = "Prompt tokens per request (the engine's histogram, re-binned)"
_GENERATED_LENGTHS_HELP = "Tokens generated per request (the engine's histogram, re-binned)"


class EngineSignalsCollector(Collector):
    """The last scrape's :class:`EngineSignals` as series under warmpool's names.

    :meth:`describe` names every series it owns, those it can never fill included
    (engine busy seconds), so the sidecar removes the built-in worker's series of those names.
    """

    def __init__(self) -> None:
        self.signals = EngineSignals()

    def update(self, signals: EngineSignals) -> None:
        self.signals = signals  # one reference swap: a concurrent collect sees the old or the new

    def describe(self) -> list[Metric]:
        return [
            CounterMetricFamily(METRIC_REQUESTS_TOTAL, _REQUESTS_HELP),
            GaugeMetricFamily(METRIC_REQUESTS_IN_FLIGHT, _IN_FLIGHT_HELP),
            GaugeMetricFamily(METRIC_REQUESTS_QUEUED, _QUEUED_HELP),
            CounterMetricFamily(METRIC_GENERATED_TOKENS, _GENERATED_HELP),
            HistogramMetricFamily(METRIC_REQUEST_PROMPT_TOKENS, _PROMPT_LENGTHS_HELP),
            HistogramMetricFamily(METRIC_REQUEST_GENERATED_TOKENS, _GENERATED_LENGTHS_HELP),
            CounterMetricFamily(METRIC_ENGINE_BUSY_SECONDS, "Not known for an external engine: never exported"),
        ]

    def collect(self) -> Iterator[Metric]:
        signals = self.signals
        if signals.requests is not None:
            yield CounterMetricFamily(METRIC_REQUESTS_TOTAL, _REQUESTS_HELP, value=signals.requests)
        if signals.in_flight is not None:
            yield GaugeMetricFamily(METRIC_REQUESTS_IN_FLIGHT, _IN_FLIGHT_HELP, value=signals.in_flight)
        if signals.queued is not None:
            yield GaugeMetricFamily(METRIC_REQUESTS_QUEUED, _QUEUED_HELP, value=signals.queued)
        if signals.generated_tokens is not None:
            yield CounterMetricFamily(METRIC_GENERATED_TOKENS, _GENERATED_HELP, value=signals.generated_tokens)
        for name, help_text, histogram in (
            (METRIC_REQUEST_PROMPT_TOKENS, _PROMPT_LENGTHS_HELP, signals.prompt_lengths),
            (METRIC_REQUEST_GENERATED_TOKENS, _GENERATED_LENGTHS_HELP, signals.generated_lengths),
        ):
            if histogram is not None:
                yield HistogramMetricFamily(name, help_text, buckets=histogram.buckets(), sum_value=histogram.total)
