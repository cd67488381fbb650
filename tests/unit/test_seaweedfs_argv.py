"""SeaweedFS is started on loopback only, with its outbound reports off, and is built only when asked.
(The running server's listeners are checked from /proc in integration/test_nodecache_s3.py.)"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from warmpool_devcluster import build, seaweedfs
from warmpool_devcluster.cli import _parser

pytestmark = pytest.mark.unit


def test_every_listener_is_loopback_and_every_report_is_off(tmp_path: Path) -> None:
    ports = dict(zip(seaweedfs._PORT_NAMES, range(40000, 40000 + len(seaweedfs._PORT_NAMES)), strict=True))
    argv = seaweedfs.server_argv(Path("/bin/weed"), tmp_path, ports, tmp_path / "ids.json")
    flags = dict(arg.removeprefix("-").split("=", 1) for arg in argv[2:] if "=" in arg)
    assert flags["ip"] == flags["ip.bind"] == "127.0.0.1"
    for name, port in ports.items():  # each gRPC port too: SeaweedFS would otherwise pick port+10000
        assert flags[name] == str(port)
    assert flags["master.telemetry"] == "false"
    assert flags["s3.port.iceberg"] == flags["s3.port.lance"] == flags["metricsPort"] == "0"
    assert "master.metrics.address" not in flags and "debug" not in flags
    assert flags["s3.config"] == str(tmp_path / "ids.json")


def test_credentials_are_fresh_and_written_private(tmp_path: Path) -> None:
    key_id, secret = seaweedfs.new_credentials()
    assert len(key_id) == 20 and len(secret) == 40 and seaweedfs.new_credentials() != (key_id, secret)
    identities, credentials = seaweedfs.write_credentials(tmp_path, key_id, secret)
    for path in (identities, credentials):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    entry = json.loads(identities.read_text())["identities"][0]
    assert entry["credentials"] == [{"accessKey": key_id, "secretKey": secret}]
    assert "anonymous" not in identities.read_text()


def test_weed_is_built_only_when_named() -> None:
    assert "weed" not in {b.name for b in build.ALL_BINARIES}  # `cluster build` and `make binaries`
    assert build.OBJECT_STORE_BINARIES == ("weed",)
    assert {b.name for b in build.OPTIONAL_BINARIES} == {"weed"}
    assert _parser().parse_args(["build", "--with-object-store"]).with_object_store
    assert _parser().parse_args(["up", "--with-object-store"]).with_object_store
    with pytest.raises(build.BuildError, match="unknown binaries"):
        build.ensure_binaries(["weed-nope"])
