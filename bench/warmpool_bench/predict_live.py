"""`warmpool bench predict --live`: a segment of the trace replayed against real pods, one WarmModel per policy.

The live half of the predictive-scaling benchmark (the offline half is :mod:`.predict`).  The segment
(:mod:`.predict_live_segment`: thinned, time-compressed, prompts and generation capped) is played by a
load generator (:mod:`.predict_live_load`) against the pods of one WarmModel per policy, run
**one after another** (side by side, three pools would share the two CPU cores this was built on, and
each would measure the others):

* ``fixed``: ``replicas`` fixed pods, never scaled (no pre-warm);
* ``reactive``: the HPA's algorithm, run here over the workers' request rate (:mod:`.predict_live_hpa`);
* ``predictive``: the same HPA, with ``spec.pool.predictive.enabled``: the operator forecasts from its
  ``<name>-history`` (seeded with the steps before the segment) and raises the pool to its floor.

By default (``min_warm`` 0) reactive and predictive run **from zero**: ``spec.pool.scaleToZero`` takes the
pool to no pod after ``zero_after_idle_s`` without a request (a trace minute, compressed), the requests that
then find no warm pod are held by the generator and reported as an activator reports them
(:mod:`.predict_live_held`), and the operator brings the pool back; predictive may raise it ahead of a
forecast burst.  The HPA's minimum stays 1, as a real HPA's: zero is the operator's.

Each policy: the WarmModel is created and its first pods warmed; then the same priming for every policy
(sequential completions at half a pod's capacity for ``prime_s``, so every pool has measured its
capacity before the load comes: the operator's predictor and the HPA both need it); the replay starts on
a step boundary, right after the seeded history's last step.  Measured on the pods
(:mod:`.predict_live_pool`): warm capacity, TTFT, pod-seconds, cold starts, ``status.forecast``.  The
offline simulator then replays the same segment with the cold start and service times measured here.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmpool_dev.paths import cache_root
from warmpool_operator.rules.forecast.decision import PredictiveSpec
from warmpool_operator.rules.forecast.forecaster import Forecaster

from warmpool.contract.api import API_GROUP_VERSION
from warmpool_bench.coldstart import find_model, machine_info, request_ids
from warmpool_bench.predict_live_held import HeldReporter
from warmpool_bench.predict_live_hpa import EmulatedHpa
from warmpool_bench.predict_live_load import LoadGenerator, LoadLimits, Outcome, stream_completion
from warmpool_bench.predict_live_pool import PoolWatch
from warmpool_bench.predict_live_segment import Segment, SegmentSpec, cut, per_bin, seed_history
from warmpool_bench.predict_policies import FixedPool, HpaSettings, Predictive, Reactive
from warmpool_bench.predict_sim import PoolConfig, ServiceModel, Simulation
from warmpool_bench.predict_trace import Trace, load_trace
from warmpool_bench.stats import median, percentile

if TYPE_CHECKING:
    from warmpool_bench.predict_live_cluster import LiveCluster

POLICIES = ("fixed", "reactive", "predictive")
#: The emulated HPA's settings: the offline ones, less the metrics pipeline's lag (counters are read at the sync).
HPA = HpaSettings(metrics_lag_s=0.0)
#: Setup and teardown around each policy's replay, for the wall-clock bound (pod start, priming, deletion).
OVERHEAD_S = 120.0


def _log(message: str) -> None:
    print(f"[bench predict --live] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class LiveSettings:
    trace: Path
    segment: SegmentSpec = field(default_factory=SegmentSpec)
    step_s: int = 10
    policies: tuple[str, ...] = POLICIES
    size: str = "small"  # the bench model: small (SmolLM2-135M) or tiny (random weights)
    #: 0: reactive and predictive run from zero (scaleToZero); else minWarm pods kept warm by both
    min_warm: int = 0
    #: scaleToZero.afterIdleSeconds of the pools from zero (None: one trace minute, compressed)
    zero_after_idle_s: int | None = None
    max_replicas: int = 6
    fixed_replicas: int = 3
    prime_s: float = 20.0
    max_wall_s: float = 900.0
    buckets: tuple[int, ...] = (32, 128, 512)
    dtype: str = "bfloat16"
    threads: int = 1
    warm_timeout_s: float = 300.0
    #: a running local real-node cluster to use (default: the run starts one of its own)
    cluster: str | None = None
    work_dir: Path = field(default_factory=lambda: Path(os.environ.get("TMPDIR", "/tmp")) / "warmpool-bench-live")
    cache_root: Path = field(default_factory=cache_root)
    load: LoadLimits = field(default_factory=LoadLimits)

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise ValueError(f"policies must be some of {','.join(POLICIES)}, got {','.join(self.policies)}")
        if not 0 <= self.min_warm <= self.max_replicas or not 1 <= self.fixed_replicas <= self.max_replicas:
            raise ValueError("need 0 <= minWarm <= maxReplicas and 1 <= fixed replicas <= maxReplicas")
        if self.zero_after_idle_s is not None and self.zero_after_idle_s < 1:
            raise ValueError(f"need --zero-after-idle >= 1 second, got {self.zero_after_idle_s}")
        if self.step_s < 1 or self.prime_s < 0:
            raise ValueError("need --predict-step-seconds >= 1 and --prime-seconds >= 0")


def zero_after_idle_s(s: LiveSettings) -> int | None:
    """The pools' scaleToZero.afterIdleSeconds; None when they keep minWarm pods (no scale to zero)."""
    if s.min_warm:
        return None
    return s.zero_after_idle_s or max(1, math.ceil(60 / s.segment.compression))


