"""Every figure the README quotes comes from somewhere in the repository: a measured one from a
results file under bench/results/ (the benchmarks', or setup-times.json and demo-coldstart.json for
the build times and the demo's output), a setting from the code that owns it.  A figure that is
neither fails here, naming it: put its measurement in a results file, or remove it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
#: Durations, sizes, shares and counts, as the README writes them ("1 min 51 s", "3.17s", "12 GiB", "70 %").
FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?: min \d+ s|\s?(?:ms|s|min|GiB|MiB|KiB|%)| tests))(?!\w)")
#: Settings the README quotes: figure -> (the file that owns it, what that file says).
SETTINGS: dict[str, tuple[str, str]] = {
    "70 %": ("warmpool/contract/api.py", "DEFAULT_TRUNCATE_AT_PERCENT = 70"),
    "89 %": ("warmpool/contract/api.py", "DEFAULT_PAUSE_AT_PERCENT = 90"),  # truncated's top: below the pause
    "90 %": ("warmpool/contract/api.py", "DEFAULT_PAUSE_AT_PERCENT = 90"),
    "12 GiB": ("Makefile", "VENV_FREE_GIB := 12"),
    "70 s": ("operator/warmpool_operator/settings.py", "watch_inactivity_timeout: float = 70.0"),
    "600 s": ("operator/warmpool_operator/settings.py", "resync_interval: float = 600.0"),
    "30 s": ("operator/warmpool_operator/settings.py", "30 s at the default 10 s scrape"),
    "768 KiB": ("operator/warmpool_operator/io/history_store.py", "max_bytes: int = 768 * 1024"),
    "25 s": ("operator/warmpool_operator/rules/node_leases.py", "DEFAULT_GRACE_S = 25.0"),
    "35 s": ("operator/warmpool_operator/rules/node_leases.py", "15-35 s after its kubelet died"),
    "4 MiB": ("nodecache/warmpool_nodecache/manifest.py", "DEFAULT_BLOCK_SIZE = 4 * 1024 * 1024"),
}


def _results_text() -> str:
    return "\n".join(path.read_text() for path in sorted((REPO / "bench" / "results").iterdir())
                     if path.suffix in (".json", ".md"))


def test_every_figure_in_the_readme_has_a_source() -> None:
    readme = (REPO / "README.md").read_text()
    results = _results_text()
    unsourced = []
    for match in FIGURE.finditer(readme):
        figure = match.group(1)
        if figure in results:
            continue
        if figure in SETTINGS:
            path, says = SETTINGS[figure]
            assert says in (REPO / path).read_text(), f"{figure}: {path} no longer says {says!r}"
            continue
        line = readme.count("\n", 0, match.start()) + 1
        unsourced.append(f"README.md:{line}: {figure}")
    assert unsourced == []


def test_the_demo_table_is_the_recorded_one() -> None:
    """The table's rows, figure for figure, as bench/results/demo-coldstart.json holds them."""
    import json

    recorded = json.loads((REPO / "bench" / "results" / "demo-coldstart.json").read_text())
    readme = (REPO / "README.md").read_text()
    for pod in recorded["pods"]:
        row = next(line for line in readme.splitlines() if line.startswith(pod["pod"]))
        assert row.split() == [pod["pod"], pod["weights_mapped"], pod["first_layer_ready"], pod["warmup_done"],
                               pod["ready"], pod["first_ttft"], pod["steady_ttft"], pod["first/steady"]]
