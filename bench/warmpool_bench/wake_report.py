"""Markdown tables of `warmpool bench wake` (pure: the results dict in, a string out)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from warmpool_bench.report import fmt, fmt_mib, fmt_pct

VARIANT_LABELS: dict[str, str] = {
    "wake_l1": "wake, level 1 (POST /control/wake)",
    "wake_l2": "wake, level 2 (POST /control/wake)",
    "request_wake_l1": "wake by the request, level 1",
    "request_wake_l2": "wake by the request, level 2",
    "copies_wake_l1": "wake, level 1, float32 copies",
    "copies_wake_l2": "wake, level 2, float32 copies",
    "fresh_process": "fresh process (start -> ready -> token)",
    "new_pod": "new pod (scale 0 -> 1 -> token)",
}


def _ms(value: float | None) -> str:
    return fmt(None if value is None else value * 1000, digits=0)


def timing_table(model: Mapping[str, Any]) -> list[str]:
    lines = ["| variant | decision -> first token p50 s | p95 s | max s | wake call / engine wake s "
             "| first TTFT after ms | steady TTFT ms | first ÷ steady | runs ok |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for variant, data in model["variants"].items():
        s = data["summary"]
        wake = (f"{fmt(s.get('wake_call_s'), digits=3)} / {fmt(s.get('engine_wake_s'), digits=3)}"
                if s.get("wake_call_s") is not None or s.get("engine_wake_s") is not None else "-")
        first = s.get("first_ttft_after_wake_s", s.get("first_ttft_s"))
        lines.append(f"| {VARIANT_LABELS.get(variant, variant)} | {fmt(s.get('p50_s'), digits=3)} "
                     f"| {fmt(s.get('p95_s'), digits=3)} | {fmt(s.get('max_s'), digits=3)} | {wake} "
                     f"| {_ms(first)} | {_ms(s.get('steady_ttft_s'))} | {fmt(s.get('first_over_steady'))} "
                     f"| {s.get('runs_ok', 0)}/{s.get('runs', 0)} |")
    return lines


def phases_table(model: Mapping[str, Any]) -> list[str]:
    """Where the slow paths spend their time (medians, seconds from the decision)."""
    out: list[str] = []
    pod = model["variants"].get("new_pod", {}).get("summary")
    if pod and pod.get("runs_ok"):
        out += ["", "New pod, medians from the scale patch: "
                f"pod created {fmt(pod.get('pod_created_s'))} s, bound with an IP {fmt(pod.get('pod_ip_s'))} s, "
                f"worker /readyz 200 {fmt(pod.get('readyz_s'))} s, first token {fmt(pod.get('p50_s'))} s, "
                f"kubelet Ready (routable behind a Service) {fmt(pod.get('kubelet_ready_s'))} s."]
    fresh = model["variants"].get("fresh_process", {}).get("summary")
    if fresh and fresh.get("runs_ok"):
        out += ["", f"Fresh process, medians from process start: weights mapped {fmt(fresh.get('mapped_s'))} s, "
                f"ready {fmt(fresh.get('ready_s'))} s, first token {fmt(fresh.get('first_token_s'))} s."]
    return out


def memory_table(model: Mapping[str, Any]) -> list[str]:
    lines = ["| variant | anon awake / asleep MiB | weight-file RSS awake / asleep MiB | released: anon MiB "
             "| released: worker's metric MiB | held beyond the mapping MiB | anon released ÷ held | sleep call s "
             "| weights cached before wake |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for variant, data in model["variants"].items():
        s = data["summary"]
        if s.get("anon_awake_bytes") is None:
            continue
        share = s.get("anon_released_share")
        lines.append(
            f"| {VARIANT_LABELS.get(variant, variant)} | {fmt_mib(s.get('anon_awake_bytes'))} / "
            f"{fmt_mib(s.get('anon_asleep_bytes'))} | {fmt_mib(s.get('weights_file_awake_bytes'))} / "
            f"{fmt_mib(s.get('weights_file_asleep_bytes'))} | {fmt_mib(s.get('anon_released_bytes'))} "
            f"| {fmt_mib(s.get('released_bytes'))} | {fmt_mib(s.get('beyond_mapping_bytes'))} "
            f"| {'- (zero copy)' if share is None else fmt_pct(share)} | {fmt(s.get('sleep_call_s'), digits=3)} "
            f"| {fmt_pct(s.get('resident_before'))} |")
    return lines


def targets_table(model: Mapping[str, Any]) -> list[str]:
    lines = ["| target | figure | limit | |", "|---|---:|---:|---|"]
    for name, t in model["targets"].items():
        verdict = "not measured" if t["met"] is None and t["value"] is None else (
            "-" if t["met"] is None else ("met" if t["met"] else "**missed**"))
        value = t["value"]
        shown = "-" if value is None else (fmt_pct(value) if "%" in t["target"] else fmt(value, digits=3))
        lines.append(f"| {name} | {shown} | {t['target']} | {verdict} |")
    return lines


def render_wake(result: Mapping[str, Any]) -> str:
    settings = result["settings"]
    machine = result["machine"]
    out = [
        "# warmpool bench wake",
        "",
        f"Started {result['started_at']}; {machine.get('cpus')} CPUs ({machine.get('cpu', '?')}), "
        f"load average at start {fmt(machine['loadavg'][0])} / end {fmt(machine.get('loadavg_end', [None])[0])}; "
        f"torch {machine.get('torch_version', '?')}; wall {fmt(result.get('wall_s'), digits=0)} s.",
        f"Device {settings['device']}, dtype {settings['dtype']} (copies rows: {settings['copies_dtype']}); "
        f"{settings['rounds']} rounds, variants round-robin (order rotated each round); torch threads "
        f"{settings.get('torch_threads')}; warm-up buckets {settings['buckets']} x {settings['prompts_per_bucket']}; "
        f"request {settings['request_tokens']} tokens -> 1 token, steady = median of {settings['steady_requests']} "
        "more. Times in seconds from the decision (the wake call, the request, the process start, the scale patch) "
        "to the first token served. Absolute times on a shared CPU box mean little; read the ratios.",
    ]
    for name, model in result["models"].items():
        out += ["", f"## {model.get('label', name)} ({model['weight_bytes'] / 1e9:.2f} GB of weights)", "",
                *timing_table(model), *phases_table(model), "",
                "Memory around each sleep (medians; /proc/PID/smaps; 'held beyond the mapping' is computed from the "
                "checkpoint's headers: converted copies at the compute dtype):", "",
                *memory_table(model), "", "Targets:", "", *targets_table(model)]
        side = model.get("side_figures") or {}
        if side:
            out += ["", "Beside the targets: " + ", ".join(f"{k} {fmt(v)}" for k, v in side.items()) + "."]
        load = [r.get("loadavg_1m") for data in model["variants"].values() for r in data["runs"]]
        load = [x for x in load if x is not None]
        if load:
            out += ["", f"Load average (1 min) before the runs: {min(load):.2f}-{max(load):.2f}."]
        errors = [(v, r["round"], r["error"]) for v, data in model["variants"].items() for r in data["runs"]
                  if "error" in r]
        if errors:
            out += ["", "Failed runs:", ""] + [f"- {v} round {i + 1}: {str(e)[:300]}" for v, i, e in errors]
    return "\n".join(out) + "\n"
