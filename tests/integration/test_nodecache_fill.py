"""The node cache core for real: a tiny safetensors checkpoint served over loopback HTTP (with Range),
filled into a cache by real processes -- racing, killed, fed corrupt bytes and lying manifests --
and evicted while another process maps a revision."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warmpool_nodecache.blocks import BlockCorruptError, BlockStore
from warmpool_nodecache.evict import cache_bytes, evict
from warmpool_nodecache.fill import FillOptions, fill_revision
from warmpool_nodecache.journal import journaled
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import Manifest, ManifestError, build_manifest, write_manifest
from warmpool_nodecache.order import files_first
from warmpool_nodecache.source import HttpSource, HttpSourceConfig, SourceMissingError
from warmpool_nodecache.use import pinned

from tests.support.range_server import RangeServer, serve_directory
from warmpool.contract.files import MANIFEST_FILENAME
from warmpool.lease import LeaseLostError

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BLOCK = 64 * 1024  # the tiny checkpoint's 437 kB then spans 7 blocks (the 4 MiB default would be one)
#: filler subprocesses import the checkout's nodecache/ (an editable install may predate it)
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(REPO / "nodecache"), str(REPO), os.environ.get("PYTHONPATH", "")]),
}


def _publish_source(model: Path, dest: Path) -> Manifest:
    shutil.copytree(model, dest)
    manifest = build_manifest(dest, block_size=BLOCK)
    write_manifest(dest, manifest)
    return manifest


@pytest.fixture(scope="module")
def model_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from warmpool_dev.testing_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "a", layers=2, seed=0)


def _source(server: RangeServer) -> HttpSource:
    return HttpSource(HttpSourceConfig(server.url, timeout_s=10, attempts=3, backoff_s=0.05))


def _listing(root: Path, skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """Every entry under `root` with its content hash (files) or "dir" -- what "the cache as it was" means."""
    entries = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if any(relative.startswith(s) for s in skip):
            continue
        entries.append((relative, "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()))
    return entries


def _assert_identical(revision: Path, model: Path) -> None:
    names = sorted(p.relative_to(model).as_posix() for p in model.rglob("*") if p.is_file())
    assert sorted(p.relative_to(revision).as_posix() for p in revision.rglob("*") if p.is_file()) == names
    for name in names:
        assert (revision / name).read_bytes() == (model / name).read_bytes(), name


def _block_offsets(manifest: Manifest) -> set[tuple[str, int]]:
    return {(r.path, r.offset) for r in manifest.block_refs()}


def test_fill_materialises_identical_files_that_load_and_a_second_fill_downloads_nothing(
    model_a: Path, tmp_path: Path
) -> None:
    from safetensors.numpy import load_file

    manifest = _publish_source(model_a, tmp_path / "src")
    layout = CacheLayout(tmp_path / "cache")
    with serve_directory(tmp_path / "src") as server:
        result = fill_revision(layout, _source(server), order=files_first(["config.json", "model.safetensors"]))
        assert result.digest == manifest.digest and result.filled_here
        assert result.path == layout.revision(manifest.digest_hex)
        assert result.bytes_fetched == manifest.total_bytes
        assert dict(server.state.ranges) == dict.fromkeys(_block_offsets(manifest), 1)  # each block once
        again = fill_revision(layout, _source(server))
        assert not again.filled_here and again.blocks_fetched == 0
        assert server.state.block_requests() == len(manifest.unique_blocks())
    _assert_identical(result.path, model_a)
    methods = dict(zip((f.path for f in manifest.files), result.methods, strict=True))
    # Written by the fetch threads from the verified bytes they held, once: no block file beside
    # them, no copy pass at the end.  The published files are the store's copy of every block.
    assert set(methods.values()) == {"write"}
    store = BlockStore(layout)
    assert store.all_blocks() == set()
    assert all(store.has(sha) for sha in manifest.unique_blocks())
    assert cache_bytes(layout) < 1.2 * manifest.total_bytes + 64 * 1024  # each byte on disk once
    tensors = load_file(result.path / "model.safetensors")
    assert "model.embed_tokens.weight" in tensors
    with pinned(layout, manifest.digest_hex) as revision:
        assert (revision / "config.json").is_file()
    assert not (result.path / MANIFEST_FILENAME).exists()


def _filler(root: Path, url: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "warmpool_nodecache", "--root", str(root), "fill", "--source-http", url, *extra],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_four_fillers_racing_on_one_revision_download_each_block_once(model_a: Path, tmp_path: Path) -> None:
    manifest = _publish_source(model_a, tmp_path / "src")
    root = tmp_path / "cache"
    with serve_directory(tmp_path / "src") as server:
        server.state.range_delay_s = 0.05  # the fill lasts long enough for all four to meet
        fillers = [_filler(root, server.url, "--wait-timeout", "120") for _ in range(4)]
        outputs = [p.communicate(timeout=180) for p in fillers]
        assert [p.returncode for p in fillers] == [0] * 4, [err for _, err in outputs]
        results = [json.loads(out) for out, _ in outputs]
        assert {r["digest"] for r in results} == {manifest.digest}
        assert sorted(r["filled_here"] for r in results) == [False, False, False, True]
        assert dict(server.state.ranges) == dict.fromkeys(_block_offsets(manifest), 1)
    _assert_identical(CacheLayout(root).revision(manifest.digest_hex), model_a)
    assert not any(CacheLayout(root).staging.iterdir())


def test_a_fill_killed_midway_resumes_and_downloads_only_the_rest(model_a: Path, tmp_path: Path) -> None:
    manifest = _publish_source(model_a, tmp_path / "src")
    layout = CacheLayout(tmp_path / "cache")
    total = len(manifest.unique_blocks())
    with serve_directory(tmp_path / "src") as server:
        server.state.range_delay_s = 0.3
        victim = _filler(layout.root, server.url, "--lease-ttl", "1.5")
        deadline = time.monotonic() + 60
        # Killed once some blocks are committed (several fetches run at once, so a request
        # count says nothing about what is durable) and while others are still being fetched.
        while (not journaled(layout, manifest.digest_hex) and time.monotonic() < deadline
               and victim.poll() is None):
            time.sleep(0.02)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        assert victim.returncode == -signal.SIGKILL
        kept = journaled(layout, manifest.digest_hex)
        assert 0 < len(kept) < total
        view = layout.staging / f"{manifest.digest_hex}.1"
        for ref in manifest.block_refs():  # every block its journal lists is whole and verified in its view
            if ref.sha256 in kept:
                with (view / ref.path).open("rb") as fh:
                    fh.seek(ref.offset)
                    assert hashlib.sha256(fh.read(ref.length)).hexdigest() == ref.sha256
        assert BlockStore(layout).all_blocks() == set()  # and only there: no second copy
        assert not layout.revision(manifest.digest_hex).exists()  # nothing half-published
        before = server.state.block_requests()
        server.state.range_delay_s = 0.0
        result = fill_revision(layout, _source(server), options=FillOptions(lease_ttl_s=5, wait_timeout_s=60))
        assert result.filled_here and result.blocks_fetched == total - len(kept)
        assert server.state.block_requests() - before == total - len(kept)
    _assert_identical(result.path, model_a)


def test_a_corrupt_block_is_detected_and_fetched_again(model_a: Path, tmp_path: Path) -> None:
    manifest = _publish_source(model_a, tmp_path / "src")
    layout = CacheLayout(tmp_path / "cache")
    with serve_directory(tmp_path / "src") as server:
        server.state.corrupt_once = {("model.safetensors", BLOCK)}
        result = fill_revision(layout, _source(server))
        expected = dict.fromkeys(_block_offsets(manifest), 1)
        expected[("model.safetensors", BLOCK)] = 2
        assert dict(server.state.ranges) == expected
    _assert_identical(result.path, model_a)


def test_a_fill_whose_lease_expired_cannot_publish_and_a_new_fill_completes(model_a: Path, tmp_path: Path) -> None:
    manifest = _publish_source(model_a, tmp_path / "src")
    layout = CacheLayout(tmp_path / "cache")
    with serve_directory(tmp_path / "src") as server:
        server.state.range_delay_s = 0.4  # each block outlasts the 0.2 s lease
        with pytest.raises(LeaseLostError, match="expired"):
            fill_revision(layout, _source(server), options=FillOptions(lease_ttl_s=0.2, wait_timeout_s=10))
        assert not layout.revision(manifest.digest_hex).exists()
        # Its view stays with the journal of what is durable in it, for the next fill to resume from.
        assert sorted(p.name for p in layout.staging.iterdir()) == [f"{manifest.digest_hex}.1",
                                                                    f"{manifest.digest_hex}.1.done"]
        server.state.range_delay_s = 0.0
        result = fill_revision(layout, _source(server))
        assert result.filled_here and result.blocks_fetched < len(manifest.unique_blocks())
        assert not any(layout.staging.iterdir())
    _assert_identical(result.path, model_a)


def test_eviction_never_removes_a_mapped_or_pinned_revision(model_a: Path, tmp_path: Path) -> None:
    from warmpool_dev.testing_models import make_tiny_llama

    model_b = make_tiny_llama(tmp_path / "b", layers=2, seed=1)
    manifest_a = _publish_source(model_a, tmp_path / "src-a")
    manifest_b = _publish_source(model_b, tmp_path / "src-b")
    layout = CacheLayout(tmp_path / "cache")
    with serve_directory(tmp_path / "src-a") as server_a, serve_directory(tmp_path / "src-b") as server_b:
        path_a = fill_revision(layout, _source(server_a)).path
        fill_revision(layout, _source(server_b))
    mapper = subprocess.Popen(
        [sys.executable, "-c",
         "import mmap, sys\n"
         f"f = open({str(path_a / 'model.safetensors')!r}, 'rb')\n"
         "m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
         "print('mapped', m[:8].hex(), flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert mapper.stdout is not None and mapper.stdout.readline().startswith("mapped")
        result = evict(layout, budget_bytes=0)
        assert result.evicted == (manifest_b.digest_hex,) and result.in_use == (manifest_a.digest_hex,)
        assert result.bytes_after < result.bytes_before
    finally:
        assert mapper.stdin is not None
        mapper.stdin.close()
        mapper.wait(timeout=30)
    _assert_identical(path_a, model_a)
    assert not layout.revision(manifest_b.digest_hex).exists()
    store = BlockStore(layout)  # b's blocks went with its files, a's are held in its files
    assert all(store.has(sha) for sha in manifest_a.unique_blocks())
    b_only = manifest_b.unique_blocks() - manifest_a.unique_blocks()
    assert not any(store.has(sha) for sha in b_only)
    # The trust marks of b's blocks went with them (no block file was freed: they lived in b's files).
    assert not any(layout.vouched(sha).exists() for sha in b_only)
    assert all(layout.vouched(sha).exists() for sha in manifest_a.unique_blocks())
    with pinned(layout, manifest_a.digest_hex):
        assert evict(layout, budget_bytes=0).in_use == (manifest_a.digest_hex,)
    assert evict(layout, budget_bytes=0).evicted == (manifest_a.digest_hex,)
    assert not any(BlockStore(layout).has(sha) for sha in manifest_a.unique_blocks())


def test_eviction_sees_a_revision_mapped_through_another_mount_namespace(model_a: Path, tmp_path: Path) -> None:
    """A worker in a container maps the revision through its pod's mount of the cache: in its maps
    the path is the container's, not the cache's.  The process here does the same (a mount
    namespace of its own, the cache bind-mounted elsewhere), and eviction still spares it."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a mount namespace of its own needs root and unshare (util-linux)")
    manifest_a = _publish_source(model_a, tmp_path / "src-a")
    layout = CacheLayout(tmp_path / "cache")
    with serve_directory(tmp_path / "src-a") as server_a:
        fill_revision(layout, _source(server_a))
    view = tmp_path / "container-view"
    view.mkdir()
    weights = f"{view}/revisions/{manifest_a.digest_hex}/model.safetensors"
    mapper = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount --bind "$1" "$2" && exec {sys.executable} -c "$3"', "sh", str(layout.root), str(view),
         "import mmap, sys\n"
         f"f = open({weights!r}, 'rb')\n"
         "m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
         "print('mapped', flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert mapper.stdout is not None and mapper.stdout.readline().startswith("mapped")
        maps = Path(f"/proc/{mapper.pid}/maps").read_text()
        assert weights in maps and str(layout.revisions) not in maps  # the container's path only
        result = evict(layout, budget_bytes=0)
        assert result.evicted == () and result.in_use == (manifest_a.digest_hex,)
    finally:
        assert mapper.stdin is not None
        mapper.stdin.close()
        mapper.wait(timeout=30)
    assert not view.joinpath("revisions").exists()  # the bind mount lived in the mapper's namespace only
    assert evict(layout, budget_bytes=0).evicted == (manifest_a.digest_hex,)


