"""The client side of `warmpool bench serve`: closed-loop clients streaming completions.

Each of ``concurrency`` clients sends its requests one after another (the next when the
previous one ended), over plain HTTP/1.1 on loopback, and times every streamed token.  Client
``i`` starts ``i * stagger_s`` after the first, so arrivals spread over a request's length
instead of landing in one burst.  Every loop is bounded in count (requests per client,
events per stream) and in time (a socket timeout per read, a deadline for the whole level).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

#: Most SSE events read from one stream (a completion of max_tokens sends one per token).
MAX_EVENTS = 100_000


@dataclass
class RequestTiming:
    """One streamed completion, timed from just before it was sent (perf_counter seconds)."""

    client: int
    index: int  # its place in the client's sequence
    prompt: int  # which prompt of the set
    sent: float
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    def record(self, origin: float) -> dict[str, Any]:
        out = asdict(self)
        out.pop("token_times")
        out.update(sent=self.sent - origin, tokens=self.tokens, ttft_s=self.ttft_s, tpot_s=self.tpot_s,
                   ended=(self.token_times[-1] - origin) if self.token_times else None)
        return out


def stream_completion(base_url: str, body: dict[str, Any], timing: RequestTiming, timeout_s: float) -> None:
    """POST a streaming completion and time each token event (an event with a choice)."""
    url = urlsplit(base_url)
    if url.hostname not in ("127.0.0.1", "localhost"):
        raise ValueError(f"the bench talks to loopback only, not {url.hostname!r}")
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    try:
        payload = json.dumps({**body, "stream": True})
        connection.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            timing.error = f"HTTP {response.status}: {response.read(2000).decode(errors='replace')}"
            return
        pieces: list[str] = []
        for _ in range(MAX_EVENTS):
            raw = response.readline(1 << 20)
            if not raw:
                break
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                timing.error = str(event["error"])[:500]
                break
            choices = event.get("choices") or []
            if not choices:
                continue
            text = choices[0].get("text") or ""
            if text or choices[0].get("finish_reason") is None:
                # one event per token; a closing event with no text (llama.cpp's) is not one
                timing.token_times.append(time.perf_counter())
                pieces.append(text)
        timing.text = "".join(pieces)
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as error:
        timing.error = f"{type(error).__name__}: {error}"
    finally:
        connection.close()


@dataclass(frozen=True)
class Level:
    """One concurrency level: who sends what."""

    concurrency: int
    requests_per_client: int
    max_tokens: int
    stagger_s: float
    deadline_s: float  # the whole level, all clients
    request_timeout_s: float


def run_level(base_url: str, model: str, prompts: Sequence[str], level: Level) -> tuple[list[RequestTiming], float]:
    """Every client's requests at this level; (timings, wall seconds from the first send to the last end)."""
    timings: list[RequestTiming] = []
    lock = threading.Lock()
    origin = time.perf_counter()
    deadline = origin + level.deadline_s

    def client(number: int) -> None:
        start_at = origin + number * level.stagger_s
        time.sleep(max(0.0, start_at - time.perf_counter()))
        for index in range(level.requests_per_client):
            if time.perf_counter() > deadline:
                return
            prompt = (number * level.requests_per_client + index) % len(prompts)
            timing = RequestTiming(number, index, prompt, time.perf_counter())
            body = {"model": model, "prompt": prompts[prompt], "max_tokens": level.max_tokens, "temperature": 0}
            stream_completion(base_url, body, timing, level.request_timeout_s)
            with lock:
                timings.append(timing)

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(level.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()) + level.request_timeout_s)
    ends = [t.token_times[-1] for t in timings if t.token_times]
    wall = (max(ends) - origin) if ends else 0.0
    return sorted(timings, key=lambda t: (t.client, t.index)), wall
