"""Undo what a real node leaves on the machine: pod processes and shims, mounts, cgroups,
sysctls and the kubelet's and kube-proxy's iptables chains.

The kubelet does not stop its pods when it exits, containerd's shims outlive containerd, and the
kubelet writes sysctls, bind-mounts its root directory and adds iptables chains of its own.
``cluster down`` calls :func:`clean` after stopping the processes it started; each step works
from what is on the machine now (mount table, cgroup tree, process list), so a half-started or
crashed node is cleaned as well as a healthy one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: The kubelet's QoS cgroup (cgroupsPerQOS, cgroupfs driver), under every v1 hierarchy.
KUBEPODS = "kubepods"
#: Every host setting a real node changes, saved before it changes any and restored by ``down``:
#: the kubelet's kernel tunables (it sets all six at start: overcommit always, no panic on OOM,
#: reboot 10 s after a panic, panic on oops, and the root keyring quotas), IP forwarding (the CNI
#: bridge plugin turns it on with the first pod) and bridged traffic through iptables (the node
#: turns it on: see node.start_network).
SYSCTLS = (
    "vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes",
    "net.ipv4.ip_forward", "net.bridge.bridge-nf-call-iptables",
)
#: The kubelet's own chains (kube-proxy removes its own with --cleanup).
KUBELET_CHAINS = ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT", "KUBE-PROXY-CANARY")


class SysctlRecordError(RuntimeError):
    """The record of the host's settings could not be read; the message names the file."""


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctls() -> dict[str, str]:
    """The current value of each of SYSCTLS this kernel has."""
    values = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            values[name] = _sysctl_path(name).read_text().strip()
    return values


def record_sysctls(record: Path) -> dict[str, str]:
    """Save the host's values of SYSCTLS in ``record`` before the node changes any, and return them.

    A record already there is kept as it is: it is what a node that crashed, and was never taken
    down, saved before it changed the host; the values on the machine now are that node's.
    """
    if record.exists():
        return load_sysctl_record(record)
    values = read_sysctls()
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_suffix(".tmp")
    partial.write_text(json.dumps(values, indent=2, sort_keys=True))
    partial.replace(record)  # the record is whole or absent, even if this process dies here
    return values


