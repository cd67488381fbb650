"""The Debian packages the real node and the image builds need, installed when missing.

`make host-packages` (`warmpool cluster host-packages`) installs them with apt-get; without root
or without apt it says what is missing and stops.  Each package is judged present by a file it
ships, so a machine that has them from elsewhere is not asked to install anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

#: Debian package -> a file it installs (what the dev tools run from it).
PACKAGES: dict[str, Path] = {
    "containerd": Path("/usr/bin/containerd"),  # the real node's container runtime (with its CRI plugin)
    "runc": Path("/usr/sbin/runc"),  # the OCI runtime containerd starts containers with
    "containernetworking-plugins": Path("/usr/lib/cni/bridge"),  # bridge, host-local, portmap, loopback CNI
    "iptables": Path("/usr/sbin/iptables"),  # kube-proxy's Services and the network guard
    "iproute2": Path("/usr/sbin/ip"),  # the node's bridge
    "docker.io": Path("/usr/sbin/dockerd"),  # the image builder (dockerd and its client)
    "mmdebstrap": Path("/usr/bin/mmdebstrap"),  # the images' base, made from Debian packages
    "libc6-dev": Path("/usr/lib/x86_64-linux-gnu/libc.a"),  # the static pause process
    "gcc": Path("/usr/bin/gcc"),
}


class HostPackagesError(RuntimeError):
    """The packages cannot be installed here; the message says which and how."""


def missing() -> list[str]:
    return [name for name, path in PACKAGES.items() if not path.exists()]


def ensure() -> list[str]:
    """Install the missing packages; the names installed."""
    wanted = missing()
    if not wanted:
        return []
    command = f"apt-get install --no-install-recommends {' '.join(wanted)}"
    if os.geteuid() != 0:
        raise HostPackagesError(f"missing Debian packages {', '.join(wanted)}, and installing them needs root: "
                                f"run `sudo {command}` (or `sudo make host-packages`)")
    if shutil.which("apt-get") is None:
        raise HostPackagesError(f"missing packages {', '.join(wanted)}, and this machine has no apt-get: install "
                                "their equivalents (containerd 1.6+, runc, the CNI plugins, iptables, dockerd, "
                                "mmdebstrap, a static libc) by hand")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"[warmpool host-packages] installing {' '.join(wanted)} with apt-get", file=sys.stderr, flush=True)
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *wanted]):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise HostPackagesError(f"`{' '.join(argv)}` failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                                    f"{proc.stderr[-2000:]}")
    still = missing()
    if still:
        raise HostPackagesError(f"apt-get installed, yet these are still missing: {', '.join(still)}")
    return wanted
