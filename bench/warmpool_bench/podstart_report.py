"""The Markdown of `warmpool bench podstart` (figures: `podstart.breakdown`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from warmpool_bench.pod_start import STEP_TITLES, STEPS
from warmpool_bench.report import fmt, fmt_pct


def _steps_table(figures: Mapping[str, Any]) -> list[str]:
    pod, process = figures["new_pod_steps_s"], figures["fresh_process_steps_s"]
    total = figures["new_pod_ready_s"]
    lines = ["| step | new pod s | share of decision → Ready | plain process s |", "|---|---:|---:|---:|"]
    for step, _end in STEPS:
        seconds = pod.get(step)
        share = None if seconds is None or not total else seconds / total
        lines.append(f"| {STEP_TITLES[step]} | {fmt(seconds, digits=3)} | {fmt_pct(share)} "
                     f"| {fmt(process.get(step), digits=3) if step in process else '(no such step)'} |")
    lines.append(f"| **decision → pod Ready** / spawn → worker ready | **{fmt(total, digits=3)}** | 100 % "
                 f"| **{fmt(figures['fresh_process_ready_s'], digits=3)}** |")
    return lines


def _runs_table(model: Mapping[str, Any]) -> list[str]:
    lines = ["| round | " + " | ".join(step for step, _ in STEPS) + " | decision → first token |",
             "|---:|" + "---:|" * (len(STEPS) + 1)]
    for run in model["variants"].get("new_pod", {}).get("runs", []):
        if "error" in run:
            lines.append(f"| {run.get('round')} | error: {str(run['error'])[:200]} |")
            continue
        steps = run.get("steps") or {}
        lines.append(f"| {run.get('round')} | " + " | ".join(fmt(steps.get(step), digits=3) for step, _ in STEPS)
                     + f" | {fmt(run.get('decision_to_first_token_s'), digits=3)} |")
    return lines


def render_podstart(result: Mapping[str, Any]) -> str:
    machine, settings = result["machine"], result["settings"]
    out = [
        "# warmpool bench podstart",
        "",
        f"Started {result['started_at']}; {machine.get('cpus')} CPUs ({machine.get('cpu', '?')}), load average at "
        f"start {fmt(machine['loadavg'][0])} / end {fmt(machine.get('loadavg_end', [None])[0])}; wall "
        f"{fmt(result.get('wall_s'), digits=0)} s. {settings['rounds']} rounds, each a new pod on the local real "
        "node (a WarmModel scaled 0 → 1, the worker image already on the node) and the same worker as a plain "
        f"process, in alternating order; dtype {settings['dtype']}, torch threads {settings.get('torch_threads')}, "
        f"warm-up buckets {settings['buckets']} x {settings['prompts_per_bucket']}.",
        "",
        "Instants: the pod watch (created, bound, Ready), the node's containerd events (sandbox and worker "
        "container task start), the worker's cold-start phase timestamps. Steps are medians over the runs; each "
        "run's steps add up to its decision → pod Ready.",
    ]
    for name, model in result["models"].items():
        figures = model["breakdown"]
        in_pod = figures["worker_in_pod_minus_process_s"]
        out += [
            "", f"## {model.get('label', name)} ({model['weight_bytes'] / 1e9:.2f} GB of weights)", "",
            *_steps_table(figures), "",
            f"- The container runtime's share (sandbox, CNI, container start): "
            f"{fmt_pct(figures['runtime_share'])}; Kubernetes around it (controllers, scheduler, probes): "
            f"{fmt_pct(figures['kubernetes_share'])}; the worker: {fmt_pct(figures['worker_share'])}.",
            "- The worker in a pod minus as a plain process: "
            + ", ".join(f"{step} {fmt(value, 's', 3)}" for step, value in in_pod.items()) + ".",
            f"- New pod ÷ plain process, to ready: {fmt(figures['new_pod_over_process'])}x; decision → first "
            f"token {fmt(figures['new_pod_first_token_s'], ' s', 3)} (pod IP, once the worker answers /readyz) vs "
            f"{fmt(figures['fresh_process_first_token_s'], ' s', 3)}.",
            f"- Runs with every instant: new pod {figures['runs']['new_pod']}, process "
            f"{figures['runs']['fresh_process']}.",
            "", "Each new pod's steps (s):", "", *_runs_table(model),
        ]
    return "\n".join(out) + "\n"