def _lying_source(model: Path, dest: Path, lie: str) -> None:
    shutil.copytree(model, dest)
    manifest = build_manifest(dest, block_size=BLOCK)
    files = {f.path: f for f in manifest.files}
    if lie == "size":
        files["config.json"] = dataclasses.replace(files["config.json"], size=files["config.json"].size + 7)
    elif lie == "hash":
        weights = files["model.safetensors"]
        files["model.safetensors"] = dataclasses.replace(weights, blocks=(*weights.blocks[:3], "0" * 64,
                                                                          *weights.blocks[4:]))
    elif lie == "missing":
        files["extra.bin"] = dataclasses.replace(files["config.json"], path="extra.bin")
    if lie == "dotdot":
        body = json.loads(manifest.to_text())
        body["files"][0]["path"] = "../escaped.json"
        (dest / MANIFEST_FILENAME).write_text(json.dumps(body))
        return
    write_manifest(dest, Manifest(BLOCK, tuple(sorted(files.values(), key=lambda f: f.path))))


@pytest.mark.parametrize(
    ("lie", "error", "says"),
    [
        ("size", ManifestError, r"says 'config.json' has \d+ bytes, the source has another size"),
        ("hash", BlockCorruptError, "block 3 .* never matched the manifest's SHA-256 in 3 fetches"),
        ("missing", SourceMissingError, "extra.bin: not found at the source"),
        ("dotdot", ManifestError, "'..' component"),
    ],
)
def test_bad_input_fails_clearly_and_leaves_the_cache_as_it_was(
    model_a: Path, tmp_path: Path, lie: str, error: type[Exception], says: str
) -> None:
    layout = CacheLayout(tmp_path / "cache")
    _publish_source(model_a, tmp_path / "good")
    with serve_directory(tmp_path / "good") as server:
        fill_revision(layout, _source(server))  # a cache with a revision in it already
    before = _listing(layout.root)
    _lying_source(model_a, tmp_path / "bad", lie)
    with serve_directory(tmp_path / "bad") as server, pytest.raises(error, match=says):
        fill_revision(layout, _source(server))
    # A hash lie is found only by downloading: its lease file stays (versions must never repeat),
    # released; everything else -- blocks, manifests, staging, revisions -- is as it was.
    after = _listing(layout.root, skip=("leases/",))
    assert after == [e for e in before if not e[0].startswith("leases/")]
    if lie != "hash":
        assert _listing(layout.root) == before
    assert not (tmp_path / "escaped.json").exists()