def load_sysctl_record(record: Path) -> dict[str, str]:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError) as error:
        raise SysctlRecordError(f"the record of the host's settings {record} is unreadable: {error}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise SysctlRecordError(f"the record of the host's settings {record} is not a map of names to values")
    return data


def restore_sysctls(record: Path) -> list[str]:
    """Write back every value ``record`` holds, then remove it; the settings that could not be
    restored are returned (and the record kept, so a later ``down`` tries again)."""
    if not record.exists():
        return []
    try:
        saved = load_sysctl_record(record)
    except SysctlRecordError as error:
        return [str(error)]
    problems = []
    for name, value in saved.items():
        try:
            if _sysctl_path(name).read_text().strip() != value:
                _sysctl_path(name).write_text(value)
            if _sysctl_path(name).read_text().strip() != value:
                problems.append(f"sysctl {name} is not back to {value!r}")
        except OSError as error:
            problems.append(f"sysctl {name} could not be restored to {value!r}: {error}")
    if not problems:
        record.unlink()
    return problems


def set_sysctl(name: str, value: str) -> None:
    _sysctl_path(name).write_text(value)


def cgroup_hierarchies() -> list[Path]:
    """Each mounted cgroup v1 hierarchy (its aliases, symlinks such as ``cpu``, left out)."""
    if not CGROUP_ROOT.is_dir():
        return []
    return sorted(h for h in CGROUP_ROOT.iterdir() if h.is_dir() and not h.is_symlink())


def kubepods_cgroups(parent: str = "") -> list[Path]:
    """Every kubepods cgroup directory below ``parent`` (a further node's cgroupRoot; "" for node
    0's, at the top), deepest first (the order rmdir needs)."""
    found: list[Path] = []
    for hierarchy in cgroup_hierarchies():
        top = hierarchy / parent / KUBEPODS if parent else hierarchy / KUBEPODS
        if top.is_dir():
            found.extend(Path(p) for p, _, _ in os.walk(top))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _pids_in(cgroups: list[Path]) -> set[int]:
    pids: set[int] = set()
    for group in cgroups:
        with contextlib.suppress(OSError):
            pids.update(int(line) for line in (group / "cgroup.procs").read_text().split())
    return pids


def kill_pod_processes(timeout: float = 10.0, parent: str = "") -> int:
    """SIGKILL every process in a kubepods cgroup below ``parent`` (the pods' containers and pause
    processes)."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = _pids_in(kubepods_cgroups(parent))
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed |= pids
        time.sleep(0.2)
    return len(killed)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def kill_shims(containerd_socket: Path) -> int:
    """SIGKILL containerd-shim processes started by the containerd serving ``containerd_socket``."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = _cmdline(int(entry.name))
        if argv and Path(argv[0]).name.startswith("containerd-shim") and str(containerd_socket) in argv:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                count += 1
    return count


def remove_cgroups(timeout: float = 10.0, parent: str = "") -> list[Path]:
    """rmdir every kubepods cgroup below ``parent``, then ``parent`` itself; the ones still there
    after ``timeout`` (busy) are returned."""
    deadline = time.monotonic() + timeout

    def left_now() -> list[Path]:
        tops = [h / parent for h in cgroup_hierarchies() if parent and (h / parent).is_dir()]
        return kubepods_cgroups(parent) + tops

    left = left_now()
    while left and time.monotonic() < deadline:
        for group in left:
            with contextlib.suppress(OSError):
                group.rmdir()
        left = left_now()
        if left:
            time.sleep(0.2)
    return left


def mounts_under(roots: list[Path]) -> list[str]:
    """Mount points at or below any of ``roots``, deepest first (/proc/self/mountinfo's 5th field)."""
    prefixes = [str(root.resolve()) for root in roots]
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == prefix or point.startswith(prefix + "/") for prefix in prefixes):
            found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def unmount_under(roots: list[Path]) -> list[str]:
    """Unmount everything below ``roots`` (overlay rootfs, pod volumes, network namespaces, the
    kubelet's bind mount of its root dir); what would not unmount even lazily is returned."""
    for _ in range(5):  # a mount may be stacked several times (bind mounts of bind mounts)
        points = mounts_under(roots)
        if not points:
            return []
        for point in points:
            if subprocess.run(["umount", point], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", point], capture_output=True)
    return mounts_under(roots)


def _iptables_rules(tool: str, table: str) -> list[str]:
    proc = subprocess.run([tool, "-w", "-t", table, "-S"], capture_output=True, text=True)
    return proc.stdout.splitlines() if proc.returncode == 0 else []


def remove_kubelet_chains() -> None:
    """Drop the kubelet's chains (and the rules jumping to them) in iptables and ip6tables."""
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            rules = _iptables_rules(tool, table)
            for rule in rules:
                parts = shlex.split(rule)
                if parts[:1] == ["-A"] and parts[1] not in KUBELET_CHAINS and any(
                        f"-j {chain}" in rule for chain in KUBELET_CHAINS):
                    subprocess.run([tool, "-w", "-t", table, "-D", *parts[1:]], capture_output=True)
            for chain in KUBELET_CHAINS:
                if any(rule == f"-N {chain}" for rule in rules):
                    subprocess.run([tool, "-w", "-t", table, "-F", chain], capture_output=True)
                    subprocess.run([tool, "-w", "-t", table, "-X", chain], capture_output=True)


def leftover_kube_chains() -> list[str]:
    """``tool table chain`` of every KUBE-* chain still on the machine (none after a clean down)."""
    left = []
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            left += [f"{tool} {table} {rule.split()[1]}" for rule in _iptables_rules(tool, table)
                     if rule.startswith("-N KUBE-")]
    return left
