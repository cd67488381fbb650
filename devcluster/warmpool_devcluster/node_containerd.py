"""The real node's container runtime: a containerd of the cluster's own, with the CRI plugin.

Debian's containerd 1.6 with runc, kept apart from any other containerd on the machine (dockerd's
own has CRI disabled): its socket and state live under the cluster's state directory.  Its
content store and snapshots (``root``) live in the machine-wide cache instead, so images loaded
once survive ``cluster down`` and a later cluster starts with them (one real-node cluster runs at
a time, so one containerd uses that root at a time).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import IO

from warmpool_dev.paths import cache_root

CONTAINERD = Path("/usr/bin/containerd")
CTR = Path("/usr/bin/ctr")
RUNC = Path("/usr/sbin/runc")
#: The CRI plugin's namespace: the kubelet's containers and images live there.
K8S_NAMESPACE = "k8s.io"


def containerd_root() -> Path:
    return cache_root() / "containerd" / "root"


def socket_path(state: Path) -> Path:
    return state / "run" / "containerd.sock"


def config_text(state: Path, sandbox_image: str, cni_conf_dir: Path, root: Path | None = None) -> str:
    """containerd's config (TOML; written out, not generated through a library: it is flat)."""
    root = root or containerd_root()
    return f"""# Written by `warmpool cluster up --node-runtime containerd`; rewritten at every start.
version = 2
root = "{root}"
state = "{state / 'containerd' / 'state'}"
oom_score = 0

[grpc]
  address = "{socket_path(state)}"

[ttrpc]
  address = ""

[debug]
  address = "{state / 'run' / 'containerd-debug.sock'}"
  level = "info"

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "{state / 'containerd' / 'opt'}"
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "{sandbox_image}"
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    enable_selinux = false
    max_container_log_line_size = 16384
    # Pod network namespaces under our state, so `cluster down` finds and unmounts each one.
    netns_mounts_under_state_dir = true
    # This machine withholds CAP_SYS_RESOURCE: runc cannot set a sandbox's oom_score_adj=-998
    # ("can't get final child's PID from pipe: EOF"); clamp every score to containerd's own (0).
    restrict_oom_score_adj = true
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      discard_unpacked_layers = false
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          BinaryName = "{RUNC}"
          # cgroup v1 with cgroupfs (no systemd on this machine): the kubelet's cgroupDriver too.
          SystemdCgroup = false
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "{cni_conf_dir}"
      max_conf_num = 1
    # No hosts directory: the CRI plugin's own resolver, whose default scheme is plain HTTP for
    # localhost and 127.0.0.0/8 and TLS for every other host, so the node (in the host's network
    # namespace) pulls from a registry on this machine's loopback and from nowhere else in clear.
    [plugins."io.containerd.grpc.v1.cri".registry]
      config_path = ""
"""


#: The parts of a containerd root that never change once written (content by digest, committed
#: layers unpacked): shared as hard links by a clone.  All else, its databases first, is copied.
_IMMUTABLE = {"io.containerd.content.v1.content": "blobs", "io.containerd.snapshotter.v1.overlayfs": "snapshots"}


def clone_root(source: Path, dest: Path) -> None:
    """``dest`` as a copy of the (stopped) containerd root ``source``, its images included, in
    seconds and almost no space: content blobs and unpacked layers are hard links (neither
    containerd ever writes into one: a container writes into a new snapshot of its own, and a
    removal unlinks only the remover's link), the databases real copies."""
    dest.mkdir(parents=True, exist_ok=True)
    if not source.is_dir():
        return
    for entry in source.iterdir():
        shared = _IMMUTABLE.get(entry.name)
        if shared is None:
            _cp("-a", entry, dest / entry.name)
            continue
        (dest / entry.name).mkdir(exist_ok=True)
        for part in entry.iterdir():
            _cp("-al" if part.name == shared else "-a", part, dest / entry.name / part.name)


def _cp(mode: str, source: Path, dest: Path) -> None:
    proc = subprocess.run(["cp", mode, "--", str(source), str(dest)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"could not copy containerd's {source} to {dest}: {proc.stderr.strip()}")


def write_config(state: Path, sandbox_image: str, cni_conf_dir: Path, root: Path | None = None) -> Path:
    """The config, with ``root`` (default: the machine-wide one of containerd_root) made."""
    path = state / "containerd" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    (state / "run").mkdir(parents=True, exist_ok=True)
    root = root or containerd_root()
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(config_text(state, sandbox_image, cni_conf_dir, root))
    return path


def argv(config: Path) -> list[str]:
    return [str(CONTAINERD), "--config", str(config)]


def ctr(state: Path, *args: str, stdin: IO[bytes] | None = None, timeout: float = 600) -> str:
    """Run ``ctr`` against the cluster's containerd in the CRI namespace; its stdout."""
    command = [str(CTR), "--address", str(socket_path(state)), "--namespace", K8S_NAMESPACE, *args]
    proc = subprocess.run(command, stdin=subprocess.DEVNULL if stdin is None else stdin,
                          capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout.decode(errors="replace")


def answers(state: Path) -> bool:
    """containerd serves on its socket (``ctr version`` reaches the daemon)."""
    if not socket_path(state).exists():
        return False
    proc = subprocess.run([str(CTR), "--address", str(socket_path(state)), "version"],
                          capture_output=True, timeout=10)
    return proc.returncode == 0


def images(state: Path) -> set[str]:
    """The image references containerd holds in the CRI namespace."""
    lines = ctr(state, "images", "list", "--quiet").splitlines()
    return {line.strip() for line in lines if line.strip()}


def image_digests(state: Path) -> dict[str, str]:
    """reference -> manifest digest of every image in the CRI namespace.  The CRI plugin names
    each image twice, by its tag and by its ID (``sha256:...``), both with the same digest."""
    out: dict[str, str] = {}
    for line in ctr(state, "images", "list").splitlines()[1:]:
        fields = line.split()  # REF TYPE DIGEST SIZE ...
        if len(fields) >= 3:
            out[fields[0]] = fields[2]
    return out


def task_pids(state: Path) -> dict[str, int]:
    """container id -> the PID of its task (running containers only)."""
    out: dict[str, int] = {}
    for line in ctr(state, "tasks", "list").splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 2 and fields[1].isdigit():
            out[fields[0]] = int(fields[1])
    return out
