"""The Markdown of `warmpool bench zero`: each target beside the floor measured in the same run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from warmpool_bench.stats import median

#: The targets: first token from zero within a new pod's cold start + 0.5 s, from sleep within the
#: wake + 0.3 s, and 50 ms p95 added by forwarding through the activator.
ZERO_OVERHEAD_TARGET_S = 0.5
SLEEP_OVERHEAD_TARGET_S = 0.3
FORWARD_P95_TARGET_S = 0.05


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _rounds(title: str, floor: str, rows: Sequence[Mapping[str, Any]], target: float) -> list[str]:
    lines = [f"## {title}", "", f"| round | first token (s) | {floor} (s) | overhead (s) |", "|---|---|---|---|"]
    for i, row in enumerate(rows, 1):
        if "error" in row:
            lines.append(f"| {i} | failed: {row['error']} | | |")
            continue
        key = "cold_start_s" if "cold_start_s" in row else "wake_s"
        lines.append(f"| {i} | {_fmt(row['first_token_s'])} | {_fmt(row[key])} | {_fmt(row['overhead_s'])} |")
    worst = max((r["overhead_s"] for r in rows if "overhead_s" in r), default=None)
    ok = worst is not None and worst <= target and all("error" not in r for r in rows)
    lines += ["", f"Target: overhead <= {target:g} s in every round; worst {_fmt(worst)} s, median "
              f"{_fmt(median(r.get('overhead_s') for r in rows))} s: **{'met' if ok else 'missed'}**.", ""]
    return lines


#: The pool's spec.pool.scaleToZero.maxHeldRequests in `bench zero`: what each activator replica
#: holds at once (the burst stays below it, so every request must be answered, none refused).
MAX_HELD_PER_REPLICA = 100


def burst_outcome(statuses: Sequence[int], max_held_per_replica: int) -> dict[str, Any]:
    """A burst's answers by kind: answered (200), refused because a replica's hold was full (429),
    refused because the hold timed out or the activator was busy (503), and lost (anything else: a
    connection cut, another status).  A refusal is not an answer: below each replica's
    maxHeldRequests the burst meets its target only when every request was answered."""
    counts = {code: sum(1 for s in statuses if s == code) for code in sorted(set(statuses))}
    answered, full, unavailable = counts.get(200, 0), counts.get(429, 0), counts.get(503, 0)
    return {"requests": len(statuses), "statuses": {str(code): n for code, n in counts.items()},
            "answered": answered, "refused_429": full, "refused_503": unavailable,
            "lost": len(statuses) - answered - full - unavailable, "max_held_per_replica": max_held_per_replica,
            "met": len(statuses) <= max_held_per_replica and answered == len(statuses)}


def render_zero(result: Mapping[str, Any]) -> str:
    lines = [f"# warmpool bench zero ({result['model']}, {result['rounds']} rounds)", ""]
    if result.get("error"):
        lines += [f"**Stopped early**: {result['error']}", ""]
    lines += _rounds("From zero: a new pod", "cold start (created -> Ready)", result.get("from_zero") or [],
                     ZERO_OVERHEAD_TARGET_S)
    lines += _rounds("From sleep: a sleeping pod woken", "wake (worker's own)", result.get("from_sleep") or [],
                     SLEEP_OVERHEAD_TARGET_S)
    burst = result.get("burst")
    if burst:
        # Results written before refusals were counted apart hold only the statuses: count them now.
        codes = [int(code) for code, count in burst["statuses"].items() for _ in range(int(count))]
        burst = {**burst, **burst_outcome(codes, int(burst.get("max_held_per_replica", MAX_HELD_PER_REPLICA)))}
        lines += ["## Burst at zero", "",
                  f"{burst['requests']} requests at once (maxHeldRequests {burst['max_held_per_replica']} per "
                  f"activator replica): answered {burst['answered']}, refused 429 {burst['refused_429']}, "
                  f"refused 503 {burst['refused_503']}, lost {burst['lost']}; slowest answered in "
                  f"{burst['slowest_s']:.2f} s: **{'met' if burst['met'] else 'missed'}** (every request answered "
                  "with 200: below the bound a refusal is a failure too).", ""]
    forward = result.get("forward")
    if forward:
        p95 = forward["added_p95_s"]
        verdict = "met" if p95 is not None and p95 <= FORWARD_P95_TARGET_S else "missed"
        lines += ["## Forwarding", "",
                  f"Time to first token through an activator replica minus straight to the pod, {forward['samples']} "
                  f"pairs: p50 {_fmt(forward['added_p50_s'])} s, p95 {_fmt(p95)} s (target <= "
                  f"{FORWARD_P95_TARGET_S:g} s: **{verdict}**).",
                  f"With a warm pod, requests to the ClusterIP left the activator's counters "
                  f"{'unchanged' if forward['activator_untouched_when_warm'] else 'CHANGED'}: the activator is "
                  f"{'out of' if forward['activator_untouched_when_warm'] else 'still in'} the data path.", ""]
    return "\n".join(lines)
