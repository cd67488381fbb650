"""`warmpool bench predict --live`'s Markdown (pure: the results dict in, a string out) and its PNG chart."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from warmpool_bench.predict_report import never_empty_line, target_table
from warmpool_bench.report import fmt, fmt_pct

ROWS = (
    ("requests", "requests replayed", "int"),
    ("no_warm_capacity", "requests without warm capacity", "int"),
    ("warm_hit_rate", "warm-hit rate", "pct"),
    ("ttft_p50_s", "TTFT p50 s", "s"),
    ("ttft_p95_s", "TTFT p95 s", "s"),
    ("pod_seconds", "pod-seconds", "int"),
    ("max_pods", "most pods", "int"),
    ("pods_started", "pods started during the replay", "int"),
)


def _cell(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return fmt_pct(value)
    if kind == "int":
        return f"{value:,.0f}"
    return fmt(value, digits=2)


def _target_lines(targets: Mapping[str, Any]) -> list[str]:
    """The offline bench's targets table on the live figures; a result of an older run (before the pools ran
    from zero) has one line per target of its own."""
    if not targets:
        return ["- not computable: the fixed, reactive and predictive pools must all run"]
    if "figures" in targets:
        return [*target_table(targets), "", never_empty_line(targets)]
    lines = []
    for name, target in targets.items():
        if target["value"] is None:
            lines.append(f"- {target['target']}: not computable (reactive had no request without warm capacity)")
            continue
        verdict = "met" if target["met"] else "**missed**"
        value = (fmt_pct(target["value"]) if "points" not in name else f"{target['value']:+.1f} points")
        lines.append(f"- {target['target']}: {value}: {verdict}")
    return lines


def _pools_from(s: Mapping[str, Any]) -> str:
    idle = s.get("zero_after_idle_s")
    if idle is None:
        return f"from minWarm {s['min_warm']}"
    return (f"**from zero** (`scaleToZero.afterIdleSeconds: {idle}`, the HPA's minimum 1: the operator takes the "
            "pool to no pod after that long without a request; a request that then finds no warm pod is held by "
            "the generator and reported on the WarmModel as an activator reports it, and the operator brings the "
            "pool back)")


def render_live(result: Mapping[str, Any]) -> str:
    seg, s, machine = result["segment"], result["settings"], result["machine"]
    live, offline = result["policies"], result.get("offline", {})
    out = [
        "# warmpool bench predict --live",
        "",
        f"Started {result['started_at']}; {machine.get('cpus')} CPUs; wall {fmt(result.get('wall_s'), ' s', 0)}; "
        f"load average {machine.get('loadavg')} at the start, {machine.get('loadavg_end')} at the end (a shared "
        f"machine).  Model: {result['model']}.  Policies run {result['mode']}.",
        "",
        f"Segment: `{seg['source']}` minutes {seg['start_min']:g}-{seg['start_min'] + seg['minutes']:g}: "
        f"{seg['trace_requests_in_window']} requests in the trace, **every {seg['thinned_every']}th kept** "
        f"({seg['requests']} replayed per policy), **time compressed {seg['compression']:g}x** "
        f"({fmt(seg['duration_s'], ' s', 0)} of replay; a trace minute lasts {60 / seg['compression']:g} s, "
        f"operator step {s['step_s']} s), prompts capped at {seg['max_prompt']} tokens (p50 "
        f"{fmt(seg['prompt_p50'], digits=0)}) and generation at {seg['max_generated']}.  Requests per trace "
        f"minute: {seg['requests_per_trace_minute']}.  The predictive pool's history was seeded with the "
        f"{seg['seeded_requests_before']} (thinned) requests before the segment.",
        "",
        f"Pools: fixed = {s['fixed_replicas']} pods; reactive and predictive {_pools_from(s)} up to "
        f"{s['max_replicas']}, under the HPA's algorithm run by the bench (sync {s['hpa']['sync_s']:g} s, window "
        f"{s['hpa']['window_s']:g} s of the workers' request rate, tolerance {s['hpa']['tolerance']:g}, scale-down "
        f"stabilisation {s['hpa']['scale_down_stabilisation_s']:g} s, target = the workers' measured capacity).  "
        f"Each pool was primed for {s['prime_s']:g} s (sequential requests at half a pod's capacity) before the "
        "replay, so the capacity was measured when the load came.",
        "",
        f"Definitions: {s['dispatch']}.  *Warm hit*: {s['warm_hit']}; everything else found *no warm capacity* "
        "(it queued).  "
        f"*TTFT* = {s['ttft']}.  *Pod-seconds*: {s['pod_seconds']}.",
        "",
        "## Live (real pods)",
        "",
        "| figure | " + " | ".join(live) + " |",
        "|---|" + "---:|" * len(live),
    ]
    for key, label, kind in ROWS:
        out.append(f"| {label} | " + " | ".join(_cell(f.get(key), kind) for f in live.values()) + " |")
    if any("first_request_p95_s" in f for f in live.values()):
        out.append(f"| first request after a lull ({fmt(s.get('lull_s'), ' s', 0)} without an arrival), TTFT p95 s "
                   "(n) | " + " | ".join(f"{_cell(f.get('first_request_p95_s'), 's')} ({f.get('first_request_count')})"
                                         for f in live.values()) + " |")
    out.append("| errors / dropped | " + " | ".join(f"{f['errors']} / {f['dropped']}" for f in live.values()) + " |")
    out.append("| cold start median / p95 s | " + " | ".join(
        f"{_cell(f['cold_start_median_s'], 's')} / {_cell(f['cold_start_p95_s'], 's')} ({len(f['cold_starts_s'])})"
        for f in live.values()) + " |")
    out.append("| replay wall s (generator late at most s) | " + " | ".join(
        f"{_cell(f['replay_wall_s'], 's')} ({_cell(f['generator_late_s'], 's')})" for f in live.values()) + " |")
    for policy, why in (result.get("skipped") or {}).items():
        out.append(f"\n**{policy} skipped**: {why}")
    reactive = "reactive from zero" if s.get("zero_after_idle_s") is not None else "reactive"
    out += ["", f"## Targets (predictive against {reactive} and the fixed pool, live figures)", ""]
    out += _target_lines(result.get("targets") or {})
    pred = live.get("predictive")
    if pred is not None:
        samples = [x for x in pred.get("forecast_samples", []) if x.get("predictedRate") is not None]
        models = sorted({str(x.get("model")) for x in samples})
        peak = max((x["predictedRate"] for x in samples), default=None)
        desired = max((x.get("desiredReplicas") or 0 for x in samples), default=None)
        out += ["", "## `status.forecast` of the predictive pool", "",
                f"{len(pred.get('forecast_samples', []))} samples (every 2 s); {len(samples)} with a forecast; "
                f"models {models}; highest predicted rate {fmt(peak)} req/s; most desired replicas {desired}; "
                f"capacity per pod when the replay began {fmt(pred.get('capacity_per_pod_at_start'))} req/s."]
    if offline.get("policies"):
        out += ["", "## Offline simulator on the same segment", "",
                f"`predict_sim` with what was measured live: cold start {fmt(offline['cold_start_s'], ' s')} "
                f"(median; lead time {fmt(offline['lead_s'], ' s')}, the p95), prefill "
                f"{fmt(offline['prefill_tokens_per_s'], digits=0)} tokens/s (warm hits' time to first chunk), "
                f"decode {fmt(offline['decode_tokens_per_s'], digits=1)} tokens/s (the streams' chunk rate).", "",
                "| figure | " + " | ".join(f"{p} live | {p} offline" for p in offline["policies"]) + " |",
                "|---|" + "---:|" * (2 * len(offline["policies"]))]
        for key, label, kind in ROWS[1:6]:
            cells = []
            for policy, sim in offline["policies"].items():
                cells += [_cell(live.get(policy, {}).get(key), kind), _cell(sim.get(key), kind)]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    elif offline.get("error"):
        out += ["", f"Offline comparison not run: {offline['error']}"]
    if result.get("chart"):
        out += ["", f"![request rate, forecast and warm pods per policy]({result['chart']})"]
    return "\n".join(out) + "\n"


def draw_live_chart(chart: Mapping[str, Any], path: Path) -> None:
    """Per policy: request rate (per step), the forecast (predicted rate), warm pods live and offline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    duration, step = float(chart["duration_s"]), float(chart["step_s"])
    bins = np.arange(0, duration + step, step)
    rate, _ = np.histogram(np.asarray(chart["arrivals"], dtype=float), bins=bins)
    shown = list(chart["policies"])
    fig, axes = plt.subplots(max(1, len(shown)), 1, figsize=(11, 2.8 * max(1, len(shown))), sharex=True,
                             squeeze=False)
    for ax, policy in zip(axes[:, 0], shown, strict=False):
        data = chart["policies"][policy]
        ax.plot(bins[:-1], rate / step, color="black", lw=1.2, drawstyle="steps-post", label=f"req/s ({step:g} s)")
        forecast = np.array(data.get("forecast") or [], dtype=float)
        if len(forecast):
            ax.plot(forecast[:, 0], forecast[:, 1], color="tab:blue", lw=1.2, drawstyle="steps-post",
                    label="status.forecast p90 req/s (one lead time ahead)")
        ax.set_ylabel("req/s")
        pods = ax.twinx()
        live = np.array(data.get("pods") or [], dtype=float)
        if len(live):
            pods.plot(live[:, 0], live[:, 2], color="tab:green", drawstyle="steps-post", lw=1.4, label="warm pods")
            pods.plot(live[:, 0], live[:, 1], color="tab:orange", drawstyle="steps-post", lw=0.9, ls="--",
                      label="pods")
        sim = np.array((chart.get("offline") or {}).get(policy) or [], dtype=float)
        if len(sim):
            pods.plot(np.append(sim[:, 0], duration), np.append(sim[:, 1], sim[-1, 1]), color="tab:green", lw=0.9,
                      ls=":", drawstyle="steps-post", label="warm pods (offline sim)")
        most = max([*(live[:, 1].tolist() if len(live) else []), *(sim[:, 2].tolist() if len(sim) else []), 1.0])
        pods.set_ylim(0, most + 1)
        pods.set_ylabel("pods")
        ax.set_ylim(bottom=0)
        ax.set_title(policy, loc="left", fontsize=10)
        handles = ax.get_legend_handles_labels()[0] + pods.get_legend_handles_labels()[0]
        labels = ax.get_legend_handles_labels()[1] + pods.get_legend_handles_labels()[1]
        ax.legend(handles, labels, loc="upper right", fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("seconds into the replay (compressed time)")
    axes[-1, 0].set_xlim(-2, duration + 30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
