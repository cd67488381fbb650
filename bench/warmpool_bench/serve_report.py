"""`warmpool bench serve`'s figures (pure), its targets judged, its Markdown and its chart.

Per server and concurrency level, from the requests' token timestamps:

* ``throughput_tok_s``: output tokens / wall time of the level (first send -> last token);
* ``steady_tok_s``: output tokens / time, counted only while every client was active (from
  the last client's first send to the first client's last token): the batch at full width;
* TTFT (send -> first token) and TPOT (mean gap between the following tokens), p50 and p95;
* TBT, time between tokens: every gap between two consecutive tokens of one request, pooled over
  the level's requests, p50 and p95 (a decode stalled behind someone's prefill shows here, where a
  request's mean, TPOT, averages it away);
* ``tok_per_cpu_s``: output tokens / the server process's CPU seconds (user + system, all threads)
  during the level: what the work cost, whatever share of a shared machine the server was given.

Targets (never asserted anywhere; met or missed is reported): at 12 concurrent, steady decode
throughput >= 4x a single request's (the level-1 figure), TTFT p95 <= 2.5x the level-1 TTFT
p50, and TBT p95 <= 1.5x the level-1 TBT p95.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from warmpool_bench.serve_load import RequestTiming
from warmpool_bench.stats import median, percentile, ratio

TARGET_CONCURRENCY = 12
TARGET_THROUGHPUT_RATIO = 4.0
TARGET_TTFT_RATIO = 2.5
TARGET_TBT_RATIO = 1.5


def level_figures(timings: Sequence[RequestTiming], wall_s: float, concurrency: int,
                  cpu_s: float | None = None) -> dict[str, Any]:
    done = [t for t in timings if t.error is None and t.token_times]
    tokens = sum(t.tokens for t in done)
    firsts: dict[int, float] = {}
    lasts: dict[int, float] = {}
    for t in done:
        firsts[t.client] = min(firsts.get(t.client, t.sent), t.sent)
        lasts[t.client] = max(lasts.get(t.client, t.token_times[-1]), t.token_times[-1])
    steady: float | None = None
    if len(firsts) == concurrency:
        start, end = max(firsts.values()), min(lasts.values())
        if end > start:
            inside = sum(1 for t in done for at in t.token_times if start <= at <= end)
            steady = inside / (end - start)
    ttft = [t.ttft_s for t in done]
    tpot = [t.tpot_s for t in done]
    tbt = [later - earlier for t in done for earlier, later in zip(t.token_times, t.token_times[1:], strict=False)]
    return {
        "concurrency": concurrency,
        "requests": len(timings),
        "errors": [t.error for t in timings if t.error is not None][:5],
        "error_count": sum(1 for t in timings if t.error is not None),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "throughput_tok_s": ratio(float(tokens), wall_s),
        "steady_tok_s": steady,
        "ttft_p50_s": median(ttft),
        "ttft_p95_s": percentile(ttft, 95),
        "tpot_p50_s": median(tpot),
        "tpot_p95_s": percentile(tpot, 95),
        "tbt_p50_s": median(tbt),
        "tbt_p95_s": percentile(tbt, 95),
        "cpu_s": cpu_s,
        "tok_per_cpu_s": ratio(float(tokens), cpu_s),
    }


def same_text(levels: Mapping[int, Sequence[RequestTiming]]) -> dict[str, int]:
    """Greedy texts at every level against the level-1 text of the same prompt."""
    alone = {t.prompt: t.text for t in levels.get(1, []) if t.error is None}
    compared = equal = 0
    for level, timings in levels.items():
        if level == 1:
            continue
        for t in timings:
            if t.error is None and t.prompt in alone:
                compared += 1
                equal += t.text == alone[t.prompt]
    return {"compared": compared, "equal": equal}


def judge(levels: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The targets at TARGET_CONCURRENCY against level 1, for one server's levels (keys: str(c))."""
    alone, wide = levels.get("1"), levels.get(str(TARGET_CONCURRENCY))
    if alone is None or wide is None:
        return {"throughput": None, "ttft": None}
    single = alone["steady_tok_s"] or alone["throughput_tok_s"]
    throughput = ratio(wide["steady_tok_s"] or wide["throughput_tok_s"], single)
    ttft = ratio(wide["ttft_p95_s"], alone["ttft_p50_s"])
    tbt = ratio(wide.get("tbt_p95_s"), alone.get("tbt_p95_s"))
    return {
        "throughput_ratio": throughput,
        "throughput_met": None if throughput is None else throughput >= TARGET_THROUGHPUT_RATIO,
        "ttft_p95_ratio": ttft,
        "ttft_met": None if ttft is None else ttft <= TARGET_TTFT_RATIO,
        "tbt_p95_ratio": tbt,
        "tbt_met": None if tbt is None else tbt <= TARGET_TBT_RATIO,
    }


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _met(value: bool | None) -> str:
    return "-" if value is None else ("**met**" if value else "**missed**")


