"""A benchmark's results on disk: the raw JSON and its Markdown rendering, side by side, each with
the run's provenance (``RunRecord``): the commit measured, the load average at start and end, the
wall time.  A result taken on a busy machine says so in its first line (the title), since every
figure from it is noisier than one from a quiet machine.

Its own module so that every benchmark's command line (cli, predict_cli) writes results
the same way without importing another command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def busy_above() -> float:
    """The load average above which a result is marked as taken on a busy machine: one runnable
    task per CPU (2 on the 2-core dev machine)."""
    return float(os.cpu_count() or 1)


def current_commit(repo: Path = REPO) -> str:
    """HEAD's hash, with ``+changes`` when the work tree differs from it ("unknown" outside git)."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


@dataclass
class RunRecord:
    """Started when a benchmark command starts; read each time its results are written."""

    commit: str = field(default_factory=current_commit)
    started_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    loadavg_start: tuple[float, float, float] = field(default_factory=lambda: os.getloadavg())
    _started: float = field(default_factory=time.monotonic)

    def so_far(self) -> dict[str, Any]:
        end = os.getloadavg()
        wall_s = round(time.monotonic() - self._started, 1)
        return {"commit": self.commit, "started_at": self.started_at, "wall_s": wall_s,
                "loadavg_start": list(self.loadavg_start), "loadavg_end": list(end), "cpus": os.cpu_count(),
                "busy": max(self.loadavg_start[0], end[0]) > busy_above()}


def busy_note(run: Mapping[str, Any]) -> str:
    """What a result's first line says when it was taken on a busy machine ("" when it was not)."""
    if not run.get("busy"):
        return ""
    return (f" (taken on a busy machine: load average {run['loadavg_start'][0]:.2f} at the start, "
            f"{run['loadavg_end'][0]:.2f} at the end, above {busy_above():g} on {run.get('cpus')} CPUs; "
            "its figures are noisier than a quiet machine's)")


def provenance_line(run: Mapping[str, Any]) -> str:
    return (f"Commit `{run['commit']}`; started {run['started_at']}; load average (1 min) "
            f"{run['loadavg_start'][0]:.2f} at the start, {run['loadavg_end'][0]:.2f} at the end; "
            f"wall time {run['wall_s']:.0f} s.")


def with_provenance(result: Mapping[str, Any], markdown: str) -> str:
    """The rendering with the run's record: a busy machine said in the title line (the first), then
    the commit, load and wall time.  A result written before runs were recorded is left as it is."""
    run = result.get("run")
    if not run:
        return markdown
    title, _, rest = markdown.partition("\n")
    if not title.startswith("# "):  # every renderer opens with its title; one that did not gets one
        title, rest = f"# warmpool bench {result.get('benchmark', '')}".rstrip(), markdown
    return f"{title}{busy_note(run)}\n\n{provenance_line(run)}\n{rest}"


def write_results(result: dict[str, Any], out: Path, name: str, markdown: str,
                  run: RunRecord | None = None) -> tuple[Path, Path]:
    """Write ``<name>.json`` and ``<name>.md`` under ``out``; with ``run``, both record it."""
    if run is not None:
        result["run"] = run.so_far()
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    md_path.write_text(with_provenance(result, markdown))
    return json_path, md_path
