"""The README's own order works: `make test` after `make demo` is refused in its first second,
before any build, naming `make demo-down` (the demo leaves its cluster, and so the machine's one
real node, up for exploring); `make help` lists the targets; no declared target lacks a rule; a
half-made `.venv` is made again.

The real-node records here are fakes in a cache directory of the test's own, written the way
cluster.py writes them (``clusters/<name>/cluster.json``, a live pid): no cluster starts or stops.
`make` runs with ``MAKE`` replaced by an echo, so a check that wrongly let the suite through
would print a line instead of building anything.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warmpool_devcluster import node_holder

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SUITE_WOULD_RUN = "SUITE-WOULD-RUN"


def _finished_pid() -> int:
    """The pid of a process that has exited (and been reaped): not alive."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _record(root: Path, name: str, *, real_node: bool, pid: int) -> None:
    """A cluster record as cluster.py saves it: control-plane pids, and the node's when it has one."""
    directory = root / "clusters" / name
    directory.mkdir(parents=True)
    node = {"octet": 11, "pids": {"kubelet": pid}, "ports": {}} if real_node else None
    directory.joinpath(node_holder.RECORD).write_text(json.dumps(
        {"name": name, "ports": {}, "pids": {"kube-apiserver": pid}, "node": node, "controllers": True}))


def _make(*args: str, cache: Path, suite_cluster: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMPOOL_") and k != "MAKEFLAGS"}
    env["WARMPOOL_CACHE_DIR"] = str(cache)
    if suite_cluster is not None:
        env["WARMPOOL_TEST_CLUSTER"] = suite_cluster
    return subprocess.run(["make", "--no-print-directory", *args, f"MAKE=echo {SUITE_WOULD_RUN}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)


def test_make_test_after_make_demo_is_refused_at_once_naming_make_demo_down(tmp_path: Path) -> None:
    _record(tmp_path, "demo", real_node=True, pid=os.getpid())
    started = time.monotonic()
    result = _make("test", cache=tmp_path)
    assert time.monotonic() - started < 10  # the first second, give or take a loaded machine
    assert result.returncode != 0
    assert SUITE_WOULD_RUN not in result.stdout  # nothing built, the suite never started
    assert "cluster 'demo' runs this machine's one real node" in result.stderr
    assert "stop it first: make demo-down" in result.stderr


def test_the_suites_own_cluster_may_hold_the_node(tmp_path: Path) -> None:
    """WARMPOOL_TEST_CLUSTER=dev with `dev` up (the shared dev cluster): the suite reuses it."""
    _record(tmp_path, "dev", real_node=True, pid=os.getpid())
    _record(tmp_path, "dev-api", real_node=False, pid=os.getpid())
    result = _make("test", cache=tmp_path, suite_cluster="dev")
    assert result.returncode == 0, result.stderr
    assert SUITE_WOULD_RUN in result.stdout


def test_another_cluster_with_the_node_is_named_with_its_own_stop_command(tmp_path: Path) -> None:
    _record(tmp_path, "dev", real_node=True, pid=os.getpid())
    refusal = node_holder.suite_refusal(tmp_path / "clusters", "pytest-1")
    assert refusal is not None
    assert "warmpool cluster down --name dev" in refusal and "WARMPOOL_TEST_CLUSTER=dev make test" in refusal


def test_stopped_clusters_and_clusters_without_a_real_node_hold_nothing(tmp_path: Path) -> None:
    _record(tmp_path, "demo", real_node=True, pid=_finished_pid())  # left behind by a crash
    _record(tmp_path, "bench", real_node=False, pid=os.getpid())  # kwok fake nodes only
    (tmp_path / "clusters" / "garbled").mkdir()
    (tmp_path / "clusters" / "garbled" / node_holder.RECORD).write_text("{not json")
    assert node_holder.holders(tmp_path / "clusters") == []
    assert node_holder.holders(tmp_path / "nothing-here") == []
    assert _make("real-node-free", cache=tmp_path).returncode == 0


def test_the_check_runs_on_the_system_python_without_the_venv(tmp_path: Path) -> None:
    """`make test` asks before `.venv` exists: the module imports nothing outside the standard library."""
    _record(tmp_path, "demo", real_node=True, pid=os.getpid())
    python = shutil.which("python3") or sys.executable
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": "devcluster:dev", "PYTHONNOUSERSITE": "1",
           "WARMPOOL_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([python, "-S", "-m", "warmpool_devcluster.node_holder"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "make demo-down" in result.stderr, result.stderr


def _phony_targets(makefile: str) -> set[str]:
    joined = makefile.replace("\\\n", " ")
    return {name for line in re.findall(r"^\.PHONY:(.*)$", joined, re.M) for name in line.split()}


def test_make_help_lists_the_targets_and_no_declared_target_lacks_a_rule() -> None:
    makefile = (REPO / "Makefile").read_text()
    rules = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, re.M))
    assert _phony_targets(makefile) - rules == set()
    assert "typecheck" not in _phony_targets(makefile)
    shown = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True,
                           timeout=30, env={k: v for k, v in os.environ.items() if k != "MAKEFLAGS"})
    assert shown.returncode == 0
    listed = re.findall(r"^  make (\S+)", shown.stdout, re.M)
    assert {"demo", "demo-down", "test", "lint", "unit", "venv", "help"} <= set(listed)
    assert set(listed) <= rules
    # `make` alone explains rather than starts a multi-gigabyte install.
    bare = subprocess.run(["make", "--no-print-directory", "-n"], cwd=REPO, capture_output=True, text=True,
                          timeout=30, env={k: v for k, v in os.environ.items() if k != "MAKEFLAGS"})
    assert "pip install" not in bare.stdout


