"""`warmpool bench podstart`: a new pod -> warm on the real node, step by step, beside the same
worker started as a plain process, in one run.

It is `bench wake` with two of its variants, round by round in alternating order:
``new_pod`` (a WarmModel scaled from zero to one on the local real-node cluster, the checkout's
worker image already on the node) and ``fresh_process`` (the same worker flags, spawned here).
Each new-pod run is broken down by :mod:`.pod_start`; this module summarises the steps (medians
over the runs) and the shares the issue asks for: what the container runtime takes, what
Kubernetes around it takes, and what the worker takes in a container against a plain process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from warmpool_bench.pod_start import RUNTIME_STEPS, STEPS
from warmpool_bench.stats import median, ratio
from warmpool_bench.wake import run_wake
from warmpool_bench.wake_settings import WakeSettings

VARIANTS = ("fresh_process", "new_pod")
#: Steps Kubernetes owns around the runtime: the controllers, the scheduler, the kubelet's probes.
KUBERNETES_STEPS = ("controllers", "scheduling", "readiness")
#: Steps the worker owns, in a pod or not.
WORKER_STEPS = ("imports", "weights", "warmup")


def _ok(runs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in runs if "error" not in r and r.get("steps")]


def _step_medians(runs: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    names = [step for step, _ in STEPS if any(step in r["steps"] for r in runs)]
    return {step: median([r["steps"][step] for r in runs if r["steps"].get(step) is not None]) for step in names}


def _share(run: Mapping[str, Any], names: Sequence[str], total: float | None) -> float | None:
    parts = [run["steps"].get(name) for name in names]
    if total is None or total <= 0 or any(p is None for p in parts):
        return None
    return sum(float(p) for p in parts if p is not None) / total


def _pod_total(run: Mapping[str, Any]) -> float | None:
    instants = run.get("instants") or {}
    ready, decision = instants.get("pod_ready"), instants.get("decision")
    return None if ready is None or decision is None else float(ready) - float(decision)


def _process_total(run: Mapping[str, Any]) -> float | None:
    parts = [run["steps"].get(step) for step in WORKER_STEPS]
    return None if any(p is None for p in parts) else sum(float(p) for p in parts if p is not None)


def breakdown(model: Mapping[str, Any]) -> dict[str, Any]:
    """One model's figures from its ``new_pod`` and ``fresh_process`` runs."""
    variants = model["variants"]
    pods = _ok(variants.get("new_pod", {}).get("runs", []))
    processes = _ok(variants.get("fresh_process", {}).get("runs", []))
    pod_steps, process_steps = _step_medians(pods), _step_medians(processes)
    pod_total = median([t for r in pods if (t := _pod_total(r)) is not None])
    process_total = median([t for r in processes if (t := _process_total(r)) is not None])
    in_pod = {step: (None if pod_steps.get(step) is None or process_steps.get(step) is None
                     else float(pod_steps[step] or 0) - float(process_steps[step] or 0)) for step in WORKER_STEPS}
    return {
        "runs": {"new_pod": len(pods), "fresh_process": len(processes)},
        "new_pod_steps_s": pod_steps,
        "fresh_process_steps_s": process_steps,
        "new_pod_ready_s": pod_total,
        "fresh_process_ready_s": process_total,
        "new_pod_first_token_s": median([float(r["decision_to_first_token_s"]) for r in pods
                                         if r.get("decision_to_first_token_s") is not None]),
        "fresh_process_first_token_s": median([float(r["decision_to_first_token_s"]) for r in processes
                                               if r.get("decision_to_first_token_s") is not None]),
        "runtime_share": median([s for r in pods if (s := _share(r, RUNTIME_STEPS, _pod_total(r))) is not None]),
        "kubernetes_share": median([s for r in pods
                                    if (s := _share(r, KUBERNETES_STEPS, _pod_total(r))) is not None]),
        "worker_share": median([s for r in pods if (s := _share(r, WORKER_STEPS, _pod_total(r))) is not None]),
        "worker_in_pod_minus_process_s": in_pod,
        "new_pod_over_process": ratio(pod_total, process_total),
    }


def run_podstart(sizes: Sequence[str], settings: WakeSettings, cache_root: Path) -> dict[str, Any]:
    """The runs (`bench wake`'s two variants), then each model's breakdown."""
    settings.variants = VARIANTS
    result = run_wake(sizes, settings, cache_root)
    result["benchmark"] = "podstart"
    for model in result["models"].values():
        model.pop("targets", None)  # bench wake's targets need its wake variants: not run here
        model.pop("side_figures", None)
        model["breakdown"] = breakdown(model)
    return result
