"""What an external engine answers: completions, /v1/models, /metrics (both vLLM names), parsed,
and read whole under a bound over real HTTP."""

from __future__ import annotations

import json

import pytest
from warmpool_worker.sidecar.engine_client import (
    MAX_BODY_BYTES,
    EngineClient,
    EngineError,
    parse_completion,
    parse_metrics,
    parse_models,
)

from tests.support.loopback_peer import LoopbackPeer, Reply

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


# --------------------------------------------------------------------------- over real HTTP
# The sidecar's real EngineClient against a real loopback aiohttp peer playing the engine:
# each body is read whole, to EOF, under MAX_BODY_BYTES, before it is parsed.

KV_LINE = "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} "


async def test_a_split_metrics_body_is_read_whole_not_as_zero() -> None:
    async with LoopbackPeer() as peer:
        peer.replies["/metrics"] = Reply(((OLD + KV_LINE + "0.").encode(), b"95\n"), pause=0.3)
        client = EngineClient(peer.base_url, probe_timeout=5.0)
        try:
            scrape = await client.scrape()
        finally:
            await client.close()
    assert scrape.kv_cache_usage == pytest.approx(0.95)
    assert scrape.kv_cache_metric == "vllm:kv_cache_usage_perc"


async def test_a_split_models_answer_is_read_whole() -> None:
    answer = json.dumps({"object": "list", "data": [{"id": "served-model", "max_model_len": 4096}]}).encode()
    async with LoopbackPeer() as peer:
        peer.replies["/v1/models"] = Reply((answer[:20], answer[20:]), pause=0.3, content_type="application/json")
        client = EngineClient(peer.base_url, probe_timeout=5.0)
        try:
            info = await client.describe()
        finally:
            await client.close()
    assert (info.model_id, info.max_context) == ("served-model", 4096)


async def test_a_metrics_body_over_the_bound_is_unknown() -> None:
    padding = b"# " + b"x" * 65_000 + b"\n"
    pieces = ((NEW).encode(), *(padding,) * (MAX_BODY_BYTES // len(padding) + 2))
    async with LoopbackPeer() as peer:
        peer.replies["/metrics"] = Reply(pieces)  # chunked: the bound is met while reading
        client = EngineClient(peer.base_url, probe_timeout=10.0)
        try:
            scrape = await client.scrape()
        finally:
            await client.close()
    assert scrape.kv_cache_usage is None and scrape.kv_cache_metric is None


async def test_a_body_short_of_its_content_length_is_unknown() -> None:
    body = NEW.encode()
    answer = json.dumps({"data": [{"id": "m"}]}).encode()
    async with LoopbackPeer() as peer:
        peer.replies["/metrics"] = Reply((body,), content_length=len(body) + 64)
        peer.replies["/v1/models"] = Reply((answer,), content_length=len(answer) + 64)
        client = EngineClient(peer.base_url, probe_timeout=5.0)
        try:
            scrape = await client.scrape()
            info = await client.describe()
        finally:
            await client.close()
    assert scrape.kv_cache_usage is None
    assert info.model_id is None


async def test_completions_are_read_whole_and_bounded() -> None:
    answer = json.dumps({"choices": [{"text": "warm"}]}).encode()
    async with LoopbackPeer() as peer:
        peer.replies["/v1/completions"] = Reply((answer[:10], answer[10:]), pause=0.3)
        client = EngineClient(peer.base_url, request_timeout=5.0)
        try:
            assert await client.complete("hi", 1, None) == "warm"
            peer.replies["/v1/completions"] = Reply((b" " * 65_536,) * (MAX_BODY_BYTES // 65_536 + 2))
            with pytest.raises(EngineError) as caught:
                await client.complete("hi", 1, None)
        finally:
            await client.close()
    assert caught.value.reason == "garbage" and "larger than" in str(caught.value)
