"""Trace CSVs in the Azure format: read exactly, and every malformed file refused with its line named."""

from __future__ import annotations

from pathlib import Path

import pytest
from warmpool_bench.predict_trace import TraceError, load_trace, parse_timestamp, repeat

pytestmark = pytest.mark.unit

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
SHARED_TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "azure-llm-trace-2023" / "code.csv"


def _write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "trace.csv"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_reads_the_azure_format_with_seven_fractional_digits(tmp_path: Path) -> None:
    trace = load_trace(_write(tmp_path, HEADER + "2023-11-16 18:17:03.9799600,4808,10\n"
                              "2023-11-16 18:17:04.0319600,3180,8\n\n2023-11-16 18:17:05,110,27\n"))
    assert [(round(r.t, 4), r.prompt, r.generated) for r in trace.requests] == [
        (0.0, 4808, 10), (0.052, 3180, 8), (1.0200, 110, 27)]
    assert trace.epoch_start == pytest.approx(parse_timestamp("2023-11-16 18:17:03.97996", "x"))
    assert trace.duration_s == pytest.approx(1.02004)


def test_columns_may_come_in_any_order(tmp_path: Path) -> None:
    trace = load_trace(_write(tmp_path, "GeneratedTokens,TIMESTAMP,ContextTokens\n5,2023-11-16 18:17:03,100\n"))
    assert (trace.requests[0].prompt, trace.requests[0].generated) == (100, 5)


BAD = [
    ("", "empty file"),
    ("time,prompt\n", ":1: header lacks column(s)"),
    (HEADER + "2023-11-16 18:17:03,10\n", ":2: 2 fields, the header has 3"),
    (HEADER + "2023-11-16 18:17:03,10,1\nyesterday,10,1\n", ":3: TIMESTAMP 'yesterday'"),
    (HEADER + "2023-11-16 18:17:03.12x,10,1\n", ":2: TIMESTAMP '2023-11-16 18:17:03.12x' has a fraction"),
    (HEADER + "2023-11-16 18:17:03,ten,1\n", ":2: ContextTokens 'ten' is not a whole number"),
    (HEADER + "2023-11-16 18:17:03,10,-1\n", ":2: GeneratedTokens -1 is outside"),
    (HEADER + "2023-11-16 18:17:05,10,1\n2023-11-16 18:17:04,10,1\n", ":3: timestamp 2023-11-16 18:17:04 is before"),
    (HEADER, "no requests after the header"),
    (HEADER.encode() + b"2023-11-16 18:17:03,1\xff0,1\n", ": not CSV text"),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_csv_names_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(TraceError) as error:
        load_trace(path)
    assert str(error.value).startswith(str(path)) and message in str(error.value)


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read the trace"):
        load_trace(tmp_path / "nope.csv")


def test_repeat_plays_the_trace_back_to_back(tmp_path: Path) -> None:
    trace = load_trace(_write(tmp_path, HEADER + "2023-11-16 18:17:03,1,1\n2023-11-16 18:17:13,2,2\n"))
    twice = repeat(trace, 2, gap_s=5.0)
    assert [r.t for r in twice.requests] == [0.0, 10.0, 15.0, 25.0]
    assert "(x2)" in twice.source
    with pytest.raises(ValueError, match="repeat"):
        repeat(trace, 0)


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="the shared Azure trace is not checked out beside the repo")
def test_the_shared_azure_trace_loads_whole() -> None:
    trace = load_trace(SHARED_TRACE)
    assert len(trace.requests) == 8819  # its README: 8,819 requests over 3,436 s
    assert trace.duration_s == pytest.approx(3436, abs=1)
