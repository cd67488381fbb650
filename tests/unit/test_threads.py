"""torch's intra-op threads follow the pod's CPU quota (cgroup v2 cpu.max), not the node's cores."""

from __future__ import annotations

from pathlib import Path

import pytest
from warmpool_worker.cpu_threads import ThreadChoice, choose_threads, own_cgroup_dirs, threads_from_cpu_max

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("cpu_max", "cpus", "threads"),
    [
        ("max 100000\n", 8, 8),  # no quota: every CPU we may run on
        ("max 100000", 2, 2),
        ("150000 100000\n", 8, 1),  # 1.5 CPUs: one thread, never throttled
        ("250000 100000", 8, 2),
        ("400000 100000", 8, 4),
        ("50000 100000\n", 8, 1),  # half a CPU: still one thread, never zero
        ("1600000 100000", 4, 4),  # a quota above the cpuset: capped by the CPUs available
        ("200000 50000", 16, 4),  # another period
        ("", 6, 6),  # garbage: we know nothing better than the CPU count
        ("garbage", 6, 6),
        ("100000", 6, 6),
        ("-1 100000", 6, 6),
        ("0 100000", 6, 6),
        ("100000 0", 6, 6),
        ("abc 100000", 6, 6),
        (None, 3, 3),  # no cpu.max file at all (cgroup v1, or no cpu controller)
        ("max 100000", 0, 1),  # a CPU count of 0 still means one thread
    ],
)
def test_threads_from_cpu_max(cpu_max: str | None, cpus: int, threads: int) -> None:
    assert threads_from_cpu_max(cpu_max, cpus) == threads


def _proc_self_cgroup(tmp_path: Path, line: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(f"4:memory:/something-v1\n{line}\n")
    return path


def test_own_cgroup_dirs_walks_from_the_process_cgroup_up_to_the_root(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = _proc_self_cgroup(tmp_path, "0::/kubepods.slice/pod1/ctr")
    assert own_cgroup_dirs(root, proc) == [
        root / "kubepods.slice/pod1/ctr",
        root / "kubepods.slice/pod1",
        root / "kubepods.slice",
        root,
    ]
    assert own_cgroup_dirs(root, _proc_self_cgroup(tmp_path, "0::/")) == [root]  # a cgroup namespace
    assert own_cgroup_dirs(root, _proc_self_cgroup(tmp_path, "0::/../../etc")) == [root]
    assert own_cgroup_dirs(root, tmp_path / "absent") == [root]


def test_the_strictest_quota_on_the_path_wins(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    container = root / "kubepods.slice" / "pod1" / "ctr"
    container.mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "kubepods.slice" / "cpu.max").write_text("garbage\n")
    (root / "kubepods.slice" / "pod1" / "cpu.max").write_text("100000 100000\n")  # the pod: 1 CPU
    (container / "cpu.max").write_text("300000 100000\n")  # the container asks for 3
    proc = _proc_self_cgroup(tmp_path, "0::/kubepods.slice/pod1/ctr")
    choice = choose_threads(None, root, proc, {})
    assert choice.threads == 1
    assert str(root / "kubepods.slice" / "pod1" / "cpu.max") in choice.source


def test_requested_threads_win_over_the_cgroup(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cpu.max").write_text("100000 100000\n")
    choice = choose_threads(3, root, _proc_self_cgroup(tmp_path, "0::/"), {})
    assert (choice.threads, choice.source) == (3, "--threads")


def test_no_cgroup_means_every_available_cpu(tmp_path: Path) -> None:
    import os

    choice = choose_threads(None, tmp_path / "no-cgroup-here", tmp_path / "absent", {})
    assert choice.threads == len(os.sched_getaffinity(0))
    assert "no cgroup v2 CPU quota" in choice.source


def test_an_explicit_omp_num_threads_is_kept_and_garbage_ignored(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cpu.max").write_text("100000 100000\n")
    proc = _proc_self_cgroup(tmp_path, "0::/")
    assert choose_threads(None, root, proc, {"OMP_NUM_THREADS": "3"}) == ThreadChoice(3, "OMP_NUM_THREADS=3")
    assert choose_threads(2, root, proc, {"OMP_NUM_THREADS": "3"}).source == "--threads"
    # "\u00b2" passed str.isdigit() and int() then raised: the worker did not start.
    for garbage in ("zero", "0", "-2", "1.5", "\u00b2", "\u0663", "\uff13", "+3", "3_0", "9" * 5000):
        assert choose_threads(None, root, proc, {"OMP_NUM_THREADS": garbage}).threads == 1  # the cgroup's
