"""An image registry on loopback: CNCF distribution's ``registry``, for installing the chart the way
a cluster we did not build gets its images (pushed to a registry, pulled by the node).

The binary is built from the Go module proxy and cached like the control plane's (build.py).  It
runs with a config we write: one listener on 127.0.0.1, plain HTTP (Docker and the node's
containerd both speak plain HTTP to a loopback registry and to no other), storage in a folder of
the caller's, no auth, its own debug server and metrics off.  Nothing else listens.

    handle = start_registry(workdir)
    warmpool images build --registry {handle.address} --push
    handle.stop()

``python -m warmpool_devcluster.registry [WORKDIR]`` runs one until Ctrl-C and prints its address.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from warmpool_dev.paths import cache_root

from warmpool_devcluster import build, processes

LOOPBACK = processes.LOOPBACK
#: How long the registry may take to answer ``/v2/`` after start.
START_TIMEOUT_S = 30.0
#: The port asked for first (next to the image builder's wheelhouse, images.WHEELHOUSE_PORT).
DEFAULT_PORT = 47312


class RegistryStartError(RuntimeError):
    """The registry could not be started; the message says why and where its log is."""


@dataclass(frozen=True)
class RegistryHandle:
    """A running registry: the address to push to and pull from, and how to stop it."""

    address: str  # 127.0.0.1:PORT, the value for `warmpool images build --registry`
    storage: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def tags(self, repository: str) -> list[str]:
        """The tags the registry holds for ``repository`` (its path, without the address)."""
        try:
            with urllib.request.urlopen(f"{self.url}/v2/{repository}/tags/list", timeout=10) as response:
                return [str(tag) for tag in json.load(response).get("tags") or []]
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return []
            raise


def registry_config(port: int, storage: Path, read_only: bool = False) -> dict[str, object]:
    """distribution's config (its YAML; JSON is YAML)."""
    return {
        "version": 0.1,
        "log": {"level": "info", "accesslog": {"disabled": True}},
        "storage": {
            "filesystem": {"rootdirectory": str(storage)},
            "delete": {"enabled": True},
            # read-only: every write is refused (405), how a registry that will not take a push looks
            "maintenance": {"uploadpurging": {"enabled": False}, "readonly": {"enabled": read_only}},
        },
        "http": {"addr": f"{LOOPBACK}:{port}", "headers": {"X-Content-Type-Options": ["nosniff"]}},
    }


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _port(preferred: int | None) -> int:
    """``preferred`` when nothing holds it, else any free port."""
    if preferred is not None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK, preferred))
            except OSError:
                pass
            else:
                return preferred
    return processes.free_port()


def start_registry(workdir: Path, binary: Path | None = None, read_only: bool = False,
                   port: int | None = None) -> RegistryHandle:
    """Start a registry with its config, storage and log under ``workdir``; returns once ``/v2/``
    answers.  It listens on ``port`` when that is free (a registry found again at the same address
    with the same storage lets Docker skip the layers it already pushed there), else on any free
    port.  The binary is built (and cached) on first use.  RegistryStartError if it exits or does
    not answer within `START_TIMEOUT_S`, with the tail of its log."""
    registry = binary if binary is not None else build.ensure_binaries(["registry"])["registry"]
    workdir.mkdir(parents=True, exist_ok=True)
    storage = workdir / "storage"
    storage.mkdir(exist_ok=True)
    port = _port(port)
    config_path = workdir / "registry-config.json"
    config_path.write_text(json.dumps(registry_config(port, storage, read_only), indent=2))
    log_path = workdir / "registry.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen([str(registry), "serve", str(config_path)], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    handle = RegistryHandle(address=f"{LOOPBACK}:{port}", storage=storage, process=process, log_path=log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        if _answers(handle.url):
            return handle
        time.sleep(0.2)
    handle.stop()
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
    raise RegistryStartError(f"the registry did not answer on {handle.url} (exit {process.poll()}); "
                             f"log {log_path}:\n{tail}")


def main(argv: list[str] | None = None) -> int:
    """``python -m warmpool_devcluster.registry [WORKDIR]``: run a registry until Ctrl-C."""
    args = list(sys.argv[1:] if argv is None else argv)
    workdir = Path(args[0]) if args else cache_root() / "registry"
    try:
        handle = start_registry(workdir, port=DEFAULT_PORT)
    except (RegistryStartError, build.BuildError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"registry on {handle.address} (storage {handle.storage}); push with: "
          f"warmpool images build --registry {handle.address} --push", flush=True)
    try:
        handle.process.wait()
    except KeyboardInterrupt:
        handle.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
