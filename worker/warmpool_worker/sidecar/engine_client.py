"""HTTP client for an external OpenAI-compatible engine (vLLM, SGLang, TGI, llama.cpp).

What the sidecar needs from the engine, and nothing more:

* ``health()``: one probe of the health path (``/health`` on vLLM, SGLang, TGI and llama.cpp's
  own server); any 2xx is healthy; refused, timed out or any other status is not.
* ``describe()``: ``/v1/models`` -> the served model id (the completions request must name it)
  and the context length where the engine says it (vLLM's ``max_model_len``).
* ``complete()``: one ``/v1/completions`` request, greedy, with a timeout; the answer must
  look like a completion (a ``choices`` list with text) or it is *garbage*.
  ``complete_with_retries`` retries what may pass on a second try (refused, timeout, 5xx,
  429, garbage) a bounded number of times with backoff; a 4xx is the request's fault and
  is not retried.
* ``scrape()``: ``/metrics`` parsed with ``prometheus_client.parser``: the engine's KV-cache
  usage (vLLM under both of its names; absent -> None, never 0) and a process identity
  (``process_start_time_seconds``, or our own worker's process_start phase) so a restart
  between two health probes is still seen; and the request figures vLLM exports (requests,
  running, waiting, generated tokens, token-length histograms: :mod:`warmpool_worker.engine_signals`).

Every body is read whole, to EOF, under MAX_BODY_BYTES (:mod:`warmpool.http_body`), then
parsed: a body cut short, or longer than the bound, is an unusable answer (Unknown), never
a parse of the part that has arrived.

Only loopback is ever addressed in tests; the URL comes from the command line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from warmpool_worker.engine_signals import EngineSignals, signals_from_samples

from warmpool.contract.metrics import METRIC_PHASE_TIMESTAMP
from warmpool.http_body import BodyTooLarge, read_bounded

#: vLLM's KV-cache usage gauge (a 0..1 fraction despite "perc"), under both of its names:
#: `gpu_cache_usage_perc` up to v0.10, `kv_cache_usage_perc` from then on.  Read both.
VLLM_KV_CACHE_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


log = logging.getLogger(__name__)

DEFAULT_HEALTH_PATH = "/health"
DEFAULT_REQUEST_TIMEOUT_S = 60.0
DEFAULT_PROBE_TIMEOUT_S = 2.0
DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
#: An engine answer (completion, /v1/models, /metrics) larger than this is not one we use.
MAX_BODY_BYTES = 4 * 1024 * 1024


class EngineError(Exception):
    """A warm-up request failed; `reason` is a short label for metrics, `retryable` says if a retry may help."""

    def __init__(self, reason: str, message: str, retryable: bool, status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retryable = retryable
        self.status = status


class EngineUnavailable(EngineError):
    """Refused, reset or timed out: the engine is down, starting or wedged."""

    def __init__(self, message: str) -> None:
        super().__init__("unavailable", message, retryable=True)


@dataclass(frozen=True)
class EngineInfo:
    model_id: str | None
    max_context: int | None


@dataclass(frozen=True)
class EngineScrape:
    kv_cache_usage: float | None  # 0..1, None when the engine exports no such figure
    kv_cache_metric: str | None  # which name it came from
    process_start: float | None  # identity: changes when the engine process restarts
    signals: EngineSignals = field(default_factory=EngineSignals)  # request figures, each None when absent


def _positive_int(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def parse_models(body: object) -> EngineInfo:
    """Model id and context length from a /v1/models answer (first model; garbage -> Nones)."""
    if not isinstance(body, dict):
        return EngineInfo(None, None)
    data = body.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return EngineInfo(None, None)
    first: dict[str, Any] = data[0]
    model_id = first.get("id") if isinstance(first.get("id"), str) else None
    context = _positive_int(first.get("max_model_len"))  # vLLM
    meta = first.get("meta")
    if context is None and isinstance(meta, dict):
        context = _positive_int(meta.get("n_ctx")) or _positive_int(meta.get("n_ctx_train"))  # llama.cpp
    return EngineInfo(model_id, context)


def parse_completion(body: object) -> str:
    """The generated text, or EngineError('garbage') if this is not a completion."""
    if not isinstance(body, dict):
        raise EngineError("garbage", f"completion answer is not a JSON object: {str(body)[:120]!r}", True)
    if "error" in body and "choices" not in body:
        raise EngineError("garbage", f"engine answered 200 with an error: {str(body['error'])[:200]}", True)
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineError("garbage", f"completion answer has no choices: {str(body)[:120]!r}", True)
    text = choices[0].get("text")
    if not isinstance(text, str):
        raise EngineError("garbage", "completion choice has no text", True)
    return text


def parse_metrics(text: str) -> EngineScrape:
    """KV-cache usage (both vLLM names; the highest series if several), a process identity and
    the request figures."""
    from prometheus_client.parser import text_string_to_metric_families

    usage: dict[str, float] = {}
    start: float | None = None
    own_start: float | None = None
    try:
        samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except (ValueError, TypeError, IndexError) as error:  # the parser raises these on bad text
        log.debug("engine /metrics did not parse: %s", error)
        return EngineScrape(None, None, None)
    signals = signals_from_samples(samples)
    for sample in samples:
        value = sample.value
        if not isinstance(value, float | int) or not math.isfinite(value):
            continue
        if sample.name in VLLM_KV_CACHE_USAGE_METRICS and value >= 0:
            usage[sample.name] = max(usage.get(sample.name, 0.0), float(value))
        elif sample.name == "process_start_time_seconds":
            start = float(value)
        elif sample.name == METRIC_PHASE_TIMESTAMP and sample.labels.get("phase") == "process_start":
            own_start = float(value)
    identity = start if start is not None else own_start
    for name in VLLM_KV_CACHE_USAGE_METRICS:  # the current name wins when both are exported
        if name in usage:
            return EngineScrape(usage[name], name, identity, signals)
    return EngineScrape(None, None, identity, signals)


class EngineClient:
    """One aiohttp session to one engine; every call bounded by a timeout."""

    def __init__(
        self,
        base_url: str,
        health_path: str = DEFAULT_HEALTH_PATH,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        probe_timeout: float = DEFAULT_PROBE_TIMEOUT_S,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.health_path = health_path if health_path.startswith("/") else f"/{health_path}"
        self.request_timeout = request_timeout
        self.probe_timeout = probe_timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no keep-alive pool surprises across an engine restart: a fresh connection per call
            connector = aiohttp.TCPConnector(force_close=True, limit=8)
            self._session = aiohttp.ClientSession(connector=connector, headers=self.headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _get(self, path: str, limit_s: float, *, read_body: bool = True) -> tuple[int, bytes]:
        """(status, the whole body); EngineUnavailable when the body is cut short or too large."""
        try:
            async with self._http().get(
                self.base_url + path, timeout=aiohttp.ClientTimeout(total=limit_s)
            ) as response:
                body = await read_bounded(response, MAX_BODY_BYTES) if read_body else b""
                return response.status, body
        except BodyTooLarge as error:
            raise EngineUnavailable(f"GET {path}: {error}") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            raise EngineUnavailable(f"GET {path}: {type(error).__name__}: {error}") from None

    async def call(self, method: str, path: str, limit_s: float, json_body: object = None) -> tuple[int, bytes]:
        """(status, the whole body, bounded) of one request; EngineUnavailable when it fails."""
        try:
            async with self._http().request(
                method, self.base_url + path, json=json_body, timeout=aiohttp.ClientTimeout(total=limit_s)
            ) as response:
                return response.status, await read_bounded(response, MAX_BODY_BYTES)
        except BodyTooLarge as error:
            raise EngineUnavailable(f"{method} {path}: {error}") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            raise EngineUnavailable(f"{method} {path}: {type(error).__name__}: {error}") from None

    async def health(self) -> bool:
        try:  # the status is the answer; the body is never read (the connection is not reused)
            status, _ = await self._get(self.health_path, self.probe_timeout, read_body=False)
        except EngineUnavailable:
            return False
        return 200 <= status < 300

    async def describe(self) -> EngineInfo:
        try:
            status, body = await self._get("/v1/models", self.probe_timeout)
            if status != 200:
                return EngineInfo(None, None)
            return parse_models(json.loads(body))
        except (EngineUnavailable, ValueError):
            return EngineInfo(None, None)

    async def scrape(self, path: str = "/metrics") -> EngineScrape:
        try:
            status, body = await self._get(path, self.probe_timeout)
        except EngineUnavailable:
            return EngineScrape(None, None, None)
        if status != 200:
            return EngineScrape(None, None, None)
        return parse_metrics(body.decode("utf-8", errors="replace"))

    async def complete(self, prompt: str, max_tokens: int, model: str | None) -> str:
        payload: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
        if model is not None:
            payload["model"] = model
        try:
            async with self._http().post(
                self.base_url + "/v1/completions",
                json=payload,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout),
            ) as response:
                status = response.status
                raw = await read_bounded(response, MAX_BODY_BYTES)
        except BodyTooLarge as error:
            raise EngineError("garbage", f"completion answer: {error}", True, status) from None
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            raise EngineUnavailable(f"POST /v1/completions: {type(error).__name__}: {error}") from None
        detail = raw[:300].decode("utf-8", errors="replace")
        if status == 429 or status >= 500:
            raise EngineError(f"http_{status // 100}xx", f"engine answered {status}: {detail}", True, status)
        if status >= 400:
            raise EngineError(f"http_{status // 100}xx", f"engine refused the prompt ({status}): {detail}",
                              False, status)
        if status != 200:
            raise EngineError("garbage", f"unexpected status {status}: {detail}", True, status)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise EngineError("garbage", f"completion answer is not JSON: {detail[:120]!r}", True) from None
        return parse_completion(body)

    async def complete_with_retries(
        self,
        prompt: str,
        max_tokens: int,
        model: str | None,
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF_S,
        on_error: Callable[[EngineError], None] | None = None,
    ) -> tuple[str, float]:
        """(text, seconds of the successful attempt); the last error once `retries` retries are spent."""
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                text = await self.complete(prompt, max_tokens, model)
                return text, time.monotonic() - started
            except EngineError as error:
                if on_error is not None:
                    on_error(error)
                if not error.retryable or attempt >= retries:
                    raise
                delay = min(MAX_BACKOFF_S, backoff * (2**attempt))
                log.info("warm-up request failed (%s), retry %d/%d in %.1fs", error, attempt + 1, retries, delay)
                attempt += 1
                await asyncio.sleep(delay)
