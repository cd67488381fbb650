"""`warmpool bench serve`'s figures: pure functions of token timestamps, targets judged, the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from warmpool_bench.serve_load import RequestTiming, stream_completion
from warmpool_bench.serve_report import judge, level_figures, plot_serve, render_serve, same_text

pytestmark = pytest.mark.unit


def _timing(client: int, index: int, sent: float, first: float, gap: float, tokens: int, text: str = "x",
            prompt: int = 0) -> RequestTiming:
    return RequestTiming(client, index, prompt, sent, [first + gap * i for i in range(tokens)], text)


def test_level_figures_from_token_times() -> None:
    # two clients, one request each: 10 tokens 0.1 s apart, first tokens 0.5 s after sending
    timings = [_timing(0, 0, 0.0, 0.5, 0.1, 10), _timing(1, 0, 0.2, 0.7, 0.1, 10)]
    figures = level_figures(timings, wall_s=1.6, concurrency=2)
    assert figures["output_tokens"] == 20 and figures["requests"] == 2 and figures["error_count"] == 0
    assert figures["throughput_tok_s"] == pytest.approx(20 / 1.6)
    assert figures["ttft_p50_s"] == pytest.approx(0.5) and figures["tpot_p50_s"] == pytest.approx(0.1)
    # steady: from the last client's first send (0.2) to the first client's last token (1.4)
    inside = sum(1 for t in timings for at in t.token_times if 0.2 <= at <= 1.4 + 1e-9)
    assert figures["steady_tok_s"] == pytest.approx(inside / 1.2)


def test_failed_requests_are_counted_not_timed() -> None:
    broken = RequestTiming(0, 1, 0, 0.0, [], "", error="HTTP 503: busy")
    figures = level_figures([_timing(0, 0, 0.0, 0.3, 0.1, 5), broken], wall_s=1.0, concurrency=1)
    assert figures["error_count"] == 1 and figures["errors"] == ["HTTP 503: busy"]
    assert figures["output_tokens"] == 5 and figures["ttft_p95_s"] == pytest.approx(0.3)


def _levels(single_tok_s: float, wide_tok_s: float, ttft_alone: float, ttft_wide_p95: float) -> dict[str, Any]:
    return {"1": {"steady_tok_s": single_tok_s, "throughput_tok_s": single_tok_s, "ttft_p50_s": ttft_alone},
            "12": {"steady_tok_s": wide_tok_s, "throughput_tok_s": wide_tok_s, "ttft_p95_s": ttft_wide_p95}}


def test_targets_are_judged_at_twelve_against_one() -> None:
    met = judge(_levels(20.0, 90.0, 0.4, 1.0))
    assert met["throughput_ratio"] == pytest.approx(4.5) and met["throughput_met"] is True
    assert met["ttft_p95_ratio"] == pytest.approx(2.5) and met["ttft_met"] is True
    missed = judge(_levels(20.0, 60.0, 0.4, 2.0))
    assert missed["throughput_met"] is False and missed["ttft_met"] is False
    assert judge({"1": _levels(1, 1, 1, 1)["1"]}) == {"throughput": None, "ttft": None}


def test_same_text_compares_each_prompt_with_its_level_one_text() -> None:
    levels = {1: [_timing(0, 0, 0, 0.1, 0.1, 3, "abc", prompt=0), _timing(0, 1, 0, 0.1, 0.1, 3, "de", prompt=1)],
              4: [_timing(0, 0, 0, 0.1, 0.1, 3, "abc", prompt=0), _timing(1, 0, 0, 0.1, 0.1, 3, "XX", prompt=1),
                  _timing(2, 0, 0, 0.1, 0.1, 3, "zz", prompt=7)]}
    assert same_text(levels) == {"compared": 2, "equal": 1}


def test_the_report_says_met_or_missed_and_the_chart_is_drawn(tmp_path: Path) -> None:
    levels = {c: level_figures([_timing(i, 0, 0.0, 0.4, 0.05, 20) for i in range(c)], 1.5, c) for c in (1, 12)}
    server = {"what": "a server", "levels": {str(c): f for c, f in levels.items()}, "slots": None,
              "targets": judge({str(c): f for c, f in levels.items()}), "same_text": {"compared": 3, "equal": 3},
              "utilisation": {"1": 0.9}}
    result = {"settings": {"threads": 2, "prompt_tokens": 128, "max_tokens": 64, "requests_per_client": 4},
              "commit": "abc123", "load_average_start": [1.0, 1.0, 1.0], "load_average_end": [2.0, 2.0, 2.0],
              "cpus": 2, "wall_s": 100.0, "model_dir": "/m/smollm2", "servers": {"warmpool": server}}
    text = render_serve(result)
    assert "# warmpool bench serve" in text and "load average 1.00 at start, 2.00 at the end" in text
    assert "| 12 | 12 | 240 |" in text and "**met**" in text and "3/3" in text
    plot_serve(result, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").stat().st_size > 1000


def test_the_client_talks_to_loopback_only() -> None:
    timing = RequestTiming(0, 0, 0, 0.0)
    with pytest.raises(ValueError, match="loopback"):
        stream_completion("http://10.0.0.1:8080", {"prompt": "x"}, timing, 1.0)


def test_time_between_tokens_shows_a_stall_the_mean_hides() -> None:
    stalled = RequestTiming(0, 0, 0, 0.0, [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 2.3, 3.3])  # two 1 s gaps
    smooth = [_timing(1, 0, 0.0, 0.5, 0.1, 11)]
    figures = level_figures([stalled, *smooth], wall_s=2.4, concurrency=2)
    assert figures["tbt_p50_s"] == pytest.approx(0.1)
    assert figures["tbt_p95_s"] > 0.5 > figures["tpot_p95_s"]  # the stalls, against its request's mean 0.28 s
    alone = level_figures(smooth, wall_s=1.5, concurrency=1)
    verdict = judge({"1": alone, "12": figures})
    assert verdict["tbt_p95_ratio"] == pytest.approx(figures["tbt_p95_s"] / 0.1) and verdict["tbt_met"] is False


def test_side_by_side_at_one_and_twelve() -> None:
    from warmpool_bench.serve_report import scaling_table

    def server(tok_s_12: float) -> dict[str, Any]:
        levels = {"1": level_figures([_timing(0, 0, 0.0, 0.4, 0.05, 20)], 1.35, 1),
                  "12": level_figures([_timing(i, 0, 0.0, 0.4, 0.05, 20) for i in range(12)], 1.35, 12)}
        levels["12"]["steady_tok_s"] = tok_s_12
        return {"levels": levels, "targets": judge(levels)}

    lines = scaling_table({"warmpool": server(60.0), "llama_server_f32": server(30.0)})
    header = next(line for line in lines if line.startswith("| server |"))
    assert "scaling 1 -> 12" in header and "TBT p95 at 12 s" in header
    rows = [line for line in lines if line.startswith(("| warmpool |", "| llama_server_f32 |"))]
    assert len(rows) == 2 and "| 60.0 |" in rows[0] and "| 30.0 |" in rows[1]
