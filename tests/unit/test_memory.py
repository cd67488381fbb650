"""Memory probes: each source on real or faked kernel files, and real allocations moving the figure."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warmpool_worker.memory import (
    CGROUP_V1_UNLIMITED,
    ChainProbe,
    ConfiguredCapacityProbe,
    MemoryReading,
    NvmlProbe,
    cgroup_reading,
    cgroup_v1_reading,
    make_probe,
    meminfo_reading,
    process_tree,
    rss_bytes,
)

pytestmark = pytest.mark.unit

MIB = 1024 * 1024


def test_meminfo_fake(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    250 kB\n")
    reading = meminfo_reading(path)
    assert reading == MemoryReading(used_bytes=750 * 1024, capacity_bytes=1000 * 1024, source="meminfo")
    assert reading.ratio == pytest.approx(0.75)


def test_meminfo_garbage(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal: lots\n")
    assert meminfo_reading(path) is None
    assert meminfo_reading(tmp_path / "absent") is None


def test_meminfo_real() -> None:
    reading = meminfo_reading()
    assert reading is not None and 0 < reading.ratio < 1


def _cgroup(root: Path, current: str, limit: str, inactive_file: int = 0) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.current").write_text(current)
    (root / "memory.max").write_text(limit)
    (root / "memory.stat").write_text(f"anon 1\ninactive_file {inactive_file}\nactive_file 3\n")


def test_cgroup_limited(tmp_path: Path) -> None:
    _cgroup(tmp_path / "kubepods" / "pod1", "800\n", "1000\n", inactive_file=100)
    proc_cgroup = tmp_path / "self-cgroup"
    proc_cgroup.write_text("0::/kubepods/pod1\n")
    reading = cgroup_reading(tmp_path, proc_cgroup)
    assert reading == MemoryReading(700, 1000, "cgroup")  # working set: inactive file pages excluded


def test_cgroup_unlimited_falls_through(tmp_path: Path) -> None:
    _cgroup(tmp_path, "800\n", "max\n")
    assert cgroup_reading(tmp_path, tmp_path / "none") is None


def _cgroup_v1(root: Path, usage: int, limit: int, inactive_file: int = 0) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (root / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (root / "memory.stat").write_text(f"cache 5\nrss 1\ntotal_inactive_file {inactive_file}\ntotal_active_file 3\n")


def test_cgroup_v1_limited_as_a_container_sees_it(tmp_path: Path) -> None:
    """Inside a container on a cgroup v1 node: /proc/self/cgroup names the host's path, and the
    container's own memory cgroup is mounted at the hierarchy's root."""
    _cgroup_v1(tmp_path, usage=800, limit=1000, inactive_file=100)
    proc_cgroup = tmp_path / "self-cgroup"
    proc_cgroup.write_text("12:pids:/kubepods/pod1/c1\n5:memory:/kubepods/pod1/c1\n1:name=systemd:/x\n")
    assert cgroup_v1_reading(tmp_path, proc_cgroup) == MemoryReading(700, 1000, "cgroup")


def test_cgroup_v1_of_a_process_on_the_host(tmp_path: Path) -> None:
    _cgroup_v1(tmp_path / "kubepods" / "pod1", usage=600, limit=1000)
    _cgroup_v1(tmp_path, usage=5000, limit=CGROUP_V1_UNLIMITED * 8)  # the root: unlimited
    proc_cgroup = tmp_path / "self-cgroup"
    proc_cgroup.write_text("4:memory:/kubepods/pod1\n")
    assert cgroup_v1_reading(tmp_path, proc_cgroup) == MemoryReading(600, 1000, "cgroup")


def test_cgroup_v1_unlimited_falls_through(tmp_path: Path) -> None:
    _cgroup_v1(tmp_path, usage=800, limit=9223372036854771712)  # v1's "no limit"
    assert cgroup_v1_reading(tmp_path, tmp_path / "none") is None
    assert cgroup_v1_reading(tmp_path / "nothing", tmp_path / "none") is None


def test_cgroup_absent(tmp_path: Path) -> None:
    assert cgroup_reading(tmp_path / "nothing", tmp_path / "none") is None


def test_chain_takes_first_answer() -> None:
    calls: list[str] = []

    def none() -> MemoryReading | None:
        calls.append("none")
        return None

    def some() -> MemoryReading | None:
        calls.append("some")
        return MemoryReading(1, 2, "x")

    assert ChainProbe([none, some, none]).read() == MemoryReading(1, 2, "x")
    assert calls == ["none", "some"]
    assert ChainProbe([none]).read() is None


def test_cpu_chain_reads_host_memory() -> None:
    reading = make_probe("cpu").read()
    assert reading is not None and reading.source in {"cgroup", "meminfo"}


def test_nvml_without_gpu_disables_itself() -> None:
    probe = NvmlProbe(0)
    first = probe.read()
    if first is not None:  # a real GPU: fine, that is the point of NVML
        assert first.source == "nvml"
        return
    assert probe._broken
    assert probe.read() is None


def test_configured_capacity_follows_real_allocation() -> None:
    probe = ConfiguredCapacityProbe(capacity_bytes=4096 * MIB)
    before = probe.read()
    assert before is not None and before.source == "configured"
    # A fresh anonymous mapping with every page written: new resident memory whatever the
    # allocator holds.  (A 256 MiB bytes object could be served from pages malloc had kept
    # resident after an earlier test freed them: the figure then did not move, in one CI run.)
    ballast = mmap.mmap(-1, 256 * MIB)
    for offset in range(0, len(ballast), mmap.PAGESIZE):
        ballast[offset] = 1
    after = probe.read()
    assert after is not None
    assert after.used_bytes - before.used_bytes >= 200 * MIB
    ballast.close()  # munmap: the pages go back to the kernel at once
    released = probe.read()
    assert released is not None and released.used_bytes < after.used_bytes - 200 * MIB


def _ballast_process(megabytes: int) -> subprocess.Popen[bytes]:
    code = (
        "import sys, time\n"
        f"b = b'\\x01' * ({megabytes} * 1024 * 1024)\n"
        "sys.stdout.write('ok\\n'); sys.stdout.flush()\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None
    assert child.stdout.readline() == b"ok\n"
    return child


def test_children_and_accounted_pids_count() -> None:
    child = _ballast_process(128)
    try:
        assert child.pid in process_tree([os.getpid()])
        assert rss_bytes(child.pid) >= 128 * MIB
        own = ConfiguredCapacityProbe(1 << 40).read()
        assert own is not None and own.used_bytes >= rss_bytes(os.getpid()) + 128 * MIB
    finally:
        child.kill()
        child.wait(timeout=10)
    deadline = time.monotonic() + 5
    while child.pid in process_tree([os.getpid()]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.pid not in process_tree([os.getpid()])


def test_accounted_pid_outside_tree() -> None:
    probe = ConfiguredCapacityProbe(1 << 40, account_pids=[1])
    own = ConfiguredCapacityProbe(1 << 40).read()
    with_init = probe.read()
    assert own is not None and with_init is not None
    assert with_init.used_bytes >= own.used_bytes


def test_bad_capacity() -> None:
    with pytest.raises(ValueError):
        ConfiguredCapacityProbe(0)


@pytest.mark.parametrize(("device", "visible"), [("cuda:\u00b2", "0"), ("cuda:0", "\u00b2"), ("cuda:\u0661", "\uff11")])
def test_device_numbers_in_other_scripts_digits_are_not_read(monkeypatch: pytest.MonkeyPatch, device: str,
                                                              visible: str) -> None:
    """A "\u00b2" passed str.isdigit() and int() then raised: the worker did not start."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert make_probe(device) is not None