def first_pods(policy: str, s: LiveSettings) -> int:
    """The pods a policy's pool starts with (a pool from zero starts with one, primed, then idles to zero)."""
    return s.fixed_replicas if policy == "fixed" else max(1, s.min_warm)


def warmmodel(name: str, policy: str, model_dir: Path, s: LiveSettings) -> dict[str, Any]:
    """A WarmModel of the bench model; predictive gets spec.pool.predictive later (after the history seed)."""
    args = ["--device=cpu", f"--dtype={s.dtype}", "--prompts-per-bucket=1", "--decode-tokens=4",
            f"--threads={s.threads}"]
    pool: dict[str, Any] = {"replicas": first_pods(policy, s), "minWarm": s.min_warm,
                            "maxReplicas": s.fixed_replicas if policy == "fixed" else s.max_replicas}
    idle = zero_after_idle_s(s)
    if policy != "fixed" and idle is not None:
        pool["scaleToZero"] = {"afterIdleSeconds": idle}
    return {
        "apiVersion": API_GROUP_VERSION, "kind": "WarmModel",
        "metadata": {"name": name},
        "spec": {
            "model": {"hostPath": {"path": str(model_dir)}, "revision": "r1"},
            "pool": pool,
            "warmup": {"buckets": list(s.buckets), "timeoutSeconds": int(s.warm_timeout_s)},
            "pod": {"workerArgs": args},
        },
    }


def predictive_block(s: LiveSettings) -> dict[str, Any]:
    # horizonSeconds only stands in until the operator has measured a cold start (its first pod's).
    return {"enabled": True, "horizonSeconds": 30, "maxExtraReplicas": s.max_replicas}


