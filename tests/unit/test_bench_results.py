"""Every benchmark result records the commit, the load at start and end and the wall time, and a
result taken on a busy machine says so in its first line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from warmpool_bench.results import RunRecord, current_commit, with_provenance, write_results

pytestmark = pytest.mark.unit


def _run(start: float, end: float, monkeypatch: pytest.MonkeyPatch) -> RunRecord:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (start, 0.0, 0.0))
    run = RunRecord(commit="abc123")
    monkeypatch.setattr(os, "getloadavg", lambda: (end, 0.0, 0.0))
    return run


def test_a_quiet_run_records_commit_load_and_wall_time_in_both_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(0.4, 1.2, monkeypatch)
    json_path, md_path = write_results({"benchmark": "x"}, tmp_path, "x", "# warmpool bench x\n\nbody\n", run)
    recorded = json.loads(json_path.read_text())["run"]
    assert recorded["commit"] == "abc123" and recorded["loadavg_start"][0] == 0.4
    assert recorded["loadavg_end"][0] == 1.2 and recorded["busy"] is False and recorded["wall_s"] >= 0
    lines = md_path.read_text().splitlines()
    assert lines[0] == "# warmpool bench x"
    assert lines[2].startswith("Commit `abc123`;") and "0.40 at the start, 1.20 at the end" in lines[2]
    assert lines[-1] == "body"


@pytest.mark.parametrize(("start", "end"), [(4.4, 1.0), (0.5, 2.5)])
def test_a_run_above_one_task_per_cpu_at_either_end_says_so_in_its_first_line(
        start: float, end: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(start, end, monkeypatch)
    _, md_path = write_results({"benchmark": "x"}, tmp_path, "x", "# warmpool bench x\n", run)
    first = md_path.read_text().splitlines()[0]
    assert first.startswith("# warmpool bench x (taken on a busy machine:")
    assert f"{start:.2f} at the start, {end:.2f} at the end, above 2 on 2 CPUs" in first


def test_rendering_again_from_the_json_keeps_the_record_and_an_old_result_is_left_as_it_was(
        monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(3.0, 3.0, monkeypatch).so_far()
    assert with_provenance({"run": run}, "# t\nrest\n").startswith("# t (taken on a busy machine")
    assert with_provenance({}, "# t\nrest\n") == "# t\nrest\n"
    assert with_provenance({"run": run, "benchmark": "y"}, "no title\n").startswith("# warmpool bench y (taken")


def test_the_commit_says_when_the_work_tree_has_changes(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("a")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = current_commit(tmp_path)
    assert len(head) == 40 and "+" not in head
    (tmp_path / "f").write_text("b")
    assert current_commit(tmp_path) == head + "+changes"
    assert current_commit(tmp_path / "nowhere") == "unknown"
