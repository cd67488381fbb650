"""Request traces in the Azure LLM inference trace's CSV format: ``TIMESTAMP, ContextTokens, GeneratedTokens``.

``TIMESTAMP`` is ``YYYY-MM-DD HH:MM:SS[.fraction]`` (UTC; the Azure files carry 7 fractional
digits, more than :mod:`datetime` parses, so the fraction is read by hand).  Rows must be in
time order.  Any bad row is refused with an error naming its line; nothing is skipped quietly.
"""

from __future__ import annotations

import csv
import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import _csv

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
#: Longer prompts or outputs than this are not a real request (a unit or column mix-up).
MAX_TOKENS = 10_000_000


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    t: float  # seconds since the trace's first request
    prompt: int
    generated: int


@dataclass(frozen=True)
class Trace:
    source: str
    epoch_start: float  # unix time of the first request
    requests: tuple[TraceRequest, ...]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].t if self.requests else 0.0


def load_trace(path: Path) -> Trace:
    """Read a trace CSV; :class:`TraceError` naming the line on anything malformed."""
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as error:
        raise TraceError(f"{path}: cannot read the trace: {error.strerror or error}") from None
    times: list[float] = []
    parsed: list[tuple[int, int]] = []
    with handle:
        reader = csv.reader(handle)
        try:
            _read_rows(reader, path, times, parsed)
        except (csv.Error, UnicodeDecodeError) as error:
            raise TraceError(f"{path}:{reader.line_num + 1}: not CSV text: {error}") from None
    if not times:
        raise TraceError(f"{path}: no requests after the header")
    start = times[0]
    return Trace(source=str(path), epoch_start=start,
                 requests=tuple(TraceRequest(t - start, p, g) for t, (p, g) in zip(times, parsed, strict=True)))


def _read_rows(reader: _csv.Reader, path: Path, times: list[float], parsed: list[tuple[int, int]]) -> None:
    header = next(reader, None)
    if header is None:
        raise TraceError(f"{path}: empty file, expected a header {','.join(COLUMNS)}")
    names = [h.strip() for h in header]
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise TraceError(f"{path}:1: header lacks column(s) {missing}; expected {','.join(COLUMNS)}")
    index = [names.index(c) for c in COLUMNS]
    for row in reader:
        line = reader.line_num
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != len(names):
            raise TraceError(f"{path}:{line}: {len(row)} fields, the header has {len(names)}")
        stamp, prompt, generated = (row[i].strip() for i in index)
        when = parse_timestamp(stamp, f"{path}:{line}")
        if times and when < times[-1]:
            raise TraceError(f"{path}:{line}: timestamp {stamp} is before the row above it (rows must be in order)")
        times.append(when)
        parsed.append((_tokens(prompt, "ContextTokens", path, line), _tokens(generated, "GeneratedTokens", path, line)))


def parse_timestamp(text: str, where: str) -> float:
    """Unix seconds of ``YYYY-MM-DD HH:MM:SS[.fraction]`` (UTC)."""
    whole, _, fraction = text.partition(".")
    try:
        moment = dt.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.UTC)
    except ValueError:
        raise TraceError(f"{where}: TIMESTAMP {text!r} is not YYYY-MM-DD HH:MM:SS[.fraction]") from None
    if fraction and not fraction.isdigit():
        raise TraceError(f"{where}: TIMESTAMP {text!r} has a fraction that is not digits")
    return moment.timestamp() + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


def _tokens(text: str, column: str, path: Path, line: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceError(f"{path}:{line}: {column} {text!r} is not a whole number of tokens") from None
    if not 0 <= value <= MAX_TOKENS:
        raise TraceError(f"{path}:{line}: {column} {value} is outside 0..{MAX_TOKENS}")
    return value


def repeat(trace: Trace, times: int, gap_s: float = 1.0) -> Trace:
    """The trace played ``times`` times back to back (each copy ``gap_s`` after the last one's end).

    Repeating makes a longer history for the forecaster but a perfectly periodic one; the
    report says so plainly whenever it is used.
    """
    if times < 1:
        raise ValueError(f"repeat must be >= 1, got {times}")
    period = trace.duration_s + gap_s
    requests = tuple(TraceRequest(r.t + k * period, r.prompt, r.generated)
                     for k in range(times) for r in trace.requests)
    return Trace(source=f"{trace.source} (x{times})", epoch_start=trace.epoch_start, requests=requests)
