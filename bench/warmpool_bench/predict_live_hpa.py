"""The Kubernetes HPA's algorithm, run by the live replay itself (the local cluster has no metrics adapter).

Every ``sample_s`` it scrapes each live pod's ``/metrics`` on its pod IP (parsed by the operator's
own :func:`~warmpool_operator.io.worker_metrics.parse_metrics`) and adds each pod's counter deltas to pool totals
(a pod's first sample is only its baseline, as in the operator).  Every ``sync_s`` (15 s) it decides as
:class:`~.predict_policies.Reactive` does offline, with the same :class:`~.predict_policies.HpaSettings`:

* the metric is the pool's request rate (``warmpool_requests_total``) over the last ``window_s``, counted
  from the replay's start (the first syncs see a shorter window: the priming requests before the replay
  are not load);
* the target per pod is the *measured* capacity, as the operator reads it: the best point of the
  workers' capacity curve (requests finished per busy second at one batch size) since the replay's
  start, else served ÷ busy seconds in all (the prompt histogram's count and
  ``warmpool_engine_busy_seconds_total``), and nothing is decided until it is measured (no metric,
  an HPA does nothing);
* 10 % tolerance, scale-up at most ``max(2x, +4 pods)`` per sync, scale-down only to the highest
  recommendation of the last ``scale_down_stabilisation_s``, within ``[minWarm, maxReplicas]``;
* the decision is written through the WarmModel's scale subresource (field manager
  ``warmpool-bench-hpa``: the operator reads a non-kubectl scale writer as an autoscaler, and with
  prediction on raises the pool to its floor above this count itself).

``metrics_lag_s`` is not replayed: the counters are read at the sync itself.
"""

from __future__ import annotations

import http.client
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from warmpool_operator.io.worker_metrics import parse_metrics
from warmpool_operator.rules.forecast.steps import batch_counters, batch_deltas, capacity_curve

from warmpool.contract.api import API_GROUP, API_VERSION, PLURAL
from warmpool.contract.http import DEFAULT_WORKER_PORT, PATH_METRICS
from warmpool_bench.dialable import check_dialable
from warmpool_bench.predict_live_pool import PoolWatch
from warmpool_bench.predict_policies import HpaSettings

FIELD_MANAGER = "warmpool-bench-hpa"
MIN_SERVED = 3.0
MIN_BUSY_S = 0.5


@dataclass
class Decision:
    t: float  # monotonic
    rate_rps: float | None
    capacity_rps: float | None
    recommendation: int
    replicas: int


@dataclass
class EmulatedHpa:
    custom: Any
    watch: PoolWatch
    namespace: str
    name: str
    min_replicas: int
    max_replicas: int
    replicas: int  # what it wrote last (the scale's spec)
    settings: HpaSettings = field(default_factory=HpaSettings)
    sample_s: float = 5.0
    decisions: list[Decision] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _last: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # pod -> (requests, served, busy)
    _totals: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    _last_batch: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)  # pod -> curve counters
    _batch: dict[int, tuple[float, float]] = field(default_factory=dict)  # the curve's counts so far
    _samples: deque[tuple[float, float]] = field(default_factory=deque)  # (monotonic, pool requests so far)
    _recent: deque[tuple[float, int]] = field(default_factory=deque)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._sample()  # baselines: what the pods counted before the replay is not counted
        self._samples.clear()
        self._samples.append((time.monotonic(), 0.0))
        self._totals = [0.0, 0.0, 0.0]
        self._batch = {}
        self._thread = threading.Thread(target=self._run, name=f"hpa-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _run(self) -> None:
        next_sync = time.monotonic() + self.settings.sync_s
        while not self._stop.wait(self.sample_s):
            try:
                self._sample()
                if time.monotonic() >= next_sync - 1e-3:
                    next_sync += self.settings.sync_s
                    self._sync()
            except Exception as error:  # an API or scrape hiccup: noted; the next sync tries again
                self.errors.append(f"{type(error).__name__}: {str(error)[:200]}")
                del self.errors[:-20]

    def _sample(self) -> None:
        for life in self.watch.alive():
            if life.ip is None:
                continue
            text = _metrics(life.ip)
            if text is None:
                continue
            sample = parse_metrics(text)
            if sample.requests_total is None:
                continue
            now = (sample.requests_total, sample.prompt_count or 0.0, sample.busy_seconds or 0.0)
            before = self._last.get(life.name)
            self._last[life.name] = now
            batch = batch_counters(sample)
            batch_before = self._last_batch.get(life.name)
            self._last_batch[life.name] = batch
            if before is not None:
                for k in range(3):  # a lower value is a restarted worker: it counted from zero since
                    self._totals[k] += now[k] - before[k] if now[k] >= before[k] else now[k]
            if batch_before is not None:
                for edge, (finished, seconds) in batch_deltas(batch_before, batch).items():
                    had_finished, had_seconds = self._batch.get(edge, (0.0, 0.0))
                    self._batch[edge] = (had_finished + finished, had_seconds + seconds)
        self._samples.append((time.monotonic(), self._totals[0]))

    def _sync(self) -> None:
        s = self.settings
        now = time.monotonic()
        while len(self._samples) > 1 and self._samples[1][0] <= now - s.window_s:
            self._samples.popleft()
        (t_old, old), (t_new, new) = self._samples[0], self._samples[-1]
        rate = (new - old) / (t_new - t_old) if t_new > t_old else None
        served, busy = self._totals[1], self._totals[2]
        curve = capacity_curve([self._batch], MIN_BUSY_S, MIN_SERVED)
        capacity = (max(curve.values()) if curve
                    else served / busy if served >= MIN_SERVED and busy >= MIN_BUSY_S else None)
        current = self.replicas
        if rate is None or capacity is None:  # no metric yet: an HPA does nothing
            raw = current
        else:
            raw = max(0, math.ceil(rate / capacity - 1e-9))
            if current > 0 and abs(rate / (current * capacity) - 1) <= s.tolerance:
                raw = current
        recommendation = max(self.min_replicas, min(self.max_replicas, raw))
        self._recent.append((now, recommendation))
        while self._recent and self._recent[0][0] < now - s.scale_down_stabilisation_s:
            self._recent.popleft()
        if recommendation >= current:
            wanted = min(recommendation, max(math.ceil(current * s.scale_up_factor), current + s.scale_up_pods))
        else:
            wanted = min(current, max(r for _, r in self._recent))
        if wanted != current:
            self.custom.patch_namespaced_custom_object_scale(
                API_GROUP, API_VERSION, self.namespace, PLURAL, self.name, {"spec": {"replicas": wanted}},
                field_manager=FIELD_MANAGER, _request_timeout=10)
            self.replicas = wanted
        self.decisions.append(Decision(now, rate, capacity, recommendation, wanted))


def _metrics(ip: str) -> str | None:
    conn = http.client.HTTPConnection(check_dialable(ip), DEFAULT_WORKER_PORT, timeout=2.0)
    try:
        conn.request("GET", PATH_METRICS)
        response = conn.getresponse()
        return response.read(4 << 20).decode(errors="replace") if response.status == 200 else None
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
