"""Per-WarmModel request history, bounded, at two resolutions, and its ConfigMap serialisation.

Each step (the operator's fine step; 60 s by default here) holds the number of requests, and the
prompt and generated tokens they carried; a step whose metrics were missing or garbage is held as *missing*, never as
zero (zero is a real observation: no traffic).  It may also hold the step's *peak*: the
requests the step would have seen had it run throughout at the rate of its busiest sub-step
(:data:`PEAK_SUBSTEP_S`, 10 s, by default): load that comes in bursts shorter than a step
queues at the burst's rate, which the step's count averages away.  Prompt and generated lengths also go into
histograms over :data:`~.lengths.LENGTH_EDGES`, one per hour slot, so the learned warm-up
buckets follow the same retention as the rates.  Everything older than the retention
(7 days by default) is dropped as new steps arrive.

**Two resolutions.**  Fine steps short enough for 10-30 s bursts cannot also be held for weeks in
one ConfigMap (10,080 steps of 10 s are 28 h: daily seasonality, never weekly).  So a history whose
limits name a *coarse* step (:attr:`HistoryLimits.coarse_step_s`, e.g. 5 min, a whole multiple of
the fine step dividing the hour slot) holds a second, coarse :class:`History` beside its fine steps,
with a retention of its own (weeks).  Each coarse step is *rolled up* from the fine ones as soon as
the last of them closes: the sum of their counts and tokens, missing if any of them is, its peak the
busiest fine step's peak (or count) at the coarse step's length (the same rule as :func:`resampled`);
and when a coarse step closes an hour slot, that slot's length histograms are copied into the coarse
tier, so the learned buckets keep the coarse tier's retention.  The forecaster reads the fine steps
for the bursts and the coarse ones for the daily and weekly parts (:mod:`.features`).

Serialised form (:func:`dumps`), for a ConfigMap value::

    wph1.<base64 of zlib(JSON)>

The JSON is ``{"format": "warmpool.history", "version": 1, "step_s", "retention_s",
"slot_s", "edges", "start", "requests", "prompt_tokens", "generated_tokens",
"prompt_hist", "generated_hist"}`` with ``-1`` for a missing step and the histograms as
``{slot: [counts...]}``, and optionally ``"peak_requests"`` (same length as ``"requests"``,
``-1`` where unknown) and ``"coarse"`` (the coarse tier: a document of the same form, without a
``"coarse"`` of its own).  Both came later within version 1: a document without them loads with
every peak unknown and no coarse tier, and an older reader ignores them.  Seven full days (10,080
steps, 168 hour slots) take about 45 kB with tens of requests per step and about 100 kB with
thousands (random counts, which compress worst; measured in ``tests/unit/test_predict_history.py``),
well under a ConfigMap's 1 MiB; the operator's two tiers at thousands of requests per 10 s step
(10,080 fine steps with their peaks, 8,064 coarse ones) take about 250 kB
(``tests/unit/test_history_two_resolutions.py``).  :func:`loads` refuses
anything else with :class:`HistoryFormatError` naming what is wrong; :func:`loads_or_empty` is what
a caller that must not fail uses.  A history at other limits (an older operator's single 60 s
resolution) is re-held at this operator's by :func:`~.history_reshape.adapted`, which keeps what it can.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from warmpool_operator.rules.forecast.lengths import BIN_COUNT, LENGTH_EDGES

FORMAT_NAME = "warmpool.history"
FORMAT_VERSION = 1
PREFIX = "wph1."
MISSING = -1
#: A decompressed history larger than this is refused (a zlib bomb must not eat the operator).
MAX_DECODED_BYTES = 8 * 2**20
#: Counts above this in one step are not a plausible observation (garbage, or a counter reset read as a delta).
MAX_STEP_COUNT = 10**12
#: The sub-step a step's peak is measured over, when the producer can choose (the replay benchmark does;
#: the operator's is its scrape interval).  Shorter than a step: the trace's bursts last 10-30 s.
PEAK_SUBSTEP_S = 10


class HistoryFormatError(ValueError):
    """A serialised history that cannot be trusted; the message names what is wrong."""


@dataclass(frozen=True)
class HistoryLimits:
    """Resolution and bounds of a history."""

    step_s: int = 60
    retention_s: int = 7 * 86400
    slot_s: int = 3600  # one length histogram per slot
    #: The coarse tier's step (None: no coarse tier): a whole multiple of step_s that divides slot_s.
    coarse_step_s: int | None = None
    #: How long the coarse tier keeps its steps (with a coarse step only).
    coarse_retention_s: int = 0

    def __post_init__(self) -> None:
        if self.step_s < 1 or self.slot_s < self.step_s or self.slot_s % self.step_s:
            raise ValueError(f"slot_s ({self.slot_s}) must be a multiple of step_s ({self.step_s}) >= 1")
        if self.retention_s < self.step_s:
            raise ValueError(f"retention_s ({self.retention_s}) must be at least one step ({self.step_s})")
        coarse = self.coarse_step_s
        if coarse is None:
            if self.coarse_retention_s:
                raise ValueError(f"coarse_retention_s ({self.coarse_retention_s}) needs a coarse_step_s")
            return
        if coarse <= self.step_s or coarse % self.step_s or self.slot_s % coarse:
            raise ValueError(f"coarse_step_s ({coarse}) must be a multiple of step_s ({self.step_s}) above it "
                             f"that divides slot_s ({self.slot_s})")
        if self.coarse_retention_s < coarse:
            raise ValueError(f"coarse_retention_s ({self.coarse_retention_s}) must be at least one coarse step "
                             f"({coarse})")

    @property
    def points(self) -> int:
        return self.retention_s // self.step_s

    @property
    def coarse(self) -> HistoryLimits | None:
        """The coarse tier's own limits (None: no coarse tier)."""
        if self.coarse_step_s is None:
            return None
        return HistoryLimits(step_s=self.coarse_step_s, retention_s=self.coarse_retention_s, slot_s=self.slot_s)

    @property
    def fine(self) -> HistoryLimits:
        """These limits without their coarse tier."""
        return HistoryLimits(step_s=self.step_s, retention_s=self.retention_s, slot_s=self.slot_s)