def run_live(s: LiveSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    """Results (JSON-ready) and the chart's data.  Trace and segment errors are raised before any cluster."""
    # Imported here, not at the top: every `warmpool bench` command imports this module (its CLI reads
    # POLICIES), and the cluster side and the offline bench bring kopf and the Kubernetes clients (a second).
    from warmpool_bench.predict_live_cluster import LiveCluster

    started = time.time()
    trace = load_trace(s.trace)
    segment = cut(trace, s.segment)
    model = find_model(s.size, s.cache_root, s.work_dir)
    prompt_ids = request_ids(model, s.segment.max_prompt)
    result: dict[str, Any] = {
        "benchmark": "predict-live",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": machine_info(),
        "model": model.label,
        "segment": describe(segment),
        "settings": settings_json(s),
        "mode": "sequential: one policy after another on the same cluster and operator (side by side the "
                "pools would share the CPUs and measure each other)",
        "policies": {},
        "skipped": {},
    }
    chart: dict[str, Any] = {"duration_s": segment.duration_s, "step_s": s.step_s,
                             "arrivals": [r.t for r in segment.requests], "policies": {}}
    cluster = LiveCluster(s.cluster, s.work_dir / "live", s.step_s)
    try:
        model_dir = cluster.start([model.model_dir])[model.model_dir]
        for policy in s.policies:
            left = s.max_wall_s - (time.time() - started)
            needed = segment.duration_s + s.load.drain_s + s.prime_s + OVERHEAD_S
            if left < needed:
                result["skipped"][policy] = f"wall-clock bound: {left:.0f}s left of --max-wall, ~{needed:.0f}s needed"
                _log(f"{policy}: skipped ({result['skipped'][policy]})")
                continue
            figures, timeline = run_policy(cluster, policy, segment, model_dir, prompt_ids, s)
            result["policies"][policy] = figures
            chart["policies"][policy] = timeline
    finally:
        cluster.stop()
    result["offline"] = offline_comparison(segment, result["policies"], s)
    result["targets"] = targets(result["policies"])
    result["wall_s"] = time.time() - started
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    chart["offline"] = result["offline"].pop("timelines", {})
    return result, chart


def describe(segment: Segment) -> dict[str, Any]:
    spec = segment.spec
    times = [r.t for r in segment.requests]
    per_step = per_bin(times, 60 / spec.compression, segment.duration_s)
    return {
        "source": segment.source, "start_min": spec.start_min, "minutes": spec.minutes,
        "compression": spec.compression, "duration_s": segment.duration_s,
        "trace_requests_in_window": segment.window_requests, "thinned_every": segment.thin,
        "requests": len(segment.requests), "seeded_requests_before": len(segment.before),
        "max_prompt": spec.max_prompt, "max_generated": spec.max_generated,
        "prompt_p50": percentile([r.prompt for r in segment.requests], 50),
        "generated_p50": percentile([r.generated for r in segment.requests], 50),
        "requests_per_trace_minute": per_step,
    }


def settings_json(s: LiveSettings) -> dict[str, Any]:
    return {
        "step_s": s.step_s, "policies": list(s.policies), "size": s.size, "min_warm": s.min_warm,
        "zero_after_idle_s": zero_after_idle_s(s), "lull_s": lull_s(s),
        "max_replicas": s.max_replicas, "fixed_replicas": s.fixed_replicas, "prime_s": s.prime_s,
        "max_wall_s": s.max_wall_s, "buckets": list(s.buckets), "dtype": s.dtype, "threads": s.threads,
        "hpa": asdict(HPA), "load": asdict(s.load),
        "dispatch": "each request sent at its arrival to the warm pod with the fewest requests in flight (a "
                    "least-requests balancer; it queues in that worker), so the pods count every arrival",
        "warm_hit": "that pod (warm: worker /readyz 200, polled every 0.5 s) had none of the generator's requests "
                    "in flight, and no request waited in the generator for a warm pod",
        "ttft": "first streamed chunk less the scheduled arrival (queue wait included)",
        "pod_seconds": "each pod from the first pod list that shows it (every 0.5 s) until terminating or gone, "
                       "within the replay's span",
    }


# --- one policy ---------------------------------------------------------------------------------------------


def run_policy(cluster: LiveCluster, policy: str, segment: Segment, model_dir: Path, prompt_ids: Sequence[int],
               s: LiveSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    from warmpool_bench.predict_live_cluster import SCRAPE_INTERVAL_S

    name = f"live-{policy}"
    began = time.time()
    _log(f"{policy}: creating WarmModel {name}")
    body = cluster.create(warmmodel(name, policy, model_dir, s))
    watch = PoolWatch(cluster.core, cluster.custom, cluster.namespace, name)
    watch.start()
    hpa: EmulatedHpa | None = None
    held: HeldReporter | None = None
    try:
        first = first_pods(policy, s)
        cluster.wait_warm(watch, first, s.warm_timeout_s)
        _log(f"{policy}: {first} pod(s) warm after {time.time() - began:.0f}s")
        first_step = math.ceil((time.time() + s.prime_s) / s.step_s)
        seeded = 0
        if policy == "predictive":
            seed = seed_history(segment, s.step_s, first_step)
            seeded = len(seed)
            cluster.seed_history(body, seed)
            cluster.enable_predictive(name, predictive_block(s))
            _log(f"{policy}: history seeded ({len(seed)} steps up to step {seed.end - 1}); prediction on")
        # Priming ends two scrapes before the replay: the operator reads its last requests into the last
        # seeded step (which it already holds, so they are not recorded), never into the replay's first.
        primed = prime(watch, prompt_ids, segment, first_step * s.step_s - 2 * SCRAPE_INTERVAL_S - 1)
        while time.time() < first_step * s.step_s:  # the replay starts on the step boundary
            time.sleep(min(0.05, max(0.0, first_step * s.step_s - time.time())))
        t0 = time.monotonic()
        capacity_at_start = (watch.statuses[-1].forecast.get("capacityPerPod") if watch.statuses else None)
        if policy != "fixed":
            # A real HPA's minimum is 1; a pool from zero goes to zero by the operator's scaleToZero.
            hpa = EmulatedHpa(cluster.custom, watch, cluster.namespace, name, first, s.max_replicas,
                              replicas=first, settings=HPA)
            hpa.start()
            if zero_after_idle_s(s) is not None:
                held = HeldReporter(cluster.custom, cluster.namespace, name)
                held.start()
        _log(f"{policy}: replaying {len(segment.requests)} requests over {segment.duration_s:.0f}s")
        generator = LoadGenerator(segment.requests, prompt_ids, watch.warm_pods, s.load,
                                  held=None if held is None else held.set)
        outcomes = generator.run(t0)
        t_end = time.monotonic()
        if hpa is not None:
            hpa.stop()
        cluster.check_operator()
    finally:
        if held is not None:
            held.stop()
        watch.stop()
    figures = policy_figures(outcomes, watch, t0, segment.duration_s, lull_s(s))
    if held is not None:
        figures["held_writes"], figures["held_errors"] = held.writes, held.errors[-5:]
    figures.update({"dropped": generator.dropped, "generator_late_s": generator.late_s, "primed": primed,
                    "capacity_per_pod_at_start": capacity_at_start, "replay_wall_s": t_end - t0,
                    "watch_errors": watch.errors[-5:]})
    if hpa is not None:
        figures["hpa_decisions"] = [{"t": d.t - t0, "rate_rps": d.rate_rps, "capacity_rps": d.capacity_rps,
                                     "recommendation": d.recommendation, "replicas": d.replicas}
                                    for d in hpa.decisions]
        figures["hpa_errors"] = hpa.errors[-5:]
    forecasts = [{"t": x.t - t0, "spec_replicas": x.spec_replicas, "status_replicas": x.status_replicas,
                  **{k: x.forecast.get(k) for k in ("rateNow", "predictedRate", "predictedRateP50", "model",
                                                    "desiredReplicas", "capacityPerPod", "horizonSeconds",
                                                    "historySteps")}}
                 for x in watch.statuses if x.t >= t0 - 1]
    if policy == "predictive":
        figures["forecast_samples"] = forecasts
        figures["seeded_steps"] = seeded
    timeline = {"pods": [(t - t0, alive, warm) for t, alive, warm in watch.counts if t >= t0 - 1],
                "forecast": [(f["t"], f["predictedRate"]) for f in forecasts if f["predictedRate"] is not None],
                "wall_s": time.time() - began}
    _log(f"{policy}: {figures['no_warm_capacity']} of {figures['requests']} without warm capacity, "
         f"TTFT p50/p95 {figures['ttft_p50_s']}/{figures['ttft_p95_s']}, {figures['pod_seconds']:.0f} pod-s")
    cluster.delete(name)
    figures["wall_s"] = time.time() - began
    return figures, timeline


def prime(watch: PoolWatch, prompt_ids: Sequence[int], segment: Segment, until_wall: float) -> int:
    """Sequential completions, each followed by as long again of quiet (half a pod's capacity), until
    ``until_wall``: the pool's capacity is measured before the load comes.  Returns how many."""
    prompt = int(percentile([r.prompt for r in segment.requests], 50) or 1)
    body: dict[str, object] = {"prompt": list(prompt_ids[:prompt]), "max_tokens": segment.spec.max_generated,
                               "temperature": 0, "stream": True}
    sent = 0
    while time.time() < until_wall and sent < 1000:
        pods = sorted(watch.warm_pods().items())
        if not pods:
            time.sleep(0.5)
            continue
        _, ip = pods[sent % len(pods)]
        began = time.monotonic()
        try:
            stream_completion(ip, body, 60.0, lambda: None)
            sent += 1
        except Exception as error:  # a pod going away while priming: the next one is tried
            _log(f"priming request failed: {type(error).__name__}: {error}")
        time.sleep(min(max(0.0, until_wall - time.time()), time.monotonic() - began))
    return sent


def lull_s(s: LiveSettings) -> float:
    """A lull: no arrival for a trace minute (the offline bench's LULL_S), compressed as the replay is."""
    from warmpool_bench.predict import LULL_S  # here: the offline bench brings numpy and the forecasters

    return LULL_S / s.segment.compression


def first_after_lull(outcomes: Sequence[Outcome], lull: float) -> list[float]:
    """TTFTs of the requests served that arrived after ``lull`` seconds without an arrival (the first one too)."""
    by_arrival = sorted(outcomes, key=lambda o: o.arrival)
    return [o.ttft_s for i, o in enumerate(by_arrival)
            if (i == 0 or o.arrival - by_arrival[i - 1].arrival >= lull) and o.error is None and o.ttft_s is not None]


def policy_figures(outcomes: Sequence[Outcome], watch: PoolWatch, t0: float, duration_s: float,
                   lull: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None and o.ttft_s is not None]
    after_lull = first_after_lull(outcomes, lull)
    missed = sum(not o.warm_hit for o in outcomes)
    ttfts = [o.ttft_s for o in ok]
    hits = [o for o in ok if o.warm_hit and o.prefill_s]
    decode = [(o.chunks - 1) / o.decode_s for o in ok if o.chunks > 1 and o.decode_s]
    new = [p for p in watch.pods.values() if p.seen_at >= t0]
    colds = [p.cold_start_s for p in watch.pods.values() if p.cold_start_s is not None]
    return {
        "requests": len(outcomes),
        "served": len(ok),
        "errors": sum(o.error is not None for o in outcomes),
        "error_examples": sorted({str(o.error) for o in outcomes if o.error})[:3],
        "no_warm_capacity": missed,
        "no_warm_capacity_share": missed / len(outcomes) if outcomes else None,
        "warm_hit_rate": 1 - missed / len(outcomes) if outcomes else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "ttft_p99_s": percentile(ttfts, 99),
        "first_request_count": len(after_lull),
        "first_request_p95_s": percentile(after_lull, 95),
        "pod_seconds": watch.pod_seconds(t0, t0 + duration_s),
        "pod_hours": watch.pod_seconds(t0, t0 + duration_s) / 3600,
        "pods_started": len(new),
        "max_pods": max((alive for t, alive, _ in watch.counts if t >= t0), default=0),
        "cold_starts_s": colds,
        "cold_start_median_s": median(colds),
        "cold_start_p95_s": percentile(colds, 95),
        # the pods' service speed, for the offline replay of the same segment
        "prefill_tokens_per_s": median([o.prompt / o.prefill_s for o in hits if o.prefill_s]),
        "decode_tokens_per_s": median(decode),
    }


# --- the offline simulator on the same segment --------------------------------------------------------------


def offline_comparison(segment: Segment, live: dict[str, dict[str, Any]], s: LiveSettings) -> dict[str, Any]:
    """The same segment through :mod:`.predict_sim`, with the cold start and service speeds measured live."""
    from warmpool_operator.control.forecasting import forecaster_config

    from warmpool_bench.predict import figures as offline_figures

    colds = [c for figures in live.values() for c in figures["cold_starts_s"]]
    prefill = median([f["prefill_tokens_per_s"] for f in live.values() if f["prefill_tokens_per_s"]])
    decode = median([f["decode_tokens_per_s"] for f in live.values() if f["decode_tokens_per_s"]])
    if not colds or not prefill or not decode:
        return {"error": "nothing measured live to replay with (no pod warmed or no request served)"}
    cold, lead = float(median(colds) or 0.0), float(percentile(colds, 95) or 0.0)
    # One request at a time per simulated pod: the decode speed measured live is per stream, at whatever
    # batch the real pods ran, so no batch speed-up is applied on top of it.
    service = ServiceModel(prefill, decode)
    trace = Trace(segment.source, 0.0, segment.requests)
    first_step = 1_000_000  # any step boundary: the seed ends right before it, the replay starts on it
    out: dict[str, Any] = {"cold_start_s": cold, "lead_s": lead, "prefill_tokens_per_s": prefill,
                           "decode_tokens_per_s": decode, "policies": {}, "timelines": {}}
    for policy in s.policies:
        pool = PoolConfig(min_warm=s.min_warm, max_replicas=s.max_replicas, cold_start_s=cold)  # 0: from zero
        controller: FixedPool | Reactive | Predictive
        if policy == "fixed":
            pool = PoolConfig(s.fixed_replicas, s.fixed_replicas, cold)
            controller = FixedPool(s.fixed_replicas)
        elif policy == "reactive":
            controller = Reactive(HPA)
        else:
            controller = Predictive(Reactive(HPA), Forecaster(forecaster_config(s.step_s)),
                                    PredictiveSpec(enabled=True, horizon_seconds=30, max_extra_replicas=s.max_replicas),
                                    trace.requests, first_step * s.step_s, lead_s=lead,
                                    history=seed_history(segment, s.step_s, first_step))
        sim = Simulation(trace.requests, service, pool, controller)
        sim.run(segment.duration_s)
        figures = offline_figures(sim, segment.duration_s)
        figures["pod_seconds"] = figures["pod_hours"] * 3600
        out["policies"][policy] = figures
        out["timelines"][policy] = sim.pod_timeline
    return out


def targets(live: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The offline bench's targets (:func:`.predict.targets`) on the live figures; empty unless all three ran."""
    from warmpool_bench.predict import targets as predict_targets

    if not {"fixed", "reactive", "predictive"} <= set(live):
        return {}
    scenario = {"policies": live, "cold_start_s": live["predictive"]["cold_start_median_s"]}
    return predict_targets(scenario, "predictive", "reactive", "fixed")
