"""The revision manifest: built from real files, canonical, and refused with a clear reason when it lies."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from warmpool_nodecache.manifest import (
    DEFAULT_BLOCK_SIZE,
    MANIFEST_FORMAT,
    ManifestError,
    build_manifest,
    parse_manifest,
)

pytestmark = pytest.mark.unit


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "model"
    (root / "sub").mkdir(parents=True)
    (root / "big.bin").write_bytes(bytes(range(256)) * 40)  # 10240 bytes: 3 blocks of 4096
    (root / "sub" / "small.json").write_text('{"a": 1}')
    (root / "empty").write_bytes(b"")
    return root


def test_build_splits_files_into_hashed_blocks_and_round_trips(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    manifest = build_manifest(root, block_size=4096)
    by_path = {f.path: f for f in manifest.files}
    assert list(by_path) == ["big.bin", "empty", "sub/small.json"]
    data = (root / "big.bin").read_bytes()
    assert by_path["big.bin"].size == 10240
    assert by_path["big.bin"].blocks == tuple(hashlib.sha256(data[i:i + 4096]).hexdigest() for i in (0, 4096, 8192))
    assert by_path["empty"].blocks == ()
    refs = [r for r in manifest.block_refs() if r.path == "big.bin"]
    assert [(r.offset, r.length) for r in refs] == [(0, 4096), (4096, 4096), (8192, 2048)]
    again = parse_manifest(manifest.to_text())
    assert again == manifest and again.digest == manifest.digest
    assert manifest.digest == "sha256:" + hashlib.sha256(manifest.to_text().encode()).hexdigest()
    assert json.loads(manifest.to_text())["format"] == MANIFEST_FORMAT


def test_the_default_block_size_is_4_mib_and_the_digest_changes_with_any_byte(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    first = build_manifest(root)
    assert first.block_size == DEFAULT_BLOCK_SIZE == 4 * 1024 * 1024
    (root / "sub" / "small.json").write_text('{"a": 2}')
    assert build_manifest(root).digest != first.digest


def _body(**file: object) -> str:
    entry = {"path": "w.bin", "size": 5, "blocks": ["a" * 64]}
    entry.update(file)
    return json.dumps({"format": MANIFEST_FORMAT, "block_size": 4, "files": [entry]})


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (_body(path="../etc/passwd"), "'..' component"),
        (_body(path="a/../../x"), "'..' component"),
        (_body(path="/etc/passwd"), "absolute"),
        (_body(path="a//b"), "empty or '.' component"),
        (_body(path="warmpool-manifest.json"), "manifest's own name"),
        (_body(size=-1), "size must be an integer >= 0"),
        (_body(size=9), "needs 3 blocks, the manifest lists 1"),
        (_body(blocks=["xyz", "a" * 64]), "block 0 hash 'xyz' is not 64 lowercase hex"),
        (_body(blocks=["A" * 64, "a" * 64]), "not 64 lowercase hex"),
        (json.dumps({"format": "other/v9", "block_size": 4, "files": []}), "expected 'warmpool.manifest/v1'"),
        (json.dumps({"format": MANIFEST_FORMAT, "block_size": 0, "files": []}), "block_size must be a positive"),
        ("{not json", "not JSON"),
    ],
)
def test_a_bad_manifest_is_refused_naming_what_is_wrong(body: str, says: str) -> None:
    with pytest.raises(ManifestError, match=says.replace("(", r"\(").replace(")", r"\)")):
        parse_manifest(body, "src/warmpool-manifest.json")


def test_duplicates_and_a_file_that_is_also_a_directory_are_refused() -> None:
    entry = {"path": "w.bin", "size": 0, "blocks": []}
    twice = json.dumps({"format": MANIFEST_FORMAT, "block_size": 4, "files": [entry, entry]})
    with pytest.raises(ManifestError, match="listed twice"):
        parse_manifest(twice)
    nested = json.dumps({"format": MANIFEST_FORMAT, "block_size": 4,
                         "files": [entry, {"path": "w.bin/x", "size": 0, "blocks": []}]})
    with pytest.raises(ManifestError, match="is a file and also the directory of"):
        parse_manifest(nested)
