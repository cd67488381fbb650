"""`bench nodes` results as Markdown: each figure beside its target, met or missed."""

from __future__ import annotations

from typing import Any

#: Issue targets: `cluster up --nodes 2` / `--nodes 1`, and death -> warm over the cold start.
UP_RATIO_TARGET = 1.5
DEATH_OVER_COLD_START_TARGET_S = 5.0


def _verdict(met: bool) -> str:
    return "**met**" if met else "**missed**"


def _up(up: dict[str, Any]) -> list[str]:
    if "skipped" in up:
        return ["## cluster up", "", f"Skipped: {up['skipped']}.", ""]
    one, two = up["seconds"]["1"], up["seconds"]["2"]
    lines = ["## cluster up: two real nodes against one", "",
             "| round | --nodes 1 (s) | --nodes 2 (s) |", "|---|---|---|"]
    lines += [f"| {i + 1} | {a:.1f} | {b:.1f} |" for i, (a, b) in enumerate(zip(one, two, strict=False))]
    value = up["ratio"]
    lines += ["", f"Ratio of the medians: {value:.2f} (target <= {UP_RATIO_TARGET}): "
              f"{_verdict(value is not None and value <= UP_RATIO_TARGET)}.", ""]
    return lines


def _drain(drain: dict[str, Any]) -> list[str]:
    met = drain["completed"] and drain["fewest_serving"] >= drain["min_warm"] and drain["failed"] == 0
    return ["## kubectl drain of the node holding the warm pods", "",
            "| drain completed | drain (s) | fewest Ready pods behind the Service | minWarm | requests | failed |",
            "|---|---|---|---|---|---|",
            f"| {drain['completed']} | {drain['seconds']:.1f} | {drain['fewest_serving']} | {drain['min_warm']} "
            f"| {drain['requests']} | {drain['failed']} {drain['failed_statuses'] or ''} |", "",
            f"Target: never below minWarm, no request failed: {_verdict(met)}.", ""]


def _death(death: dict[str, Any]) -> list[str]:
    over = death["over_cold_start_s"]
    cold = death["replacement_cold_start_s"]
    placed = {"spread": "one warm pod on each node", "packed": "both warm pods on it"}.get(
        death.get("placement", "packed"), death.get("placement"))
    return [f"## A node dies with {placed} (SIGKILL of " + ", ".join(death["killed"]) + ", link down)", "",
            "| death -> minWarm Ready on the other node (s) | first replacement created after (s) "
            "| replacements' cold start (s) | over the cold start (s) |", "|---|---|---|---|",
            f"| {death['death_to_warm_s']:.1f} | {death['first_replacement_created_after_s']:.1f} "
            f"| {'-' if cold is None else f'{cold:.0f}'} | {'-' if over is None else f'{over:.1f}'} |", "",
            f"Target: over the cold start <= {DEATH_OVER_COLD_START_TARGET_S:g} s: "
            f"{_verdict(over is not None and over <= DEATH_OVER_COLD_START_TARGET_S)}.", ""]


def _cache(cache: dict[str, Any]) -> list[str]:
    first, other = cache["first_pod"], cache["other_node"]
    every_time = all(cache["placed_on_cached_node"])
    lines = ["## New pods and the node caches (the chart's node agents, SeaweedFS)", "",
             "| pod | node | revision cached there before | scale request -> Ready (s) |", "|---|---|---|---|",
             f"| first | {first['node']} | no (its agent fills it from S3) | {first['seconds']:.1f} |"]
    lines += [f"| cached {i + 1} | {c['node']} | yes | {c['seconds']:.1f} |" for i, c in enumerate(cache["cached"])]
    lines += [f"| other node (cached node tainted) | {other['node']} | no (its agent fills it from S3) "
              f"| {other['seconds']:.1f} |", ""]
    value = cache["cached_over_uncached"]
    lines += [f"Cached start ÷ uncached start on the other node: {'-' if value is None else f'{value:.2f}'} "
              "(target: report).",
              f"Placement picked the cached node every time: {_verdict(every_time)} "
              f"({sum(cache['placed_on_cached_node'])} of {len(cache['placed_on_cached_node'])}).", "",
              "Each node's own copy of the revision (`status.cacheNodes`, and the directory this machine sees):", ""]
    lines += [f"- {e['node']}: published {e['published']}, {e['bytesCached']} of {e['bytesTotal']} bytes; "
              f"`{cache['own_copies'].get(e['node'], {}).get('path', '-')}`" for e in cache["cache_nodes"]]
    return [*lines, ""]


def _partition(cut: dict[str, Any]) -> list[str]:
    kept = sorted(cut["pods_after"].items())
    return ["## Node 1 cut off (its link down, processes alive), then back", "",
            "| cut -> minWarm Ready on node 0 (s) | link back -> the pool at minWarm, all Ready (s) | pods kept |",
            "|---|---|---|",
            f"| {cut['cut_to_warm_s']:.1f} | {cut['healed_to_min_warm_s']:.1f} "
            f"| {', '.join(f'{name} ({node})' for name, node in kept)} |", ""]


def render_nodes(result: dict[str, Any]) -> str:
    settings = result["settings"]
    lines = [f"# warmpool bench nodes ({settings['model']}, minWarm {settings['min_warm']})", ""]
    if "up" in result:
        lines += _up(result["up"])
    if "cache" in result:
        lines += _cache(result["cache"])
    if "drain" in result:
        lines += _drain(result["drain"])
    if "partition" in result:
        lines += _partition(result["partition"])
    if "node_death" in result:
        lines += _death(result["node_death"])
    if "error" in result:
        lines += ["## Stopped early", "", "```", result["error"], "```", ""]
    return "\n".join(lines)
