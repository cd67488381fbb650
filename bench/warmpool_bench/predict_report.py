"""`warmpool bench predict`'s Markdown (pure: the results dict in, a string out) and its PNG chart."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from warmpool_bench.report import fmt, fmt_pct

CHART_POLICIES = ("fixed", "reactive", "predictive:auto", "predictive60:auto")

LIMITS_OF_ONE_HOUR = (
    "One hour at the trace's own step (chosen from its bursts, below) is hundreds of forecast steps, so "
    "LightGBM trains early; at the last round's 60 s steps (`predictive60:auto`) it is 57 steps, and "
    "LightGBM trains only in the last quarter of the hour.",
    "A first request after a lull (no arrival for 60 s) follows a spell the history records as zeros: no "
    "forecaster that reads only this history can see it coming, so from zero it waits for a cold start "
    "under every scaled policy.  Only seasonality (a day ago, a week ago) could; one hour has none.",
    "No time-of-day or day-of-week feature can be learned (they need 2 and 14 days of history), and "
    "seasonal naive (a day ago) never has a value: it runs as its fallback (last value) throughout.",
    "The trace's load moves in sub-minute bursts (33 req/s over its busiest 10 s against 10.5 over its "
    "busiest minute, idle minutes between them).  Each step records its peak (its busiest 10 s, or the "
    "step itself when shorter, scaled to the step) and the forecaster forecasts that.",
    "What it can show: each policy's behaviour on real arrival shapes and prompt lengths, the cost of "
    "the forecaster, and the prompt-length mix the warm-up buckets should follow.",
)

READING = (
    "Reading the figures: *no warm capacity* = the request found every warm pod busy (or none warm) and "
    "had to queue; *warm-hit* = the rest (served at once by a warm pod).  *TTFT* = queue wait + prefill.  "
    "*First request* = the first request after a lull (no arrival in the 60 s before it; `n` = how many): "
    "what pre-warming is for, and defined the same for every policy (a fixed pool starts no pods).  *New "
    "pod's first* = the first request each pod started during the replay served.  *Pod-hours held* count "
    "every pod that holds an accelerator, from the moment it was asked for (cold start included) to its "
    "stop, asleep or awake: in a wake scenario a pod scaled down sleeps (and is woken first) and is held "
    "asleep until the end; *awake* counts only the pods awake.  *Memory GiB-h*: the accelerator memory they "
    "hold, awake and asleep, as measured for one worker on this machine.  *Forecast error*: the forecasts "
    "the policy acted on (every horizon of every step) against the peak each target step then had, in req/s: "
    "p50's mean absolute error, and how often the p90 covered it.",
)


def render_predict(result: Mapping[str, Any]) -> str:
    trace, settings, machine = result["trace"], result["settings"], result["machine"]
    out = [
        "# warmpool bench predict",
        "",
        f"Started {result['started_at']}; {machine.get('cpus')} CPUs ({machine.get('cpu', '?')}); "
        f"wall {fmt(result.get('wall_s'), ' s', 0)}; load average (1/5/15 min) {_load(machine.get('loadavg'))} at "
        f"the start, {_load(machine.get('loadavg_end'))} at the end (a shared machine; the replay is simulated "
        "time, so only the CPU-cost figures move with it; the forecaster runs one thread).  Offline replay (no "
        "pods ran).",
        "",
        f"Trace: `{trace['source']}`, {trace['requests']} requests over {fmt(trace['duration_s'], ' s', 0)} "
        f"from {trace['start_utc']}; mean {fmt(trace['mean_rps'])} req/s, busiest minute "
        f"{fmt(trace['peak_minute_rps'])} req/s, busiest 10 s {fmt(trace['peak_10s_rps'])} req/s, "
        f"{trace['idle_minutes']} idle minutes; prompt p50/p90/p99 {fmt(trace['prompt_p50'], digits=0)}/"
        f"{fmt(trace['prompt_p90'], digits=0)}/{fmt(trace['prompt_p99'], digits=0)} tokens.",
    ]
    if trace.get("repeat", 1) > 1:
        out += ["", f"**The trace was repeated {trace['repeat']} times back to back** (`--repeat`): the "
                "history is longer but perfectly periodic, which flatters every forecaster."]
    out += ["", "## What a one-hour trace can and cannot show", ""] + [f"- {line}" for line in LIMITS_OF_ONE_HOUR]
    out += ["", "## Model and settings", "", *_settings_lines(settings)]
    primary = result["scenarios"][0]
    for index, scenario in enumerate(result["scenarios"]):
        if scenario.get("wake_s") is not None:
            heading = (f"pods scaled down sleep (still held); a woken pod serves {fmt(scenario['wake_s'])} s after "
                       f"it is asked for (lead time {fmt(scenario['lead_s'])} s), a new one "
                       f"{fmt(scenario['cold_start_s'])} s")
        else:
            heading = (f"added capacity serves {fmt(scenario['cold_start_s'])} s after it is asked for (lead time "
                       f"{fmt(scenario['lead_s'])} s)")
        out += ["", f"## Results: {scenario['label']}: {heading}", "",
                f"Source: {scenario['source']}.", ""]
        out += policy_table(scenario["policies"])
        if index == 0:
            out += ["", *READING]
            capped = primary.get("predictive_auto_capped")
            if capped:
                out += ["", f"Same replay, predictive:auto with the library's default `maxExtraReplicas: "
                        f"{capped['max_extra_replicas']}`: {capped['no_warm_capacity']} requests without warm "
                        f"capacity ({fmt_pct(capped['no_warm_capacity_share'])}), TTFT p95 "
                        f"{fmt(capped['ttft_p95_s'])} s, {fmt(capped['pod_hours'])} pod-hours."]
        out += ["", f"Targets ({scenario['targets']['policy']} against reactive from zero and the fixed "
                f"pool; its warm hits are {fmt_pct(scenario['targets'].get('warm_hit_share_of_fixed'))} of the "
                "fixed pool's):", ""]
        out += target_table(scenario["targets"])
        out += ["", never_empty_line(scenario["targets"])]
    out += ["", f"## Forecast quality over the replay (predictive:auto's candidates, {settings['step_s']} s steps)", ""]
    out += quality_table(result["forecast_quality"])
    out += ["", "## Learned warm-up buckets", "", *bucket_lines(result["buckets"])]
    out += ["", "## Forecaster cost", "", *cost_lines(result["forecaster_cost"])]
    if result.get("chart"):
        out += ["", f"![request rate, forecast band and warm pods per policy]({result['chart']})"]
    out.append("")
    return "\n".join(out)


def _speedups(speedups: list[float]) -> str:
    shown = [size for size in (1, 2, 4, 8, 12, 16) if size <= len(speedups)]
    return ", ".join(f"{speedups[size - 1]:.2f}x at {size}" for size in shown)


def _settings_lines(s: Mapping[str, Any]) -> list[str]:
    hpa, fast = s["hpa"], s["fast_loop"]
    return [
        f"- Service model: up to {s['requests_per_pod']} requests at a time per pod (the built-in engine's "
        f"continuous batch); prefill {fmt(s['prefill_tokens_per_s'], digits=0)} tokens/s ({s['prefill_source']}); "
        f"decode {fmt(s['decode_tokens_per_s'], digits=0)} tokens/s for a request alone, and a batch's aggregate "
        f"{_speedups(s.get('batch_speedups') or [1.0])} ({s['decode_source']}); TTFT = queue wait + prefill "
        "(see `predict_sim.py`).",
        *(f"- Scenario *{u['label']}*: added capacity serves after {fmt(u['start_s'])} s (median), the "
          f"predictive policy plans {fmt(u['lead_s'])} s ahead (p95): {u['source']}." for u in s["scale_ups"]),
        f"- Pool: maxReplicas {s['max_replicas']}; every scaled policy starts from zero (minWarm 0: a request "
        "that finds no pod is held and the pool raised to one pod, as the activator does) except the "
        f"`@minwarm{max(1, s['min_warm'])}` ones.  Capacity the policies use is measured from the simulated pods' "
        "throughput, and kept over idle spells (as the operator's meter keeps it).",
        f"- Forecast step **{s['step_s']} s**, chosen from the trace: {s['step']['reason']}.  Horizons (steps "
        f"ahead) {s['horizon_steps']}: those covering one p95 cold start ({fmt(s['scale_ups'][0]['lead_s'])} s) "
        "and a step beyond.",
        f"- fixed (no pre-warm, no autoscaler): a fixed pool of {s['fixed_replicas_used']} warm pods "
        "(no autoscaler, no forecast), sized for the trace's busiest minute: ⌈the most service seconds arriving "
        "in one minute ÷ 60 ÷ a full batch's speed-up⌉"
        + (" (set by --fixed-replicas)" if s.get("fixed_replicas") is not None else "")
        + f".  fixed@mean: the same, sized for the average load (⌈total service seconds ÷ duration ÷ the speed-up⌉ = "
        f"{s['fixed_replicas_mean']} pods).",
        f"- reactive (HPA): sync {fmt(hpa['sync_s'], digits=0)} s, rate over {fmt(hpa['window_s'], digits=0)} s "
        f"read {fmt(hpa['metrics_lag_s'], digits=0)} s late, tolerance {hpa['tolerance']}, scale-down "
        f"stabilisation {fmt(hpa['scale_down_stabilisation_s'], digits=0)} s, scale-up ≤ max(x"
        f"{hpa['scale_up_factor']:g}, +{hpa['scale_up_pods']}) per sync.",
        f"- predictive: every {fmt(fast['tick_s'], digits=0)} s, the larger of the forecast's count (⌈forecast peak "
        f"p90 ÷ capacity⌉ for the {s['step_s']} s steps one lead time ahead, maxExtraReplicas "
        f"{s['max_extra_replicas']}) and a fast reactive loop's (⌈requests in flight or held ÷ a pod's batch⌉, "
        f"⌈arrivals over the last {fmt(fast['window_s'], digits=0)} s ÷ capacity⌉); it scales down to the highest "
        "ask of the last lead time and step, so pods go between bursts.  LightGBM retrained every "
        f"{s['retrain_every_steps']} steps.  `predictive:<name>` uses one forecaster (its fallback, last value, "
        "until it can forecast); `auto` uses the best recent performer.  `predictive60:auto`: the last round's "
        "policy (60 s steps, the forecast as a floor under the HPA above).",
    ]


def policy_table(policies: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = ["| policy | no warm capacity | warm-hit | TTFT p50 s | TTFT p95 s | first request p95 s (n) "
             "| new pod's first p95 s (n) | pod-hours held (awake) | memory GiB-h | pods started "
             "| forecast error: p50 MAE req/s, p90 covered (n) | forecaster used (steps) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, p in policies.items():
        used = ", ".join(f"{k} {v}" for k, v in sorted(p.get("models_used", {}).items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {name} | {p['no_warm_capacity']} ({fmt_pct(p['no_warm_capacity_share'])}) "
            f"| {fmt_pct(p['warm_hit_rate'])} | {fmt(p['ttft_p50_s'])} | {fmt(p['ttft_p95_s'])} "
            f"| {fmt(p['first_request_p95_s'])} ({p['first_request_count']}) "
            f"| {fmt(p['new_pod_first_p95_s'])} ({p['new_pod_first_count']}) | {fmt(p['pod_hours'])} "
            f"({fmt(p.get('awake_pod_hours'))}) | {fmt(p.get('memory_gib_hours'))} "
            f"| {p['pods_started']} | {_error(p.get('forecast_error'))} | {used or '-'} |")
    return lines


def _error(error: Mapping[str, Any] | None) -> str:
    if not error or not error.get("pairs"):
        return "-"
    return (f"{fmt(error['p50_mae_rps'])}, {fmt_pct(error['p90_coverage'])} ({error['pairs']}; actual mean "
            f"{fmt(error['actual_mean_rps'])})")


def _load(values: Sequence[float] | None) -> str:
    return "/".join(f"{v:.1f}" for v in values) if values else "-"


def _target_value(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    if key.startswith("warm_hit_points"):
        return f"{value:+.1f} points"
    if "ratio" in key:
        return f"{value:.2f}"
    return f"{100 * value:.0f} % lower" if value >= 0 else f"{-100 * value:.0f} % higher"


def target_table(t: Mapping[str, Any]) -> list[str]:
    lines = ["| target | measured | |", "|---|---:|---|"]
    for key, v in t["figures"].items():
        lines.append(f"| {v['target']} | {_target_value(key, v['value'])} | {'met' if v['met'] else '**missed**'} |")
    return lines


def never_empty_line(t: Mapping[str, Any]) -> str:
    """What bounds the first-request target: a pool that is never empty still prefills the request."""
    bound = t.get("first_request_never_empty_reduction")
    return (f"What bounds the first-request target: the fixed pool, never empty, has its first request after a "
            f"lull {fmt_pct(bound)} lower than reactive-from-zero's (P95).  That is about what pre-warming can gain "
            "on this figure: the rest of the P95 is the request's own queue and prefill on a warm pod.")


def quality_table(quality: Mapping[str, Any]) -> list[str]:
    lines = ["| candidate | forecasts | common steps | mean quantile loss | p50 MAE (req/step) | p90 covered |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, q in quality.get("per_candidate", {}).items():
        lines.append(f"| {name} | {q['forecasts']} | {q['common_steps']} | {fmt(q['mean_quantile_loss'], digits=1)} "
                     f"| {fmt(q['p50_mae'], digits=1)} | {fmt_pct(q['p90_coverage'])} |")
    return [*lines, "", str(quality.get("note", ""))]


def bucket_lines(b: Mapping[str, Any]) -> list[str]:
    held = b["held_out"]
    per = ", ".join(f"{bucket}: {n}" for bucket, n in zip(b["learned"], b["learned_prompts_per_bucket"],
                                                            strict=True))
    return [
        f"Learned from the trace's prompt-length histogram (p50/p90/p99 rounded up to graph sizes, within a "
        f"{b['max_context']}-token context): **{b['learned']}** (prompts per bucket {per}; "
        f"{b['learned_longer_than_all']} longer than all).",
        "",
        "| buckets | share of prompts within a warmed length | held out: learned on the first half, "
        "scored on the second |",
        "|---|---:|---:|",
        f"| defaults {b['defaults']} | {fmt_pct(b['share_within_defaults'])} "
        f"| {fmt_pct(held['share_within_defaults_second_half'])} |",
        f"| learned {b['learned']} | {fmt_pct(b['share_within_learned'])} "
        f"| {fmt_pct(held['share_within_learned_second_half'])} (learned {held['learned_on_first_half']}) |",
        "",
        str(b["note"]) + ".",
    ]


def cost_lines(c: Mapping[str, Any]) -> list[str]:
    full = c["full_history"]
    return [
        f"- On the replay: {fmt(c['on_trace_cpu_s_per_model_hour'], digits=3)} CPU s per WarmModel-hour "
        f"({c['on_trace_note']}).",
        f"- With a full history ({full['steps']} fine steps, {full.get('coarse_steps', 0)} coarse ones, "
        f"{len(full['features'])} features): one training "
        f"{fmt(full['train_cpu_s'], digits=3)} CPU s (every {full['retrain_every_steps']} steps), one forecast "
        f"{fmt(1000 * full['predict_cpu_s'], digits=1)} CPU ms (every step): "
        f"{fmt(full['cpu_s_per_hour'], digits=2)} CPU s per WarmModel-hour; {full['note']}.",
        f"- **{fmt(c['percent_of_one_core_per_100_models'], digits=2)} % of one core per 100 WarmModels** "
        f"(target: {c['target']}: {'met' if c['met'] else '**missed**'}).  Training and forecasting only: "
        "recording a step and the operator's own reconcile are not in it.",
    ]


def draw_chart(chart: Mapping[str, Any], path: Path, policies: Sequence[str] = CHART_POLICIES) -> None:
    """Request rate, forecast band and warm pods over time, one panel per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    times = np.asarray(chart["times"], dtype=float)
    end = float(times.max()) if len(times) else 0.0
    bins10 = np.arange(0, end + 10, 10)
    rate10, _ = np.histogram(times, bins=bins10)
    bins60 = np.arange(0, end + 60, 60)
    rate60, _ = np.histogram(times, bins=bins60)
    shown = [p for p in policies if p in chart["timelines"]]
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 2.6 * len(shown)), sharex=True, squeeze=False)
    for ax, policy in zip(axes[:, 0], shown, strict=True):
        ax.plot(bins10[:-1] / 60, rate10 / 10, color="0.75", lw=0.8, drawstyle="steps-post", label="req/s (10 s)")
        ax.plot(bins60[:-1] / 60, rate60 / 60, color="black", lw=1.2, drawstyle="steps-post", label="req/s (60 s)")
        forecasts = chart["forecasts"].get(policy, [])
        if forecasts:
            starts = np.array([f["step_start"] for f in forecasts]) / 60
            ax.fill_between(starts, [f["p50"] for f in forecasts], [f["p90"] for f in forecasts], step="post",
                            color="tab:blue", alpha=0.3, label="forecast p50-p90 (req/s)")
        ax.set_ylabel("req/s")
        pods = ax.twinx()
        timeline = np.array(chart["timelines"][policy], dtype=float)
        if len(timeline):
            t = np.append(timeline[:, 0], end) / 60
            pods.plot(t, np.append(timeline[:, 1], timeline[-1, 1]), color="tab:green", drawstyle="steps-post",
                      lw=1.2, label="warm pods")
            pods.plot(t, np.append(timeline[:, 2], timeline[-1, 2]), color="tab:orange", drawstyle="steps-post",
                      lw=0.9, ls="--", label="pods asked for")
        pods.set_ylabel("pods")
        ax.set_title(policy, loc="left", fontsize=10)
        handles = ax.get_legend_handles_labels()[0] + pods.get_legend_handles_labels()[0]
        labels = ax.get_legend_handles_labels()[1] + pods.get_legend_handles_labels()[1]
        ax.legend(handles, labels, loc="upper right", fontsize=7, ncol=5)
    axes[-1, 0].set_xlabel(f"minutes into the trace (added capacity serves after {chart['cold_start_s']:.3g} s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
