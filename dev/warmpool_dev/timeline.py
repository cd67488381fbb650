"""Cold-start timelines: read the phase metrics of worker pods, tabulate them, chart them.

Used by the demo and the end-to-end tests. The phase names and metric names come from
`warmpool.contract`; a phase a worker has not reached yet is absent, never 0.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from warmpool.contract.http import PATH_METRICS
from warmpool.contract.metrics import LABEL_PHASE, METRIC_PHASE_DURATION, PHASES

SCRAPE_TIMEOUT_S = 3.0


@dataclass
class PodTimeline:
    """One worker's cold start: seconds from process start to each phase reached."""

    pod: str
    phases: dict[str, float] = field(default_factory=dict)
    first_ttft_s: float | None = None
    steady_ttft_s: float | None = None


def parse_phase_metric(metrics_text: str, metric: str = METRIC_PHASE_DURATION) -> dict[str, float]:
    """{phase: value} of one phase-labelled series from a worker's /metrics text (by default the
    seconds since process start; METRIC_PHASE_TIMESTAMP gives the Unix times)."""
    phases: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == metric and LABEL_PHASE in sample.labels:
                phases[sample.labels[LABEL_PHASE]] = float(sample.value)
    return phases


def scrape_phases(base_url: str, timeout: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """Phase durations of the worker at base_url (http://<pod IP>:<port>); {} if unreachable."""
    try:
        with urllib.request.urlopen(base_url + PATH_METRICS, timeout=timeout) as response:
            text = response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError):
        return {}
    try:
        return parse_phase_metric(text)
    except ValueError:
        return {}


def phase_table(timelines: Sequence[PodTimeline]) -> str:
    """A plain-text table: one row per pod, one column per phase (s since process start)."""
    headers = ["pod", *PHASES[1:], "first TTFT", "steady TTFT", "first/steady"]
    rows: list[list[str]] = []
    for line in timelines:
        cells = [line.pod]
        cells += [f"{line.phases[p]:.2f}s" if p in line.phases else "-" for p in PHASES[1:]]
        cells.append(f"{line.first_ttft_s * 1000:.0f}ms" if line.first_ttft_s is not None else "-")
        cells.append(f"{line.steady_ttft_s * 1000:.0f}ms" if line.steady_ttft_s is not None else "-")
        if line.first_ttft_s is not None and line.steady_ttft_s:
            cells.append(f"{line.first_ttft_s / line.steady_ttft_s:.2f}")
        else:
            cells.append("-")
        rows.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(out)


def render_waterfall(timelines: Sequence[PodTimeline], path: Path, title: str) -> Path:
    """A PNG waterfall: per pod, one bar segment per phase, from process start to ready."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to a file
    import matplotlib.pyplot as plt

    colours = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.7 * max(1, len(timelines))))
    for row, line in enumerate(timelines):
        previous = 0.0
        for index, phase in enumerate(PHASES[1:]):
            if phase not in line.phases:
                continue
            end = line.phases[phase]
            ax.barh(row, max(end - previous, 0.0), left=previous, color=colours[index % len(colours)],
                    label=phase if row == 0 else None, edgecolor="white")
            previous = end
        if line.first_ttft_s is not None:
            ax.barh(row, line.first_ttft_s, left=previous, color="#937860",
                    label="first request TTFT" if row == 0 else None, edgecolor="white")
    ax.set_yticks(range(len(timelines)), [line.pod for line in timelines])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since worker process start")
    ax.set_title(title)
    # Below the axes, so the legend never hides a bar.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, fontsize="small", frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def measure_ttft(base_url: str, model: str, prompt: str, max_tokens: int = 8,
                 timeout: float = 60.0) -> float:
    """Seconds from sending a streaming completion to its first token chunk."""
    import json

    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "temperature": 0}).encode()
    request = urllib.request.Request(base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode("utf-8", errors="replace").strip()
            if line.startswith("data:") and line != "data: [DONE]":
                return time.perf_counter() - started
    raise RuntimeError(f"{base_url} streamed no token")