def render_serve(result: Mapping[str, Any]) -> str:
    settings = result["settings"]
    lines = [
        "# warmpool bench serve",
        "",
        f"`{Path(result['model_dir']).name}` on CPU, {settings['threads']} threads per server, prompts of about "
        f"{settings['prompt_tokens']} tokens, max_tokens {settings['max_tokens']}, greedy, streamed; "
        f"{settings['requests_per_client']} requests per client (closed loop, client starts staggered by "
        "one request's length / concurrency). Commit `" + str(result["commit"])[:12] + "`, load average "
        f"{_f(result['load_average_start'][0])} at start, {_f(result['load_average_end'][0])} at the end "
        f"(1-minute), {result['cpus']} CPUs, wall {_f(result['wall_s'], 0)} s.",
        "",
    ]
    for name, server in result["servers"].items():
        lines += [f"## {name}", "", server["what"], ""]
        if server.get("gguf"):
            lines += [gguf_line(server["gguf"]), ""]
        if "error" in server:
            lines += [f"Failed: {server['error']}", ""]
            continue
        lines += ["| concurrency | requests | tokens | throughput tok/s | steady tok/s | x single | "
                  "TTFT p50 s | TTFT p95 s | TPOT p50 s | TPOT p95 s | TBT p95 s | tok/CPU-s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        single = server["levels"].get("1", {})
        base = single.get("steady_tok_s") or single.get("throughput_tok_s")
        for level in server["levels"].values():
            lines.append(
                f"| {level['concurrency']} | {level['requests']} | {level['output_tokens']} | "
                f"{_f(level['throughput_tok_s'], 1)} | {_f(level['steady_tok_s'], 1)} | "
                f"{_f(ratio(level['steady_tok_s'] or level['throughput_tok_s'], base))} | "
                f"{_f(level['ttft_p50_s'], 3)} | {_f(level['ttft_p95_s'], 3)} | {_f(level['tpot_p50_s'], 3)} | "
                f"{_f(level['tpot_p95_s'], 3)} | {_f(level.get('tbt_p95_s'), 3)} | "
                f"{_f(level.get('tok_per_cpu_s'), 1)} |")
        verdict = server["targets"]
        lines += ["", f"At {TARGET_CONCURRENCY} concurrent: steady throughput {_f(verdict.get('throughput_ratio'))}x "
                  f"a single request's (target >= {TARGET_THROUGHPUT_RATIO:g}x: "
                  f"{_met(verdict.get('throughput_met'))}); "
                  f"TTFT p95 {_f(verdict.get('ttft_p95_ratio'))}x TTFT alone (target <= {TARGET_TTFT_RATIO:g}x: "
                  f"{_met(verdict.get('ttft_met'))}); TBT p95 {_f(verdict.get('tbt_p95_ratio'))}x TBT p95 alone "
                  f"(target <= {TARGET_TBT_RATIO:g}x: {_met(verdict.get('tbt_met'))}).", ""]
        if server.get("same_text"):
            same = server["same_text"]
            lines += [f"Greedy text equal to the same prompt served alone: {same['equal']}/{same['compared']}.", ""]
        if server.get("utilisation"):
            lines += ["Engine busy (batch steps' wall time) / level wall time: " + ", ".join(
                f"{c}: {_f(u)}" for c, u in server["utilisation"].items()) + ".", ""]
    lines += scaling_table(result["servers"])
    lines += [result.get("notes", ""), ""]
    return "\n".join(lines)


def gguf_line(gguf: Mapping[str, Any]) -> str:
    """The GGUF a llama.cpp server ran: its file, size and how many tensors of each ggml type."""
    types = ", ".join(f"{count} {kind}" for kind, count in (gguf.get("tensor_types") or {}).items())
    return (f"GGUF: `{Path(str(gguf['path'])).name}`, {gguf['bytes'] / 2**20:.1f} MiB"
            + (f"; tensors: {types}." if types else "."))


def scaling(server: Mapping[str, Any]) -> dict[int, float | None]:
    """Concurrency -> steady throughput (the level's wall throughput where no steady window) over
    the same server's level 1."""
    levels = server.get("levels") or {}
    single = levels.get("1", {})
    base = single.get("steady_tok_s") or single.get("throughput_tok_s")
    return {int(c): ratio(level["steady_tok_s"] or level["throughput_tok_s"], base) for c, level in levels.items()}


def scaling_table(servers: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Throughput scaling from 1 concurrent request up, every server side by side (a server that
    failed or was absent shows why, in one cell)."""
    names = list(servers)
    by_server = {name: scaling(server) for name, server in servers.items()}
    levels = sorted({c for figures in by_server.values() for c in figures})
    if not names or not levels:
        return []
    lines = ["## Throughput scaling, side by side", "",
             "Steady output tokens/s at each concurrency over the same server's one request.", "",
             "| concurrency | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in levels:
        lines.append(f"| {c} | " + " | ".join(_f(by_server[name].get(c)) for name in names) + " |")
    lines += _at_target_table(servers)
    absent = [f"{name}: {server['error']}" for name, server in servers.items() if "error" in server]
    if absent:
        lines += ["", "Not measured: " + "; ".join(absent)]
    return [*lines, ""]


def _at_target_table(servers: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One row per measured server: its figures at 1 and at TARGET_CONCURRENCY and their ratios."""
    rows = []
    for name, server in servers.items():
        levels = server.get("levels") or {}
        alone, wide = levels.get("1"), levels.get(str(TARGET_CONCURRENCY))
        if alone is None or wide is None:
            continue
        verdict = server.get("targets") or {}
        rows.append(
            f"| {name} | {_f(alone.get('steady_tok_s') or alone.get('throughput_tok_s'), 1)} | "
            f"{_f(wide.get('steady_tok_s') or wide.get('throughput_tok_s'), 1)} | "
            f"{_f(verdict.get('throughput_ratio'))} | {_f(alone.get('ttft_p50_s'), 3)} | "
            f"{_f(wide.get('ttft_p95_s'), 3)} | {_f(verdict.get('ttft_p95_ratio'))} | "
            f"{_f(alone.get('tbt_p95_s'), 3)} | {_f(wide.get('tbt_p95_s'), 3)} | {_f(verdict.get('tbt_p95_ratio'))} | "
            f"{_f(alone.get('tok_per_cpu_s'), 1)} | {_f(wide.get('tok_per_cpu_s'), 1)} | "
            f"{_f(ratio(wide.get('tok_per_cpu_s'), alone.get('tok_per_cpu_s')))} |")
    if not rows:
        return []
    c = TARGET_CONCURRENCY
    return ["", f"At 1 and {c} concurrent, side by side (each server against its own one request):", "",
            f"| server | tok/s at 1 | tok/s at {c} | scaling 1 -> {c} | TTFT p50 alone s | TTFT p95 at {c} s | "
            f"÷ alone | TBT p95 alone s | TBT p95 at {c} s | ÷ alone | tok/CPU-s at 1 | tok/CPU-s at {c} | "
            f"CPU scaling 1 -> {c} |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|", *rows]


def plot_serve(result: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, server in result["servers"].items():
        levels = list(server.get("levels", {}).values())
        if not levels:
            continue
        xs = [level["concurrency"] for level in levels]
        left.plot(xs, [level["steady_tok_s"] or level["throughput_tok_s"] or 0 for level in levels], "o-", label=name)
        right.plot(xs, [level["ttft_p95_s"] or 0 for level in levels], "o-", label=f"{name} TTFT p95")
    left.set(xlabel="concurrent requests", ylabel="output tokens/s (steady)", title="throughput")
    right.set(xlabel="concurrent requests", ylabel="seconds", title="time to first token, p95")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
