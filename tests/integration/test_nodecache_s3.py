"""The node cache against a real object store: SeaweedFS (built from the Go module proxy) on
loopback with real credentials.  A tiny real safetensors checkpoint is pushed with
`warmpool model push`, filled from S3 into a cache, read back through the worker's
checkpoint reader; a second revision downloads only its changed blocks; and wrong
credentials, a missing bucket, an escaping key and lying manifests each fail clearly with
the cache exactly as it was."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.seaweedfs import SeaweedHandle
from warmpool_nodecache.blocks import BlockCorruptError
from warmpool_nodecache.fill import fill_revision
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import Manifest, ManifestError, build_manifest
from warmpool_nodecache.push import PushResult, push_model
from warmpool_nodecache.s3 import (
    S3Credentials,
    S3KeyError,
    S3Source,
    S3SourceConfig,
    SourceAuthError,
    make_client,
)
from warmpool_nodecache.source import SourceMissingError

from warmpool.contract.files import MANIFEST_FILENAME

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16 * 1024  # the tiny checkpoint (~437 kB) then spans ~27 blocks, so 10 % of them is a few
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("", "nodecache", "worker", "dev", "devcluster"))
    + os.pathsep + os.environ.get("PYTHONPATH", ""),
}


class CountingSource:
    """The real S3Source, with every byte range it was asked for counted (what a fill transferred)."""

    def __init__(self, inner: S3Source) -> None:
        self.inner = inner
        self.ranges: list[tuple[str, int, int]] = []

    def describe(self) -> str:
        return self.inner.describe()

    def fetch_manifest(self) -> bytes:
        return self.inner.fetch_manifest()

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def fetch_range(self, path: str, offset: int, length: int) -> bytes:
        self.ranges.append((path, offset, length))
        return self.inner.fetch_range(path, offset, length)

    @property
    def bytes(self) -> int:
        return sum(length for _, _, length in self.ranges)


@pytest.fixture(scope="module")
def store(loopback_s3_store: SeaweedHandle) -> SeaweedHandle:
    return loopback_s3_store  # shared with the other modules that use the store directly (conftest.py)


@pytest.fixture(scope="module")
def model_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from warmpool_dev.testing_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "a", layers=2, seed=0)


def _creds(store: SeaweedHandle) -> S3Credentials:
    return S3Credentials(store.access_key_id, store.secret_access_key)


def _config(store: SeaweedHandle, prefix: str, **changes: Any) -> S3SourceConfig:
    config = S3SourceConfig(store.endpoint, store.bucket, prefix, credentials=_creds(store), attempts=2,
                            read_timeout_s=20.0)
    return dataclasses.replace(config, **changes)


def _push(store: SeaweedHandle, model: Path, prefix: str) -> PushResult:
    return push_model(model, _config(store, prefix), block_size=BLOCK)


def _source(store: SeaweedHandle, prefix: str, **changes: Any) -> CountingSource:
    return CountingSource(S3Source(_config(store, prefix, **changes)))


def _listing(root: Path, skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """Every entry under `root` with its content hash (files) or "dir": what "the cache as it was" means."""
    entries = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if not any(relative.startswith(s) for s in skip):
            entries.append((relative, "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()))
    return entries


def _assert_identical(revision: Path, model: Path) -> None:
    names = sorted(p.relative_to(model).as_posix() for p in model.rglob("*") if p.is_file())
    assert sorted(p.relative_to(revision).as_posix() for p in revision.rglob("*") if p.is_file()) == names
    for name in names:
        assert (revision / name).read_bytes() == (model / name).read_bytes(), name


def _sockets(pid: int) -> list[tuple[str, str, str, str]]:
    """(table, state, local address, remote address) of every TCP socket the process holds (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                found.append((table, fields[3], fields[1].split(":")[0], fields[2].split(":")[0]))
    return found


def test_store_listens_on_loopback_only_and_keeps_its_credentials_private(store: SeaweedHandle) -> None:
    assert store.process is not None
    sockets = _sockets(store.process.pid)
    listening = {(table, local) for table, state, local, _ in sockets if state == "0A"}  # 0A: LISTEN
    assert listening == {("tcp", "0100007F")}, listening  # 127.0.0.1 only: no 0.0.0.0, no [::]
    # Every connection it holds (its parts talk to each other over gRPC) is to 127.0.0.1: it dials nothing else.
    assert {remote for table, state, _, remote in sockets if state != "0A"} <= {"0100007F"}, sockets
    for name in ("credentials", "s3-identities.json"):
        path = store.credentials_file.parent / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
    assert store.secret_access_key in store.credentials_file.read_text()
    assert store.secret_access_key not in repr(store)
    # Anonymous requests are refused: the credentials are real.
    unsigned = _source(store, "nothing", credentials=None)
    with pytest.raises(SourceAuthError, match=r"refused access key id '\(unsigned\)'"):
        unsigned.fetch_manifest()


def test_push_then_fill_gives_identical_files_the_worker_reads_and_a_held_revision_downloads_nothing(
    store: SeaweedHandle, model_a: Path, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file
    from warmpool_worker.checkpoint import open_checkpoint

    pushed = _push(store, model_a, "tiny/r1")
    manifest = build_manifest(model_a, BLOCK)
    assert pushed.digest == manifest.digest
    assert sorted(pushed.uploaded) == sorted(f.path for f in manifest.files) and not pushed.skipped
    again = _push(store, model_a, "tiny/r1")  # the same revision again: nothing is sent
    assert again.uploaded == () and again.bytes_uploaded == 0 and len(again.skipped) == len(manifest.files)

    layout = CacheLayout(tmp_path / "cache")
    source = _source(store, "tiny/r1")
    result = fill_revision(layout, source)
    assert result.digest == manifest.digest and result.filled_here
    assert result.bytes_fetched == source.bytes == manifest.total_bytes
    _assert_identical(result.path, model_a)
    checkpoint = open_checkpoint(result.path)  # every header and the config, as a worker checks them
    try:
        original = load_file(str(model_a / "model.safetensors"))
        for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
            assert torch.equal(checkpoint.get_tensor(name), original[name]), name
    finally:
        checkpoint.close()

    held = _source(store, "tiny/r1")  # a node that already holds the revision
    second = fill_revision(layout, held)
    assert not second.filled_here and held.ranges == [] and second.bytes_fetched == 0


def _changed_copy(model: Path, dest: Path, fraction: float) -> set[int]:
    """Copy `model`, changing one float's lowest byte in `fraction` of model.safetensors' data blocks
    (the header stays as it is, so the copy is still a valid checkpoint); returns the changed block indices."""
    shutil.copytree(model, dest)
    weights = dest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data_start = 8 + struct.unpack("<Q", data[:8])[0]
    first, last = -(-data_start // BLOCK), len(data) // BLOCK - 1
    candidates = list(range(first, last + 1))
    want = max(1, round(fraction * -(-len(data) // BLOCK)))
    chosen = {candidates[i * len(candidates) // want] for i in range(want)}
    for index in chosen:
        offset = index * BLOCK + 4 - (index * BLOCK - data_start) % 4  # a float's first (lowest) byte
        data[offset] ^= 0x01
    weights.write_bytes(bytes(data))
    return chosen


def test_a_second_revision_with_ten_percent_changed_blocks_downloads_only_those(
    store: SeaweedHandle, model_a: Path, tmp_path: Path
) -> None:
    changed = _changed_copy(model_a, tmp_path / "b", 0.10)
    _push(store, model_a, "delta/r1")
    _push(store, tmp_path / "b", "delta/r2")
    manifest_b = build_manifest(tmp_path / "b", BLOCK)
    layout = CacheLayout(tmp_path / "cache")
    fill_revision(layout, _source(store, "delta/r1"))
    source = _source(store, "delta/r2")
    result = fill_revision(layout, source)
    weights = next(f for f in manifest_b.files if f.path == "model.safetensors")
    assert sorted(source.ranges) == sorted(
        ("model.safetensors", i * BLOCK, min(BLOCK, weights.size - i * BLOCK)) for i in changed
    )
    assert result.bytes_fetched == source.bytes <= 0.15 * manifest_b.total_bytes
    _assert_identical(result.path, tmp_path / "b")


def _put_manifest(store: SeaweedHandle, prefix: str, body: dict[str, Any]) -> None:
    make_client(_config(store, prefix)).put_object(Bucket=store.bucket, Key=f"{prefix}/{MANIFEST_FILENAME}",
                                                   Body=json.dumps(body).encode())


def _lie(store: SeaweedHandle, model: Path, prefix: str, lie: str) -> None:
    """Push `model` under `prefix`, then replace its manifest with one that lies."""
    _push(store, model, prefix)
    manifest = build_manifest(model, BLOCK)
    files = {f.path: f for f in manifest.files}
    if lie == "size":
        files["config.json"] = dataclasses.replace(files["config.json"], size=files["config.json"].size + 7)
    elif lie == "hash":
        weights = files["model.safetensors"]
        files["model.safetensors"] = dataclasses.replace(weights, blocks=(*weights.blocks[:3], "0" * 64,
                                                                          *weights.blocks[4:]))
    body = json.loads(Manifest(BLOCK, tuple(sorted(files.values(), key=lambda f: f.path))).to_text())
    if lie == "dotdot-manifest":
        body["files"][0]["path"] = "../escaped.json"
    _put_manifest(store, prefix, body)


@pytest.mark.parametrize(
    ("case", "error", "says"),
    [
        ("credentials", SourceAuthError, r"refused access key id 'WPNOSUCHKEY0000000000' for s3://models/"),
        ("secret", SourceAuthError, r"refused access key id 'WP\w+' for s3://models/"),
        ("bucket", SourceMissingError, r"bucket 'no-such-bucket' does not exist at http://127\.0\.0\.1:\d+"),
        ("dotdot-prefix", S3KeyError, r"prefix '\.\./good' has a '\.\.' component"),
        ("dotdot-manifest", ManifestError, r"'\.\./escaped\.json' has a '\.\.' component"),
        ("size", ManifestError, r"says 'config.json' has \d+ bytes, the source has another size"),
        ("hash", BlockCorruptError, "block 3 .* never matched the manifest's SHA-256"),
    ],
)
def test_bad_input_fails_clearly_and_leaves_the_cache_as_it_was(
    store: SeaweedHandle, model_a: Path, tmp_path: Path, case: str, error: type[Exception], says: str
) -> None:
    prefix = f"bad-{case}"
    _push(store, model_a, "good")
    layout = CacheLayout(tmp_path / "cache")
    fill_revision(layout, _source(store, "good"))  # a cache with a revision in it already
    before = _listing(layout.root)
    if case in ("size", "hash", "dotdot-manifest"):
        _lie(store, model_a, prefix, case)
    with pytest.raises(error, match=says) as raised:
        if case == "credentials":
            source = _source(store, "good", credentials=S3Credentials("WPNOSUCHKEY0000000000", "not-the-secret-1"))
        elif case == "secret":
            source = _source(store, "good", credentials=S3Credentials(store.access_key_id, "not-the-secret-2"))
        elif case == "bucket":
            source = _source(store, "good", bucket="no-such-bucket")
        elif case == "dotdot-prefix":
            source = _source(store, "../good")
        else:
            source = _source(store, prefix)
        fill_revision(layout, source)
    assert store.endpoint in str(raised.value) or case not in ("credentials", "secret")
    assert "not-the-secret" not in str(raised.value) and store.secret_access_key not in str(raised.value)
    # A hash lie is found only by downloading: its lease file stays (versions must never repeat),
    # released; everything else -- blocks, manifests, staging, revisions -- is as it was.
    after = _listing(layout.root, skip=("leases/",))
    assert after == [e for e in before if not e[0].startswith("leases/")]
    if case != "hash":
        assert _listing(layout.root) == before


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=ENV, capture_output=True, text=True, timeout=300)


def test_the_push_and_fill_commands(store: SeaweedHandle, model_a: Path, tmp_path: Path) -> None:
    push = ["-m", "warmpool.cli", "model", "push"]
    where = ["--endpoint", store.endpoint, "--credentials-file", str(store.credentials_file)]
    done = _cli(*push, str(model_a), f"s3://{store.bucket}/cli/r1", *where)
    assert done.returncode == 0, done.stderr
    digest = done.stdout.strip()
    assert digest == build_manifest(model_a).digest
    assert "[warmpool push] 100%" in done.stderr  # plain progress lines: stderr is not a terminal
    assert "manifest sha256:" in done.stderr

    filled = _cli("-m", "warmpool_nodecache", "--root", str(tmp_path / "cache"), "fill",
                  "--source-s3", f"s3://{store.bucket}/cli/r1", *where)
    assert filled.returncode == 0, filled.stderr
    assert json.loads(filled.stdout)["digest"] == digest
    _assert_identical(Path(json.loads(filled.stdout)["path"]), model_a)

    wrong = tmp_path / "wrong-credentials"
    wrong.write_text(f"[default]\naws_access_key_id = {store.access_key_id}\naws_secret_access_key = wrong-secret\n")
    refused_fill = _cli("-m", "warmpool_nodecache", "--root", str(tmp_path / "cache2"), "fill",
                        "--source-s3", f"s3://{store.bucket}/cli/r1", "--endpoint", store.endpoint,
                        "--credentials-file", str(wrong))
    assert refused_fill.returncode == 1 and "Traceback" not in refused_fill.stderr
    assert f"fill: {store.endpoint} refused access key id '{store.access_key_id}'" in refused_fill.stderr
    assert "wrong-secret" not in refused_fill.stderr

    (tmp_path / "not-a-model").mkdir()
    shutil.copy(model_a / "config.json", tmp_path / "not-a-model")
    (tmp_path / "not-a-model" / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    refused = _cli(*push, str(tmp_path / "not-a-model"), f"s3://{store.bucket}/cli/bad", *where)
    assert refused.returncode == 1
    assert "is not a valid safetensors model directory" in refused.stderr and "pickle" in refused.stderr

    missing = _cli(*push, str(model_a), "s3://no-such-bucket/x", *where)
    assert missing.returncode == 1 and "bucket 'no-such-bucket' does not exist" in missing.stderr
