"""`warmpool worker sidecar` as a real subprocess reading a vLLM-format /metrics page over HTTP on
loopback, and re-exporting the engine's request figures under warmpool's names.

vLLM cannot run here (no GPU, two cores), so the engine is :mod:`tests.support.vllm_engine`: a
real aiohttp server whose page is rendered by prometheus_client from vLLM's own metric
definitions.  The absent path against an engine nobody here wrote is in
``test_sidecar.py::test_against_llama_cpp_server``.  Every wait is bounded.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from warmpool_worker.engine_signals import VLLM_REQUEST_SUCCESS

from tests.integration.test_sidecar import SidecarProcess, wait_for
from tests.support.vllm_engine import VllmStandIn
from warmpool.contract.metrics import (
    METRIC_ENGINE_BUSY_SECONDS,
    METRIC_GENERATED_TOKENS,
    METRIC_REQUEST_GENERATED_TOKENS,
    METRIC_REQUEST_PROMPT_TOKENS,
    METRIC_REQUESTS_IN_FLIGHT,
    METRIC_REQUESTS_QUEUED,
    METRIC_REQUESTS_TOTAL,
)

pytestmark = pytest.mark.integration

PROMPT = METRIC_REQUEST_PROMPT_TOKENS
SIGNALS = (METRIC_REQUESTS_TOTAL, METRIC_REQUESTS_IN_FLIGHT, METRIC_REQUESTS_QUEUED,
           METRIC_GENERATED_TOKENS, PROMPT + "_count", METRIC_REQUEST_GENERATED_TOKENS + "_count")


@pytest.fixture()
def engine() -> Iterator[VllmStandIn]:
    standin = VllmStandIn(max_model_len=8192)
    standin.start()
    try:
        yield standin
    finally:
        standin.close()


def _engine_finished(engine: VllmStandIn) -> float:
    return sum(s.value for family in text_string_to_metric_families(engine.vllm.render())
               for s in family.samples if s.name == VLLM_REQUEST_SUCCESS)


def _complete(engine: VllmStandIn, words: int, max_tokens: int) -> None:
    body = json.dumps({"model": "vllm-standin", "prompt": " ".join(["tok"] * words), "max_tokens": max_tokens})
    request = urllib.request.Request(engine.url + "/v1/completions", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def test_the_sidecar_re_exports_vllms_request_figures(engine: VllmStandIn, tmp_path: Path) -> None:
    sidecar = SidecarProcess(engine.url, tmp_path, "--buckets", "8,16", "--prompts-per-bucket", "1",
                             "--decode-tokens", "2")
    try:
        sidecar.wait_ready(timeout=60)
        # the warm-up requests are in vLLM's own figures: the sidecar shows the same count
        warmups = _engine_finished(engine)
        assert warmups == 2
        wait_for("the warm-up requests", lambda: sidecar.metric(METRIC_REQUESTS_TOTAL) == warmups, 20,
                 sidecar.proc, sidecar.log_path)
        before = sidecar.samples()

        for words, max_tokens in ((1500, 10), (1500, 10), (1500, 10), (4000, 20), (100, 5), (100, 5)):
            _complete(engine, words, max_tokens)
        engine.vllm.running.labels("vllm-standin", "0").set(2)
        engine.vllm.waiting.labels("vllm-standin", "0").set(5)
        wait_for("the served requests", lambda: sidecar.metric(METRIC_REQUESTS_TOTAL) == warmups + 6
                 and sidecar.metric(METRIC_REQUESTS_QUEUED) == 5, 20, sidecar.proc, sidecar.log_path)
        after = sidecar.samples()

        def delta(name: str, **labels: str) -> float:
            key = (name, tuple(sorted(labels.items())))
            return after[key] - before[key]

        assert after[(METRIC_REQUESTS_IN_FLIGHT, ())] == 2
        assert delta(METRIC_GENERATED_TOKENS) == 60
        assert delta(PROMPT + "_count") == 6 and delta(PROMPT + "_sum") == 3 * 1500 + 4000 + 2 * 100
        # warmpool's edges, interpolated within vLLM's 1-2-5 buckets: 3 prompts in (1000, 2000],
        # 1 in (2000, 5000], 2 in (50, 100]
        assert delta(PROMPT + "_bucket", le="128.0") == pytest.approx(2)
        assert delta(PROMPT + "_bucket", le="1536.0") == pytest.approx(2 + 3 * 536 / 1000)
        assert delta(PROMPT + "_bucket", le="2048.0") == pytest.approx(5 + 48 / 3000)
        assert delta(PROMPT + "_bucket", le="6144.0") == pytest.approx(6)
        assert delta(PROMPT + "_bucket", le="+Inf") == 6
        assert delta(METRIC_REQUEST_GENERATED_TOKENS + "_count") == 6
        assert (METRIC_ENGINE_BUSY_SECONDS, ()) not in after  # no external engine tells us that

        # a histogram whose counts fall is refused; the engine's other figures stay
        engine.metrics_mode = "garbage"
        wait_for("the garbage histogram dropped", lambda: (PROMPT + "_count", ()) not in sidecar.samples(), 20,
                 sidecar.proc, sidecar.log_path)
        assert sidecar.metric(METRIC_REQUESTS_TOTAL) == warmups + 6
        # an engine without these figures: every one of them absent, never 0
        engine.metrics_mode = "none"
        wait_for("the figures absent", lambda: not {name for name, _ in sidecar.samples()} & set(SIGNALS), 20,
                 sidecar.proc, sidecar.log_path)
        engine.metrics_mode = "vllm"
        wait_for("the figures back", lambda: sidecar.metric(METRIC_REQUESTS_TOTAL) == warmups + 6, 20,
                 sidecar.proc, sidecar.log_path)
        # the engine gone: nothing stale is left behind
        engine.stop()
        wait_for("the figures gone with the engine", lambda: not {n for n, _ in sidecar.samples()} & set(SIGNALS),
                 20, sidecar.proc, sidecar.log_path)
    finally:
        sidecar.close()
