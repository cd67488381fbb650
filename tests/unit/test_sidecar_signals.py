"""vLLM's request figures read from its /metrics page and re-exported under warmpool's names:
summed over engines, token histograms re-binned onto warmpool's edges, garbage and absence
absent (never 0); the built-in worker's token histograms and busy seconds."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from warmpool_worker.engine_signals import EngineSignals, rebin
from warmpool_worker.metrics import SidecarMetrics, WorkerMetrics
from warmpool_worker.sidecar.engine_client import parse_metrics

from tests.support.vllm_engine import VllmMetrics, buckets_1_2_5
from warmpool.contract.files import TOKEN_LENGTH_EDGES
from warmpool.contract.metrics import (
    BATCH_SIZE_EDGES,
    METRIC_ENGINE_BATCH_FINISHED,
    METRIC_ENGINE_BATCH_SECONDS,
    METRIC_ENGINE_BUSY_SECONDS,
    METRIC_GENERATED_TOKENS,
    METRIC_REQUEST_GENERATED_TOKENS,
    METRIC_REQUEST_PROMPT_TOKENS,
    METRIC_REQUESTS_IN_FLIGHT,
    METRIC_REQUESTS_QUEUED,
    METRIC_REQUESTS_TOTAL,
)

pytestmark = pytest.mark.unit

EDGE = {edge: index for index, edge in enumerate(TOKEN_LENGTH_EDGES)}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for family in text_string_to_metric_families(text) for s in family.samples}


def _names(text: str) -> set[str]:
    return {name for name, _ in _samples(text)}


SIGNAL_SERIES = {METRIC_REQUESTS_TOTAL, METRIC_REQUESTS_IN_FLIGHT, METRIC_REQUESTS_QUEUED,
                 METRIC_GENERATED_TOKENS, METRIC_REQUEST_PROMPT_TOKENS + "_count",
                 METRIC_REQUEST_GENERATED_TOKENS + "_count", METRIC_ENGINE_BUSY_SECONDS}


def test_vllm_bucket_rule_is_one_two_five() -> None:
    assert buckets_1_2_5(8192) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]


def test_vllm_figures_are_summed_over_engines_and_rebinned() -> None:
    vllm = VllmMetrics(max_model_len=8192, engines=2)
    for _ in range(3):
        vllm.finished(1500, 10, engine=0)  # in vLLM's (1000, 2000] bucket
    vllm.finished(4000, 20, engine=1, reason="stop")  # in (2000, 5000]
    vllm.running.labels("vllm-standin", "0").set(2)
    vllm.running.labels("vllm-standin", "1").set(1)
    vllm.waiting.labels("vllm-standin", "1").set(5)
    signals = parse_metrics(vllm.render()).signals
    assert (signals.requests, signals.in_flight, signals.queued, signals.generated_tokens) == (4, 3, 5, 50)
    prompts = signals.prompt_lengths
    assert prompts is not None and (prompts.count, prompts.total) == (4, 3 * 1500 + 4000)
    cumulative = prompts.cumulative
    assert cumulative[EDGE[768]] == 0  # below 1000 nothing was seen
    # linear within vLLM's bucket: 3 prompts over (1000, 2000], 1 over (2000, 5000]
    assert cumulative[EDGE[1536]] == pytest.approx(3 * 536 / 1000)
    assert cumulative[EDGE[2048]] == pytest.approx(3 + 48 / 3000)
    assert cumulative[EDGE[4096]] == pytest.approx(3 + 2096 / 3000)
    assert cumulative[EDGE[6144]] == 4 and cumulative[-1] == 4  # past 5000: everything
    generated = signals.generated_lengths
    assert generated is not None and generated.count == 4 and generated.cumulative[EDGE[16]] == pytest.approx(3.6)


def test_rebin_keeps_exact_points_and_sends_lengths_past_the_engines_buckets_to_inf() -> None:
    # an engine whose buckets stop at 1024 (a small max_model_len): 2 prompts above it, only in +Inf
    histogram = rebin([(512.0, 4.0), (1024.0, 10.0)], count=12.0, total=9000.0)
    assert histogram is not None
    assert histogram.cumulative[EDGE[512]] == 4 and histogram.cumulative[EDGE[1024]] == 10
    assert histogram.cumulative[EDGE[2048]] == 10 and histogram.count == 12
    first_le, first_count = histogram.buckets()[0]
    assert histogram.buckets()[-1] == ("+Inf", 12.0) and first_le == "16.0" and first_count == pytest.approx(0.125)


@pytest.mark.parametrize(("points", "count", "total"), [
    ([(100.0, 5.0), (200.0, 3.0)], 5.0, 100.0),  # cumulative counts fall
    ([(100.0, -1.0)], 1.0, 100.0),  # negative
    ([(100.0, 5.0)], 4.0, 100.0),  # +Inf below a finite bucket
    ([(100.0, 5.0)], 5.0, -3.0),  # negative sum
    ([], 0.0, 0.0),  # no finite bucket
])
def test_rebin_refuses_garbage(points: list[tuple[float, float]], count: float, total: float) -> None:
    assert rebin(points, count, total) is None


def test_an_engine_without_these_figures_or_with_garbage_has_them_absent() -> None:
    assert parse_metrics("process_start_time_seconds 5\n").signals == EngineSignals()
    assert parse_metrics("not { a metrics page").signals == EngineSignals()
    text = ('vllm:num_requests_running{engine="0"} NaN\n'
            'vllm:num_requests_waiting{engine="0"} -2\n'
            'vllm:generation_tokens_total{engine="0"} +Inf\n'
            'vllm:request_success_total{engine="0",finished_reason="stop"} 7\n')
    signals = parse_metrics(text).signals
    assert signals == EngineSignals(requests=7.0)


def test_the_sidecar_exports_the_engines_figures_under_warmpools_names_and_nothing_it_does_not_know() -> None:
    metrics = SidecarMetrics()
    # before any scrape: none of the request series (the built-in worker's would read 0 forever here)
    assert not SIGNAL_SERIES & _names(metrics.render().decode())
    vllm = VllmMetrics(max_model_len=8192)
    vllm.finished(1500, 10)
    vllm.waiting.labels("vllm-standin", "0").set(2)
    metrics.set_engine_signals(parse_metrics(vllm.render()).signals)
    samples = _samples(metrics.render().decode())
    assert samples[(METRIC_REQUESTS_TOTAL, ())] == 1
    assert samples[(METRIC_REQUESTS_QUEUED, ())] == 2
    assert samples[(METRIC_REQUESTS_IN_FLIGHT, ())] == 0
    assert samples[(METRIC_GENERATED_TOKENS, ())] == 10
    assert samples[(METRIC_REQUEST_PROMPT_TOKENS + "_sum", ())] == 1500
    assert samples[(METRIC_REQUEST_PROMPT_TOKENS + "_bucket", (("le", "1536.0"),))] == pytest.approx(0.536)
    assert samples[(METRIC_REQUEST_PROMPT_TOKENS + "_bucket", (("le", "+Inf"),))] == 1
    assert (METRIC_ENGINE_BUSY_SECONDS, ()) not in samples  # no external engine tells us that
    assert not {name for name, _ in samples} & {METRIC_ENGINE_BATCH_SECONDS, METRIC_ENGINE_BATCH_FINISHED}
    metrics.set_engine_signals(EngineSignals())  # the engine stopped answering
    assert not SIGNAL_SERIES & _names(metrics.render().decode())


def test_the_builtin_worker_observes_tokens_per_request_at_the_contracts_edges() -> None:
    metrics = WorkerMetrics()
    metrics.request_served(prompt_tokens=1469, generated_tokens=7)
    metrics.request_served(prompt_tokens=20, generated_tokens=0)
    # engine-busy time comes from the batch's steps, once per step whatever its size
    metrics.engine_step(0.25, 7, batch=7, finished=2)
    metrics.engine_step(-1.0, 0, batch=1, finished=0)  # a clock step never subtracts
    metrics.engine_step(0.5, 5, batch=5, finished=0)
    metrics.engine_step(0.125, 20, batch=200, finished=1)  # past the last edge: the last bucket
    samples = _samples(metrics.render().decode())
    prompt = METRIC_REQUEST_PROMPT_TOKENS
    les = [dict(labels)["le"] for name, labels in samples if name == prompt + "_bucket"]
    assert les == [f"{float(edge)}" for edge in TOKEN_LENGTH_EDGES] + ["+Inf"]
    assert samples[(prompt + "_bucket", (("le", "24.0"),))] == 1
    assert samples[(prompt + "_bucket", (("le", "1024.0"),))] == 1
    assert samples[(prompt + "_bucket", (("le", "1536.0"),))] == 2
    assert samples[(prompt + "_sum", ())] == 1489
    assert samples[(METRIC_REQUEST_GENERATED_TOKENS + "_bucket", (("le", "16.0"),))] == 2
    assert samples[(METRIC_ENGINE_BUSY_SECONDS, ())] == 0.875
    # the capacity curve's points: busy seconds and finished requests by batch-size bucket
    assert samples[(METRIC_ENGINE_BATCH_SECONDS, (("batch", "4"),))] == 0.75
    assert samples[(METRIC_ENGINE_BATCH_FINISHED, (("batch", "4"),))] == 2
    assert samples[(METRIC_ENGINE_BATCH_SECONDS, (("batch", "1"),))] == 0
    assert (METRIC_ENGINE_BATCH_FINISHED, (("batch", "1"),)) not in samples  # nothing finished there
    assert samples[(METRIC_ENGINE_BATCH_FINISHED, (("batch", str(BATCH_SIZE_EDGES[-1])),))] == 1


def test_token_edges_are_the_graph_friendly_sizes() -> None:
    expected = sorted({1 << shift for shift in range(4, 18)} | {3 << shift for shift in range(3, 16)})
    assert list(TOKEN_LENGTH_EDGES) == expected


@pytest.mark.parametrize("bound", ["\u0663", "\uff13", "3_0", "nan", "infinity", "-3"])
def test_an_engine_bucket_bound_not_in_plain_ascii_is_left_out(bound: str) -> None:
    """float() took other scripts' digits, "3_0", "nan" and "infinity" as bounds."""

    def histogram(extra: str) -> object:
        text = ('vllm:request_prompt_tokens_bucket{le="100.0"} 1\n' + extra
                + 'vllm:request_prompt_tokens_bucket{le="+Inf"} 2\n'
                'vllm:request_prompt_tokens_count 2\nvllm:request_prompt_tokens_sum 300\n')
        return parse_metrics(text).signals.prompt_lengths

    plain = histogram("")
    assert plain is not None
    assert histogram(f'vllm:request_prompt_tokens_bucket{{le="{bound}"}} 2\n') == plain
