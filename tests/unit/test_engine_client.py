"""Parsing what an external engine answers: completions, /v1/models, /metrics (both vLLM names)."""

from __future__ import annotations

import pytest
from warmpool_worker.engine_client import EngineError, parse_completion, parse_metrics, parse_models

pytestmark = pytest.mark.unit

OLD = """# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e+09
"""
NEW = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
"""


def test_old_vllm_name() -> None:
    scrape = parse_metrics(OLD)
    assert scrape.kv_cache_usage == 0.25
    assert scrape.kv_cache_metric == "vllm:gpu_cache_usage_perc"
    assert scrape.process_start == 1.7e9


def test_new_vllm_name_wins_and_the_fullest_engine_counts() -> None:
    scrape = parse_metrics(OLD + NEW)
    assert scrape.kv_cache_usage == 0.75
    assert scrape.kv_cache_metric == "vllm:kv_cache_usage_perc"


def test_missing_figure_is_unknown_not_zero() -> None:
    scrape = parse_metrics("# TYPE other gauge\nother 1\n")
    assert scrape.kv_cache_usage is None and scrape.kv_cache_metric is None
    assert parse_metrics("this is { not prometheus").kv_cache_usage is None
    assert parse_metrics("vllm:kv_cache_usage_perc NaN\n").kv_cache_usage is None


def test_our_own_worker_gives_an_identity() -> None:
    text = 'warmpool_coldstart_phase_timestamp_seconds{phase="process_start"} 123.5\n'
    assert parse_metrics(text).process_start == 123.5


def test_completion_shapes() -> None:
    assert parse_completion({"choices": [{"text": "hi"}]}) == "hi"
    garbage_answers: list[object] = [[], {"choices": []}, {"choices": [{"text": 3}]}, {"error": "boom"}, "text"]
    for garbage in garbage_answers:
        with pytest.raises(EngineError) as caught:
            parse_completion(garbage)
        assert caught.value.reason == "garbage" and caught.value.retryable


def test_models_shapes() -> None:
    vllm = parse_models({"data": [{"id": "m", "max_model_len": 4096}]})
    assert (vllm.model_id, vllm.max_context) == ("m", 4096)
    llama_cpp = parse_models({"data": [{"id": "g", "meta": {"n_ctx_train": 8192}}]})
    assert (llama_cpp.model_id, llama_cpp.max_context) == ("g", 8192)
    assert parse_models({"data": "x"}).model_id is None
    assert parse_models(None).max_context is None
