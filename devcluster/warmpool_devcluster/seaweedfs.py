"""SeaweedFS for the dev cluster: a real S3-compatible object store the model cache fills from.

The ``weed`` binary is built from the Go module proxy and cached like the control plane's
(`build.py`).  One ``weed server`` process runs the master, a volume server, the filer and
the S3 gateway.  Its defaults do not suit a dev machine, so every listener is set here:
each binds 127.0.0.1 on a port we chose free (``-ip``/``-ip.bind``, and each gRPC port
explicitly); the Iceberg and Lance listeners it opens by default are off (port 0); its
anonymous usage report to telemetry.seaweedfs.com (on by default) is off; no metrics port,
no metrics push gateway, no pprof.  Data, the filer's store and the unix sockets live under
the work directory, and the process runs with that directory as its cwd.

The S3 gateway takes real credentials: a fresh access key id and secret for every start,
written (mode 0600) as SeaweedFS' identities file and, for clients, as an AWS
shared-credentials file (``[default]``) beside it.  Anonymous requests are refused.

    handle = start_seaweedfs(workdir)
    ... boto3 / `warmpool model push DIR s3://models/x --endpoint {handle.endpoint}
        --credentials-file {handle.credentials_file}` ...
    handle.stop()
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import string
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from warmpool_dev.paths import cache_root

from warmpool_devcluster import build, node_network, processes

LOOPBACK = processes.LOOPBACK
#: the program name: its record in a workdir (`warmpool cluster up --with-object-store`)
PROGRAM = "weed"
#: How long SeaweedFS may take until its S3 gateway stores an object after start.
START_TIMEOUT_S = 90.0
#: The bucket a started store has ready (tests and the demo push models there).
DEFAULT_BUCKET = "models"
#: Per-volume size: small, so a dev store does not claim 30 GB volumes (SeaweedFS' default).
VOLUME_SIZE_LIMIT_MB = 1024
#: Volumes this server may hold: each bucket is a collection that grows several volumes at once.
MAX_VOLUMES = 64
IDENTITIES_FILE = "s3-identities.json"
CREDENTIALS_FILE = "credentials"  # AWS shared-credentials format, profile [default]

_PORT_NAMES = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
               "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc")


class SeaweedError(RuntimeError):
    """SeaweedFS could not be started; the message says why and where its log is."""


@dataclass(frozen=True)
class SeaweedHandle:
    """A running SeaweedFS: its S3 endpoint, the credentials it accepts, and how to stop it."""

    endpoint: str  # the S3 gateway, http://127.0.0.1:PORT (path-style buckets)
    access_key_id: str
    secret_access_key: str = field(repr=False)
    credentials_file: Path = Path()
    bucket: str = DEFAULT_BUCKET
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    log_path: Path = Path()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            processes.stop_pid(self.process.pid)
            self.process.wait(timeout=10)
        if self.process is not None:
            endpoint = urllib.parse.urlsplit(self.endpoint)
            node_network.withdraw_from_pods(endpoint.hostname or "", endpoint.port or 0)


def _distinct_free_ports(count: int, address: str = LOOPBACK) -> list[int]:
    """`count` different free ports on ``address`` (each held until all are chosen, so none repeats)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((address, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (created 0600, never briefly wider)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def new_credentials() -> tuple[str, str]:
    """A fresh (access key id, secret) in AWS' shapes: 20 upper-case alphanumerics, 40 characters."""
    alphabet = string.ascii_uppercase + string.digits
    key_id = "WP" + "".join(secrets.choice(alphabet) for _ in range(18))
    return key_id, secrets.token_urlsafe(30)[:40]


def write_credentials(workdir: Path, key_id: str, secret: str) -> tuple[Path, Path]:
    """The gateway's identities file and the clients' credentials file, both 0600."""
    identities = {"identities": [{
        "name": "warmpool",
        "credentials": [{"accessKey": key_id, "secretKey": secret}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }]}
    identities_path, credentials_path = workdir / IDENTITIES_FILE, workdir / CREDENTIALS_FILE
    _write_private(identities_path, json.dumps(identities, indent=2))
    _write_private(credentials_path,
                   f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n")
    return identities_path, credentials_path


def server_argv(weed: Path, workdir: Path, ports: dict[str, int], identities: Path,
                address: str = LOOPBACK) -> list[str]:
    """``weed server`` with every listener on ``address`` (loopback unless told) and every outbound
    report off."""
    data = workdir / "data"
    return [
        str(weed), "server",
        f"-ip={address}", f"-ip.bind={address}",
        f"-dir={data}", f"-master.dir={data / 'master'}",
        "-filer", "-s3",
        *(f"-{name}={port}" for name, port in ports.items()),
        "-s3.port.iceberg=0", "-s3.port.lance=0",  # extra listeners SeaweedFS opens by default
        f"-s3.config={identities}",
        "-master.telemetry=false",  # no anonymous usage report to telemetry.seaweedfs.com
        "-metricsPort=0",
        f"-master.volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}",
        f"-volume.max={MAX_VOLUMES}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        f"-s3.localSocket={workdir / 's3.sock'}",
    ]


def _answers(url: str) -> bool:
    """The gateway answers HTTP at all (an unsigned request is refused: that is an answer)."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def _ready_for_writes(handle: SeaweedHandle, deadline: float) -> str:
    """Make the default bucket and store a probe object (the volume servers must have joined);
    '' when done, else the last error."""
    from warmpool_nodecache.s3 import S3Credentials, S3SourceConfig, make_client

    client = make_client(S3SourceConfig(handle.endpoint, handle.bucket,
                                        credentials=S3Credentials(handle.access_key_id, handle.secret_access_key),
                                        attempts=1, read_timeout_s=10.0))
    last = ""
    while time.monotonic() < deadline:
        try:
            existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
            if handle.bucket not in existing:
                client.create_bucket(Bucket=handle.bucket)
            client.put_object(Bucket=handle.bucket, Key=".warmpool-probe", Body=b"ok")
            client.delete_object(Bucket=handle.bucket, Key=".warmpool-probe")
            return ""
        except Exception as exc:  # any failure here means "not ready yet"; bounded by the deadline
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
    return last or "timed out"


def start_seaweedfs(workdir: Path, binary: Path | None = None, address: str = LOOPBACK) -> SeaweedHandle:
    """Start SeaweedFS under ``workdir``, listening on ``address`` only (loopback, or the dev
    cluster node's bridge address for pods to reach); returns once its S3 gateway has stored an object.

    The binary is built (and cached) on first use.  Raises `SeaweedError` if it exits or is
    not ready within `START_TIMEOUT_S`, with the tail of its log.
    """
    weed = binary if binary is not None else build.ensure_binaries(["weed"])["weed"]
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "data" / "master").mkdir(parents=True, exist_ok=True)
    key_id, secret = new_credentials()
    identities, credentials_file = write_credentials(workdir, key_id, secret)
    ports = dict(zip(_PORT_NAMES, _distinct_free_ports(len(_PORT_NAMES), address), strict=True))
    # On the node's bridge address, the S3 gateway is for the pods there: the guard lets them in
    # to that port alone (the master, volume and filer stay the gateway's own).
    node_network.publish_to_pods(address, ports["s3.port"])
    log_path = workdir / "weed.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            server_argv(weed, workdir, ports, identities, address), cwd=workdir,
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    handle = SeaweedHandle(
        endpoint=f"http://{address}:{ports['s3.port']}", access_key_id=key_id, secret_access_key=secret,
        credentials_file=credentials_file, process=process, log_path=log_path,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    problem = "exited"
    while time.monotonic() < deadline and process.poll() is None:
        if _answers(handle.endpoint):
            problem = _ready_for_writes(handle, deadline)
            if not problem:
                return handle
            break
        time.sleep(0.25)
    handle.stop()
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
    raise SeaweedError(f"seaweedfs at {handle.endpoint} was not ready ({problem}; exit {process.poll()}); "
                       f"log {log_path}:\n{tail}")


def ensure_recorded(workdir: Path) -> dict[str, str]:
    """SeaweedFS under ``workdir``, left running after the caller exits (recorded there, so a
    second call reuses it and `stop_recorded` stops it): its ``s3`` endpoint, ``bucket`` and
    clients' ``credentials`` file."""
    urls = processes.recorded_urls(workdir, PROGRAM)
    if urls is None:
        handle = start_seaweedfs(workdir)
        assert handle.process is not None
        urls = {"s3": handle.endpoint, "credentials": str(handle.credentials_file), "bucket": handle.bucket}
        processes.record(workdir, PROGRAM, handle.process.pid, urls)
    return urls


def stop_recorded(workdir: Path) -> bool:
    """Stop the SeaweedFS `ensure_recorded` left running under ``workdir``; True if one ran."""
    return processes.stop_recorded(workdir, PROGRAM)


def main(argv: list[str] | None = None) -> int:
    """``python -m warmpool_devcluster.seaweedfs [WORKDIR]``: run SeaweedFS until Ctrl-C."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    workdir = Path(args[0]) if args else cache_root() / "seaweedfs"
    try:
        handle = start_seaweedfs(workdir)
    except (SeaweedError, build.BuildError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"S3 endpoint: {handle.endpoint} (bucket {handle.bucket}); credentials: {handle.credentials_file}")
    try:
        assert handle.process is not None
        handle.process.wait()
    except KeyboardInterrupt:
        handle.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