def test_the_object_store_demo_that_never_worked_is_gone() -> None:
    for path in ("Makefile", "README.md"):
        assert "demo-object-store" not in (REPO / path).read_text()
    assert "--object-store" not in subprocess.run(
        [sys.executable, "-m", "warmpool_dev.demo", "--help"], cwd=REPO, capture_output=True, text=True,
        timeout=60).stdout


def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_half_made_venv_is_made_again(tmp_path: Path) -> None:
    """A `.venv` whose pip does not run (what `python3 -m venv` leaves without python3-venv) is
    removed and made again; the stamp comes only after the installs succeeded."""
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    log = tmp_path / "calls.log"
    # The half-made venv: a python whose pip is missing.
    _script(tmp_path / ".venv" / "bin" / "python", "exit 1\n")
    # The system Python stand-in: `-m venv DIR` makes a venv whose python logs what it is asked.
    _script(tmp_path / "python3", f'[ "$1 $2" = "-m venv" ] || exit 3\nmkdir -p "$3/bin"\n'
                                  f'printf \'#!/bin/sh\\necho "$@" >> {log}\\n\' > "$3/bin/python"\n'
                                  'chmod +x "$3/bin/python"\n')
    env = {k: v for k, v in os.environ.items() if k != "MAKEFLAGS"}
    result = subprocess.run(["make", "--no-print-directory", "venv", f"PYTHON={tmp_path / 'python3'}",
                             "VENV_FREE_GIB=0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert ".venv is half made (its python or pip does not run): making it again" in result.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "-m pip --version" and any(c.startswith("-m pip install") and "-e" in c for c in calls)
    assert list((tmp_path / ".venv").glob(".installed-*"))


def test_a_venv_without_pip_names_python3_venv(tmp_path: Path) -> None:
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    # Debian's python3 without python3-venv: the venv's python runs, its pip does not exist.
    _script(tmp_path / "python3", 'mkdir -p "$3/bin"\nprintf \'#!/bin/sh\\nexit 1\\n\' > "$3/bin/python"\n'
                                  'chmod +x "$3/bin/python"\nexit 1\n')
    env = {k: v for k, v in os.environ.items() if k != "MAKEFLAGS"}
    result = subprocess.run(["make", "--no-print-directory", "venv", f"PYTHON={tmp_path / 'python3'}",
                             "VENV_FREE_GIB=0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "install python3-venv (apt-get install python3-venv)" in result.stderr
    assert not (tmp_path / ".venv").exists()


def test_make_unit_keeps_bytecode_in_a_cache_outside_the_tree_and_passes_on_pytests_status(tmp_path: Path) -> None:
    """With PYTHONDONTWRITEBYTECODE set, pytest rewrote every test module and each `warmpool` subprocess
    compiled the checkout at every run: `make unit` gives them a bytecode cache under the project's cache
    directory instead (never the tree), drops the run's temporary directories' share of it, and still
    fails as pytest failed.  A stand-in pytest in a venv whose install stamp is current records what it got."""
    venv, cache = tmp_path / "venv", tmp_path / "cache"
    (venv / "bin").mkdir(parents=True)
    stamp = subprocess.run("cat pyproject.toml | cksum | cut -d' ' -f1", shell=True, cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.strip()
    (venv / f".installed-{stamp}").touch()
    seen, fake_tmp = tmp_path / "seen.json", tmp_path / "tmp"
    pytest_stub = venv / "bin" / "pytest"
    pytest_stub.write_text(f"""#!{sys.executable}
import json, os, pathlib, sys
prefix = os.environ["PYTHONPYCACHEPREFIX"]
pathlib.Path(prefix + {str(fake_tmp)!r}).mkdir(parents=True)  # bytecode of a module in the run's TMPDIR
pathlib.Path({str(seen)!r}).write_text(json.dumps(
    {{"args": sys.argv[1:], "prefix": prefix, "dont_write": os.environ.get("PYTHONDONTWRITEBYTECODE")}}))
sys.exit(3)
""")
    pytest_stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMPOOL_") and k != "MAKEFLAGS"}
    env |= {"WARMPOOL_CACHE_DIR": str(cache), "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(fake_tmp)}
    pyproject_mtime = (REPO / "pyproject.toml").stat().st_mtime
    os.utime(venv / f".installed-{stamp}", (pyproject_mtime + 1, pyproject_mtime + 1))
    run = subprocess.run(["make", "--no-print-directory", "unit", f"VENV={venv}"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0, run.stdout + run.stderr  # pytest's failure is make's
    got = json.loads(seen.read_text())
    assert got["args"] == ["-m", "unit"] and not got["dont_write"]
    assert Path(got["prefix"]) == cache / "pycache"
    assert not (cache / "pycache" / fake_tmp.relative_to("/")).exists()  # the run's temporary share is gone