@dataclass(frozen=True)
class StepObservation:
    """What the workers served in one step, summed over the pool."""

    requests: int
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_lengths: tuple[int, ...] = ()  # counts per length bin, or () when not known
    generated_lengths: tuple[int, ...] = ()
    #: The busiest sub-step's count scaled to the whole step (count x step ÷ sub-step, rounded up);
    #: None when not measured.  See :func:`peak_of`.
    peak_requests: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests", "prompt_tokens", "generated_tokens", "peak_requests"):
            value = getattr(self, name)
            if name == "peak_requests" and value is None:
                continue
            if not 0 <= value <= MAX_STEP_COUNT:
                raise ValueError(f"{name} must be within 0..{MAX_STEP_COUNT}, got {value}")
        for name in ("prompt_lengths", "generated_lengths"):
            counts = getattr(self, name)
            if counts and (len(counts) != BIN_COUNT or any(not 0 <= c <= MAX_STEP_COUNT for c in counts)):
                raise ValueError(f"{name} must be {BIN_COUNT} non-negative counts, got {list(counts)[:8]}...")


def peak_of(sub_step_counts: Sequence[int], step_s: int, sub_step_s: float) -> int:
    """A step's peak from its sub-steps' request counts: the busiest one's count scaled to the step."""
    if not 0 < sub_step_s <= step_s:
        raise ValueError(f"sub-step must be within (0, {step_s}] s, got {sub_step_s}")
    if any(c < 0 for c in sub_step_counts):
        raise ValueError(f"sub-step counts must be >= 0, got {list(sub_step_counts)[:8]}")
    busiest = max(sub_step_counts, default=0)
    # The epsilon keeps a float product that lands a hair above a whole number from adding a request.
    return math.ceil(busiest * step_s / sub_step_s - 1e-9)


