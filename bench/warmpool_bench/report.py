"""Markdown tables from the benchmark JSON (pure: a dict in, a string out)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from warmpool_bench.stats import ratio

VARIANT_LABELS: dict[str, str] = {
    "torch_load": "1. torch.load (pickle) + engine",
    "transformers": "2. transformers from_pretrained + generate",
    "safetensors_eager": "3. safetensors load_file + engine (eager)",
    "warmpool_full": "4. warmpool worker, full warm-up",
    "warmpool_truncated": "5. warmpool worker, truncated tier",
    "warmpool_kv_prefix": "6. warmpool worker, persisted prefix KV",
    "floor": "floor: import torch + sequential read + warm-up prefills",
}

#: (key in the ratios, label, target as text, the cache state the target is about or None for both)
TARGETS: tuple[tuple[str, str, str, str | None], ...] = (
    ("usable_speedup_vs_transformers", "weights usable: transformers ÷ warmpool", "≥ 3x small, ≥ 5x 1-2 GB", None),
    ("ready_over_floor", "time to ready ÷ floor", "≤ 1.3 (warm)", "warm"),
    ("ready_over_floor_kv_prefix", "time to ready with prefix KV ÷ floor", "(no target)", None),
    ("first_over_steady.warmpool_full", "first TTFT ÷ steady TTFT, warmpool full", "≤ 1.1", None),
    ("first_over_steady.transformers", "first TTFT ÷ steady TTFT, transformers", "(printed beside)", None),
    ("load_bandwidth_fraction", "load bandwidth ÷ sequential read bandwidth", "≥ 0.8 warm, ≥ 0.9 cold", None),
)


def fmt(value: float | None, unit: str = "", digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}{unit}"


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def fmt_mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def coldstart_table(model: Mapping[str, Any], states: Sequence[str]) -> list[str]:
    lines = [
        "| variant | cache | ready s | first token s | weights usable s | load s | first ÷ steady TTFT "
        "| steady TTFT ms | peak RSS MiB | cached before | runs ok |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, per_state in model["variants"].items():
        for state in states:
            if state not in per_state:
                continue
            med = per_state[state]["median"]
            runs = per_state[state]["runs"]
            ok = sum("error" not in r for r in runs)
            ready = med.get("floor_s") if variant == "floor" else med.get("ready_s")
            steady = med.get("steady_ttft_s")
            steady_ms = None if steady is None else steady * 1000
            lines.append(
                f"| {VARIANT_LABELS.get(variant, variant)} | {state} | {fmt(ready)} | {fmt(med.get('first_token_s'))} "
                f"| {fmt(med.get('usable_s'))} | {fmt(med.get('load_s') if variant != 'floor' else med.get('read_s'))} "
                f"| {fmt(ratio(med.get('first_ttft_s'), steady))} | {fmt(steady_ms, digits=0)} "
                f"| {fmt_mib(med.get('peak_rss_bytes'))} | {fmt_pct(med.get('resident_before'))} | {ok}/{len(runs)} |"
            )
    return lines


def ratio_table(ratios: Mapping[str, Mapping[str, float | None]]) -> list[str]:
    states = list(ratios)
    lines = ["| figure | target | " + " | ".join(states) + " |", "|---|---|" + "---:|" * len(states)]
    for key, label, target, _state in TARGETS:
        cells = " | ".join(fmt(ratios[s].get(key)) for s in states)
        lines.append(f"| {label} | {target} | {cells} |")
    return lines


def render_coldstart(result: Mapping[str, Any]) -> str:
    settings = result["settings"]
    machine = result["machine"]
    states = settings["cache_states"]
    out = [
        "# warmpool bench coldstart",
        "",
        f"Started {result['started_at']}; {machine.get('cpus')} CPUs ({machine.get('cpu', '?')}), "
        f"load average at start {fmt(machine['loadavg'][0])} / end {fmt(machine.get('loadavg_end', [None])[0])}; "
        f"torch {machine.get('torch_version', '?')}, transformers {machine.get('transformers_version', '?')}.",
        f"Device {settings['device']}, dtype {settings['dtype']}; medians of {settings['runs']} fresh processes "
        f"per variant and cache state; torch threads {settings.get('torch_threads')}; "
        f"warm-up buckets {settings['buckets']} x {settings['prompts_per_bucket']} "
        f"prompt(s), {settings['decode_tokens']} decoded tokens each; request {settings['request_tokens']} tokens "
        f"→ 1 token, steady state = median of {settings['steady_requests']} more.",
        "Times are seconds from the instant before the process was started. "
        "Absolute times on a shared CPU box mean little; the ratios below are the point.",
    ]
    for name, model in result["models"].items():
        out += [
            "",
            f"## {model.get('label') or name + ': ' + model['model_dir'].rsplit('/', 1)[-1]} "
            f"({model['weight_bytes'] / 1e9:.2f} GB of weights)",
            "",
            *coldstart_table(model, states),
            "",
            "Ratios against the issue's targets (medians of this run):",
            "",
            *ratio_table(model["ratios"]),
        ]
        floor = model["variants"].get("floor", {})
        bw = [f"{s}: {fmt(floor[s]['median'].get('read_gbps'))} GB/s" for s in states if s in floor]
        if bw:
            out += ["", "Plain sequential read bandwidth of the weight files (floor process): " + ", ".join(bw) + "."]
    return "\n".join(out) + "\n"


def render_scale(result: Mapping[str, Any]) -> str:
    machine = result["machine"]
    out = [
        "# warmpool bench scale",
        "",
        f"Started {result['started_at']}; {machine.get('cpus')} CPUs, load average at start "
        f"{fmt(machine['loadavg'][0])} / end {fmt(machine.get('loadavg_end', [None])[0])}.",
    ]
    if result.get("missing"):
        out += ["", "**Not measured:** " + str(result["missing"])]
    sweep = result.get("floor_sweep") or []
    if sweep:
        out += ["", "Floor: the N WarmModels and their children (Secret, ConfigMap, Service, PDB, Deployment, "
                "rendered by the operator's builders) server-side applied by one process over one pooled client; "
                "the operator's run creates its WarmModels the same way. Requests in flight tuned in this run "
                f"(objects of {sweep[0].get('objects', 0) // 6} WarmModels each): "
                + ", ".join(f"{p['concurrency']}: {fmt(p.get('per_s'))}/s" + (" (failed)" if "error" in p else "")
                            for p in sweep)
                + f"; chosen {result.get('settings', {}).get('concurrency', '-')}."]
    points = result.get("points", [])
    if points:
        out += [
            "",
            "| WarmModels | floor all done s | all Ready s | ratio | Ready | reconcile p50 s | reconcile p95 s "
            "| create/update p95 s | status lag p50 / p95 s | scrape cycle p50 s "
            "| operator CPU s | idle CPU % | operator RSS MiB (peak) | all deleted s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in points:
            out.append(
                f"| {p['count']} | {fmt((p.get('floor') or {}).get('all_done_s'))} | {fmt(p.get('all_ready_s'))} "
                f"| {fmt(p.get('ratio_to_floor'))} | {p.get('ready_count', '-')}/{p['count']} "
                f"| {fmt(p.get('reconcile_p50_s'), digits=3)} | {fmt(p.get('reconcile_p95_s'), digits=3)} "
                f"| {fmt(p.get('reconcile_handler_p95_s'), digits=3)} "
                f"| {fmt((p.get('status_lag') or {}).get('p50_s'), digits=3)} / "
                f"{fmt((p.get('status_lag') or {}).get('p95_s'), digits=3)} "
                f"| {fmt(p.get('scrape_cycle_p50_s'), digits=3)} | {fmt(p.get('operator_cpu_s'))} "
                f"| {fmt(p.get('idle_cpu_percent'), digits=1)} | {fmt_mib(p.get('operator_rss_peak_bytes'))} "
                f"| {fmt(p.get('all_deleted_s'))} |"
            )
    if points:
        out += ["", "Reconcile quantiles are interpolated in the operator's histogram buckets "
                "(..., 1, 2.5, 5, 10, 30 s). All passes = the event passes (debounced reconciles caused by "
                "watch events and tier changes) plus create/update, the first pass of each object, which "
                "includes the time it waits behind the others. Worker pods sit on kwok nodes with nothing "
                "running: every scrape is refused at once. Status lag: a sampled pod turned Ready by the "
                "bench -> its WarmModel's status.readyReplicas, seen through a watch."]
    growth = result.get("growth", {})
    if growth:
        out += ["", "Growth as N doubles (value at 2N ÷ value at N):", "", "| figure | " +
                " | ".join(next(iter(growth.values())).keys()) + " |",
                "|---|" + "---:|" * len(next(iter(growth.values())))]
        for key, steps in growth.items():
            out.append(f"| {key} | " + " | ".join(fmt(v) for v in steps.values()) + " |")
    targets = result.get("targets")
    if targets:
        out += ["", f"Targets at N={result.get('targets_n', 'the largest')}:", "", "| target | figure | limit | |",
                "|---|---:|---:|---|"]
        for name, t in targets.items():
            verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "missed")
            out.append(f"| {name} | {fmt(t['value'], digits=3)} | {t['target']} | {verdict} |")
    return "\n".join(out) + "\n"
