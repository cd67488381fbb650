"""The live replay's load generator: streamed completions at the segment's arrival times, to the warm
pods only (on the local node's bridge), spread over them the way a least-requests load balancer does.

The offline model (:mod:`.predict_sim`) has one FCFS queue for the pool, in front of pods that serve a
batch each.  Here each request is sent **at its arrival**
to the warm pod with the fewest of the generator's requests in flight (ties by name), and waits there,
in the worker's own queue, if that pod is busy: the pods then count every arrival
(``warmpool_requests_total``), which is what the HPA and the operator's history read.  (A first version
held the queue in the generator and sent a request only to a free pod: the pods then counted only what
they served, and neither the HPA nor the forecaster ever saw the demand.)

* An arrival that finds a warm pod with **none of the generator's requests in flight** is a *warm hit*;
  anything else *found no warm capacity* (it waits behind another request, or for a pod to become warm),
  the offline definition as closely as per-pod queues allow: a request queued at a busy pod stays there
  even if another pod frees up or becomes warm first (offline, the pool's single queue would move it).
  "Warm" is the pod's worker answering ``/readyz`` 200 as last polled by
  :class:`~.predict_live_pool.PoolWatch` (every 0.5 s), not terminating.  With no warm pod at all,
  arrivals wait in the generator (FCFS) for the first one, and ``held`` is told how many (for a pool
  from zero, :mod:`.predict_live_held` reports them as the activator would).
* **TTFT** = the first streamed chunk's arrival less the request's scheduled arrival (queue wait included,
  as offline: wait + prefill).
* **Bounded**: at most ``max_in_flight`` requests sent and unanswered (more wait in the generator), at most
  ``max_queue`` waiting there (more are dropped and counted), each request at most ``request_timeout_s``,
  the whole run at most the segment plus ``drain_s``; the dispatch loop wakes at most every 50 ms.  Every
  address dialled is checked first: loopback, or a pod on the local cluster's node bridge.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from warmpool.contract.http import DEFAULT_WORKER_PORT
from warmpool_bench.dialable import NotDialable, check_dialable
from warmpool_bench.predict_trace import TraceRequest

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
TICK_S = 0.05


@dataclass
class Outcome:
    """One replayed request (times in seconds from the replay's start)."""

    index: int
    arrival: float
    prompt: int
    generated: int
    warm_hit: bool
    pod: str | None = None
    sent_at: float | None = None
    first_token_at: float | None = None
    done_at: float | None = None
    chunks: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def prefill_s(self) -> float | None:
        """Sent to first chunk: the pod's prefill (plus the round trip to the pod)."""
        return None if self.first_token_at is None or self.sent_at is None else self.first_token_at - self.sent_at

    @property
    def decode_s(self) -> float | None:
        return None if self.done_at is None or self.first_token_at is None else self.done_at - self.first_token_at


@dataclass
class LoadLimits:
    request_timeout_s: float = 90.0
    drain_s: float = 60.0  # after the last arrival, for the queue and the requests in flight
    max_queue: int = 400
    max_in_flight: int = 48  # the worker admits 64 waiting requests by default (--max-queued-requests)


def stream_completion(ip: str, body: dict[str, object], timeout_s: float,
                      on_first: Callable[[], None]) -> int:
    """POST a streamed completion to ``ip``; calls ``on_first`` at the first data chunk; returns the
    data chunks read (``[DONE]`` excluded).  Raises on anything but a 200 and a finished stream."""
    conn = http.client.HTTPConnection(check_dialable(ip), DEFAULT_WORKER_PORT, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read(300)!r}")
        chunks = 0
        max_lines = 4 * (int(str(body.get("max_tokens", 1))) + 8)  # data and blank lines, bounded
        for _ in range(max_lines):
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream not finished after {timeout_s:g}s")
            line = response.readline(1 << 16)
            if not line:
                raise RuntimeError("stream ended without [DONE]")
            text = line.strip()
            if not text.startswith(b"data:"):
                continue
            data = text[5:].strip()
            if data == b"[DONE]":
                return chunks
            if b'"error"' in data and json.loads(data).get("error"):
                raise RuntimeError(f"in-band error: {data[:300]!r}")
            if chunks == 0:
                on_first()
            chunks += 1
        raise RuntimeError(f"stream longer than {max_lines} lines")
    finally:
        conn.close()


@dataclass
class LoadGenerator:
    """Replays ``requests`` (times from the start) against the warm pods ``warm_pods()`` returns
    (name -> pod IP)."""

    requests: Sequence[TraceRequest]
    prompt_ids: Sequence[int]  # the longest prompt; each request sends its first ``prompt`` ids
    warm_pods: Callable[[], Mapping[str, str]]
    limits: LoadLimits = field(default_factory=LoadLimits)
    #: told, every dispatch round, how many requests wait with no warm pod at all (what an activator holds)
    held: Callable[[int], None] | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    dropped: int = 0
    late_s: float = 0.0  # how far behind its arrival time the generator admitted a request, at most
    _busy: dict[str, int] = field(default_factory=dict)  # pod -> the generator's requests in flight there
    _lock: threading.Condition = field(default_factory=threading.Condition)
    _in_flight: int = 0

    def run(self, t0: float) -> list[Outcome]:
        """Blocks until every request is answered, or the segment plus the drain time is over."""
        if len(self.prompt_ids) < max((r.prompt for r in self.requests), default=0):
            raise ValueError("the prompt ids are shorter than the longest prompt replayed")
        pending: deque[Outcome] = deque()
        end = t0 + (self.requests[-1].t if self.requests else 0.0) + self.limits.drain_s
        nxt = 0
        with ThreadPoolExecutor(max_workers=self.limits.max_in_flight, thread_name_prefix="live-load") as pool:
            while time.monotonic() < end:
                now = time.monotonic() - t0
                with self._lock:
                    warm = dict(self.warm_pods())
                    while nxt < len(self.requests) and self.requests[nxt].t <= now:
                        r = self.requests[nxt]
                        self.late_s = max(self.late_s, now - r.t)
                        idle = any(self._busy.get(p, 0) == 0 for p in warm)
                        outcome = Outcome(nxt, r.t, r.prompt, r.generated, warm_hit=not pending and idle)
                        nxt += 1
                        self.outcomes.append(outcome)
                        if len(pending) >= self.limits.max_queue:
                            outcome.error = "dropped: the generator's queue was full"
                            self.dropped += 1
                            continue
                        pending.append(outcome)
                    while pending and warm and self._in_flight < self.limits.max_in_flight:
                        pod = min(sorted(warm), key=lambda p: self._busy.get(p, 0))  # least requests
                        outcome = pending.popleft()
                        self._busy[pod] = self._busy.get(pod, 0) + 1
                        self._in_flight += 1
                        outcome.pod, outcome.sent_at = pod, time.monotonic() - t0
                        pool.submit(self._send, outcome, warm[pod], t0)
                    if self.held is not None:
                        self.held(0 if warm else len(pending))
                    if nxt >= len(self.requests) and not pending and self._in_flight == 0:
                        break
                    wait = TICK_S if nxt >= len(self.requests) else min(TICK_S, max(0.0, self.requests[nxt].t - now))
                    self._lock.wait(wait)
            for outcome in pending:
                outcome.error = "not served before the drain time ran out"
            # Requests still in flight end within request_timeout_s; the pool's shutdown waits for them.
        return self.outcomes

    def _send(self, outcome: Outcome, ip: str, t0: float) -> None:
        body: dict[str, object] = {"prompt": list(self.prompt_ids[:outcome.prompt]), "max_tokens": outcome.generated,
                                   "temperature": 0, "stream": True}

        def first() -> None:
            outcome.first_token_at = time.monotonic() - t0

        try:
            outcome.chunks = stream_completion(ip, body, self.limits.request_timeout_s, first)
            outcome.done_at = time.monotonic() - t0
        except NotDialable:
            raise
        except Exception as error:  # a pod scaled away mid-request, a timeout: counted, not fatal
            outcome.error = f"{type(error).__name__}: {str(error)[:200]}"
        finally:
            with self._lock:
                pod = str(outcome.pod)
                self._busy[pod] -= 1
                if not self._busy[pod]:
                    del self._busy[pod]
                self._in_flight -= 1
                self._lock.notify_all()