@dataclass
class History:
    """Steps ``start .. start + len(requests) - 1`` (step index = unix time // step_s).

    ``peak_requests`` runs beside ``requests`` (:data:`MISSING` where a step's peak is unknown);
    a history built without it (an older caller, an older document) gets every peak unknown.
    ``coarse`` is the coarse tier (see the module docstring): there exactly when the limits name a
    coarse step, an empty one when none is given.
    """

    limits: HistoryLimits = field(default_factory=HistoryLimits)
    start: int = 0
    requests: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    prompt_hist: dict[int, list[int]] = field(default_factory=dict)  # slot -> counts per bin
    generated_hist: dict[int, list[int]] = field(default_factory=dict)
    peak_requests: list[int] = field(default_factory=list)
    coarse: History | None = None

    def __post_init__(self) -> None:
        if len(self.peak_requests) > len(self.requests):
            raise ValueError(f"peak_requests holds {len(self.peak_requests)} steps, requests {len(self.requests)}")
        wanted = self.limits.coarse
        if wanted is not None and self.coarse is None:
            self.coarse = History(limits=wanted)
        if self.coarse is not None and self.coarse.limits != wanted:
            raise ValueError(f"a coarse tier at {self.coarse.limits} does not match the limits' {wanted}")
        # Unknown peaks for the oldest steps (a history built before peaks were kept, or without them).
        self.peak_requests[:0] = [MISSING] * (len(self.requests) - len(self.peak_requests))

    @property
    def end(self) -> int:
        """The step index after the last one held."""
        return self.start + len(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    def record(self, step: int, observation: StepObservation | None) -> None:
        """Append step ``step``; None means its metrics were missing or garbage (held as missing).

        Steps between the last one held and ``step`` are held as missing.  A step at or
        before the last one held is refused: history is append-only.
        """
        if self.requests and step < self.end:
            raise ValueError(f"step {step} is not after the last recorded step {self.end - 1}")
        if not self.requests:
            self.start = step
        gap = step - self.end
        if gap >= self.limits.points:  # everything held is older than the retention
            self._clear(step)
        else:
            for series in self._series():
                series.extend([MISSING] * gap)
        if observation is None:
            values = (MISSING, MISSING, MISSING, MISSING)
        else:
            peak = MISSING if observation.peak_requests is None else observation.peak_requests
            values = (observation.requests, observation.prompt_tokens, observation.generated_tokens, peak)
            slot = step * self.limits.step_s // self.limits.slot_s
            _add_counts(self.prompt_hist, slot, observation.prompt_lengths)
            _add_counts(self.generated_hist, slot, observation.generated_lengths)
        for series, value in zip(self._series(), values, strict=True):
            series.append(value)
        self._trim()
        if self.coarse is not None:
            self._roll_up(self.coarse)

    def _roll_up(self, coarse: History) -> None:
        """Record in ``coarse`` every coarse step whose fine steps have all closed since the last one
        (a coarse step that began before the fine steps held is left out: its count would be too low)."""
        k = coarse.limits.step_s // self.limits.step_s
        first_whole = -(-self.start // k)
        for group in range(max(coarse.end if len(coarse) else first_whole, first_whole), self.end // k):
            coarse.record(group, self._group(group, k))
            if (group + 1) * coarse.limits.step_s % self.limits.slot_s == 0:  # it closes an hour slot
                slot = group * coarse.limits.step_s // self.limits.slot_s
                for mine, theirs in ((self.prompt_hist, coarse.prompt_hist),
                                     (self.generated_hist, coarse.generated_hist)):
                    if slot in mine:
                        theirs[slot] = list(mine[slot])

    def _group(self, group: int, k: int) -> StepObservation | None:
        """Coarse step ``group`` from its ``k`` fine steps (all held); None when one of them is missing."""
        lo = group * k - self.start
        counts = self.requests[lo:lo + k]
        if MISSING in counts:
            return None
        busiest = max(max(c, p) for c, p in zip(counts, self.peak_requests[lo:lo + k], strict=True))
        return StepObservation(requests=min(sum(counts), MAX_STEP_COUNT),
                               prompt_tokens=min(sum(self.prompt_tokens[lo:lo + k]), MAX_STEP_COUNT),
                               generated_tokens=min(sum(self.generated_tokens[lo:lo + k]), MAX_STEP_COUNT),
                               peak_requests=min(busiest * k, MAX_STEP_COUNT))

    def rates(self) -> list[float | None]:
        """Requests per step, None where missing."""
        return [None if r == MISSING else float(r) for r in self.requests]

    def peak_rates(self) -> list[float | None]:
        """Each step's peak (requests per step at its busiest sub-step's rate), None where the step is missing.

        Where the peak is unknown, the step's count stands in (a peak is never below the mean rate),
        so a history without peaks forecasts exactly as :meth:`rates` does.
        """
        return [None if r == MISSING else float(r if p == MISSING else max(r, p))
                for r, p in zip(self.requests, self.peak_requests, strict=True)]

    def _series(self) -> tuple[list[int], ...]:
        return (self.requests, self.prompt_tokens, self.generated_tokens, self.peak_requests)

    def prompt_histogram(self) -> list[int]:
        """Prompt lengths over every slot held, the coarse tier's included (its retention is longer)."""
        return _sum_slots(self._slots("prompt_hist"))

    def generated_histogram(self) -> list[int]:
        return _sum_slots(self._slots("generated_hist"))

    def _slots(self, name: str) -> dict[int, list[int]]:
        """The slots of histogram ``name``: the coarse tier's (closed slots), then the fine steps' for
        the slots it does not hold yet (the open one)."""
        mine: dict[int, list[int]] = getattr(self, name)
        if self.coarse is None:
            return mine
        return {**mine, **getattr(self.coarse, name)}

    def _clear(self, step: int) -> None:
        self.start = step
        for series in self._series():
            series.clear()
        self.prompt_hist.clear()
        self.generated_hist.clear()

    def _trim(self) -> None:
        excess = len(self.requests) - self.limits.points
        if excess > 0:
            for series in self._series():
                del series[:excess]
            self.start += excess
        first_slot = self.start * self.limits.step_s // self.limits.slot_s
        for hist in (self.prompt_hist, self.generated_hist):
            for slot in [s for s in hist if s < first_slot]:
                del hist[slot]


def _add_counts(hist: dict[int, list[int]], slot: int, counts: Sequence[int]) -> None:
    if not counts:
        return
    held = hist.setdefault(slot, [0] * BIN_COUNT)
    for index, count in enumerate(counts):
        held[index] += count


def _sum_slots(hist: Mapping[int, Sequence[int]]) -> list[int]:
    total = [0] * BIN_COUNT
    for counts in hist.values():
        for index, count in enumerate(counts):
            total[index] += count
    return total


def resampled(history: History, step_s: int) -> History:
    """``history`` at a longer step, a whole multiple of its own: each longer step sums the whole
    groups of shorter ones it spans (a group not yet whole, at either end, is left out: the newest
    one has not closed).  A group with a missing step is missing (its count would be too low); its
    peak is the busiest shorter step's peak (or count, where unknown) at the longer step's length.
    The length histograms are per hour slot, the same at either step.  The result has no coarse tier."""
    own = history.limits.step_s
    if step_s == own:
        return history
    if step_s < own or step_s % own or history.limits.slot_s % step_s:
        raise ValueError(f"a history at {own} s steps resamples only to a multiple of {own} s that divides "
                         f"its {history.limits.slot_s} s slots, not {step_s} s")
    k = step_s // own
    first, end = -(-history.start // k), history.end // k
    limits = HistoryLimits(step_s=step_s, retention_s=max(step_s, history.limits.retention_s),
                           slot_s=history.limits.slot_s)
    out = History(limits=limits, start=first if end > first else end)
    groups = max(0, end - first)
    if groups:  # vectorised: the operator resamples a whole history at every forecast step
        lo = first * k - history.start

        def grouped(series: Sequence[int]) -> np.ndarray[Any, np.dtype[np.int64]]:
            return np.asarray(series[lo:lo + groups * k], dtype=np.int64).reshape(groups, k)

        counts = grouped(history.requests)
        missing = (counts == MISSING).any(axis=1)
        peaks = np.maximum(counts, grouped(history.peak_requests)).max(axis=1) * k
        values = (counts.sum(axis=1), grouped(history.prompt_tokens).sum(axis=1),
                  grouped(history.generated_tokens).sum(axis=1), peaks)
        for series, value in zip(out._series(), values, strict=True):
            series.extend(np.where(missing, MISSING, np.minimum(value, MAX_STEP_COUNT)).tolist())
    out.prompt_hist = {slot: list(c) for slot, c in history.prompt_hist.items()}
    out.generated_hist = {slot: list(c) for slot, c in history.generated_hist.items()}
    return out


# --- serialisation ------------------------------------------------------------------------------


def dumps(history: History) -> str:
    """The compact, versioned text form of ``history`` (for a ConfigMap value)."""
    document = _document(history)
    if history.coarse is not None:  # an older reader ignores it
        document["coarse"] = _document(history.coarse)
    raw = json.dumps(document, separators=(",", ":")).encode()
    return PREFIX + base64.b64encode(zlib.compress(raw, 9)).decode("ascii")


def _document(history: History) -> dict[str, Any]:
    document: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "step_s": history.limits.step_s,
        "retention_s": history.limits.retention_s,
        "slot_s": history.limits.slot_s,
        "edges": list(LENGTH_EDGES),
        "start": history.start,
        "requests": history.requests,
        "prompt_tokens": history.prompt_tokens,
        "generated_tokens": history.generated_tokens,
        "prompt_hist": {str(slot): _trimmed(c) for slot, c in sorted(history.prompt_hist.items())},
        "generated_hist": {str(slot): _trimmed(c) for slot, c in sorted(history.generated_hist.items())},
    }
    if any(p != MISSING for p in history.peak_requests):  # an older reader ignores it; absent when all unknown
        document["peak_requests"] = history.peak_requests
    return document


def _trimmed(counts: Sequence[int]) -> list[int]:
    """Counts without trailing zeros (most histograms stop long before the overflow bin)."""
    end = len(counts)
    while end and counts[end - 1] == 0:
        end -= 1
    return list(counts[:end])


def loads(text: str) -> History:
    """Parse :func:`dumps`' output; raises :class:`HistoryFormatError` naming what is wrong."""
    if not isinstance(text, str) or not text.startswith(PREFIX):
        raise HistoryFormatError(f"not a warmpool history: expected a value starting with {PREFIX!r}")
    try:
        compressed = base64.b64decode(text[len(PREFIX):], validate=True)
    except (binascii.Error, ValueError) as error:
        raise HistoryFormatError(f"history is not valid base64: {error}") from None
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(compressed, MAX_DECODED_BYTES)
    except zlib.error as error:
        raise HistoryFormatError(f"history is not valid zlib data: {error}") from None
    if inflater.unconsumed_tail:
        raise HistoryFormatError(f"history decompresses to more than {MAX_DECODED_BYTES} bytes")
    if not inflater.eof:
        raise HistoryFormatError("history's zlib stream is truncated")
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HistoryFormatError(f"history is not valid JSON: {error}") from None
    return _from_document(document)


def loads_or_empty(text: str | None, limits: HistoryLimits | None = None) -> tuple[History, str | None]:
    """The history in ``text``, or an empty one and the reason it could not be used (never raises)."""
    fresh = History(limits=limits or HistoryLimits())
    if text is None:
        return fresh, "no stored history"
    try:
        history = loads(text)
    except HistoryFormatError as error:
        return fresh, f"stored history refused: {error}"
    if limits is not None and history.limits != limits:
        return fresh, f"stored history has limits {history.limits}, not {limits}"
    return history, None


def _from_document(document: Any, nested: bool = False) -> History:
    """The history in ``document`` (``nested``: a coarse tier, which may not hold one of its own)."""
    if not isinstance(document, dict):
        what = "history's coarse tier" if nested else "history"
        raise HistoryFormatError(f"{what} must be a JSON object, got {type(document).__name__}")
    if document.get("format") != FORMAT_NAME:
        raise HistoryFormatError(f"history format must be {FORMAT_NAME!r}, got {document.get('format')!r}")
    if document.get("version") != FORMAT_VERSION:
        raise HistoryFormatError(f"history version {document.get('version')!r} is not supported "
                                 f"(this operator reads version {FORMAT_VERSION})")
    try:
        limits = HistoryLimits(step_s=_int(document, "step_s"), retention_s=_int(document, "retention_s"),
                               slot_s=_int(document, "slot_s"))
    except ValueError as error:
        raise HistoryFormatError(f"history limits are invalid: {error}") from None
    if document.get("edges") != list(LENGTH_EDGES):
        raise HistoryFormatError("history's length bins differ from this operator's (written by another version)")
    start = _int(document, "start")
    series = [_series(document, name) for name in ("requests", "prompt_tokens", "generated_tokens")]
    if len({len(s) for s in series}) != 1:
        raise HistoryFormatError(f"history series differ in length: {[len(s) for s in series]}")
    if len(series[0]) > limits.points:
        raise HistoryFormatError(f"history holds {len(series[0])} steps, more than its retention ({limits.points})")
    peaks = _series(document, "peak_requests") if "peak_requests" in document else []
    if "peak_requests" in document and len(peaks) != len(series[0]):
        raise HistoryFormatError(f"history field 'peak_requests' holds {len(peaks)} steps, 'requests' {len(series[0])}")
    coarse: History | None = None
    if "coarse" in document:
        if nested:
            raise HistoryFormatError("history's coarse tier holds a coarse tier of its own")
        coarse = _from_document(document["coarse"], nested=True)
        try:
            limits = HistoryLimits(step_s=limits.step_s, retention_s=limits.retention_s, slot_s=limits.slot_s,
                                   coarse_step_s=coarse.limits.step_s, coarse_retention_s=coarse.limits.retention_s)
        except ValueError as error:
            raise HistoryFormatError(f"history's coarse tier does not fit its steps: {error}") from None
    history = History(limits=limits, start=start, requests=series[0], prompt_tokens=series[1],
                      generated_tokens=series[2], prompt_hist=_histograms(document, "prompt_hist"),
                      generated_hist=_histograms(document, "generated_hist"), peak_requests=peaks, coarse=coarse)
    first_slot = start * limits.step_s // limits.slot_s
    last_slot = (history.end - 1) * limits.step_s // limits.slot_s
    for name, hist in (("prompt_hist", history.prompt_hist), ("generated_hist", history.generated_hist)):
        outside = [slot for slot in hist if not first_slot <= slot <= last_slot]
        if outside:
            raise HistoryFormatError(f"history field {name!r} has slots {outside[:3]} outside the steps held "
                                     f"({first_slot}..{last_slot})")
    return history


def _int(document: Mapping[str, Any], name: str) -> int:
    value = document.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise HistoryFormatError(f"history field {name!r} must be an integer, got {value!r}")
    return value


def _series(document: Mapping[str, Any], name: str) -> list[int]:
    values = document.get(name)
    if not isinstance(values, list):
        raise HistoryFormatError(f"history field {name!r} must be a list of integers")
    for index, value in enumerate(values):
        if not isinstance(value, int) or isinstance(value, bool) or not MISSING <= value <= MAX_STEP_COUNT:
            raise HistoryFormatError(f"history field {name!r}[{index}] = {value!r} is not a count "
                                     f"(0..{MAX_STEP_COUNT}, or {MISSING} for missing)")
    return values


def _histograms(document: Mapping[str, Any], name: str) -> dict[int, list[int]]:
    raw = document.get(name)
    if not isinstance(raw, dict):
        raise HistoryFormatError(f"history field {name!r} must be an object of slot -> counts")
    out: dict[int, list[int]] = {}
    for key, counts in raw.items():
        try:
            slot = int(key)
        except ValueError:
            raise HistoryFormatError(f"history field {name!r} has a slot {key!r} that is not an integer") from None
        if (not isinstance(counts, list) or len(counts) > BIN_COUNT
                or any(not isinstance(c, int) or isinstance(c, bool) or not 0 <= c <= MAX_STEP_COUNT
                       for c in counts)):
            raise HistoryFormatError(f"history field {name!r}[{key}] must be at most {BIN_COUNT} non-negative counts")
        out[slot] = counts + [0] * (BIN_COUNT - len(counts))
    return out
