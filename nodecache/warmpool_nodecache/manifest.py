"""The revision manifest: which files a model revision has, their sizes and their blocks' SHA-256.

Format (JSON, UTF-8, stored beside the model's files at a source as
``contract.MANIFEST_FILENAME``)::

    {
      "format": "warmpool.manifest/v1",     # contract.MANIFEST_FORMAT
      "block_size": 4194304,                # bytes per block (the last block of a file may be shorter)
      "files": [                            # sorted by path, each path once
        {"path": "model.safetensors", "size": 9000000, "blocks": ["<64 hex>", "<64 hex>", "<64 hex>"]}
      ]
    }

A file of ``size`` bytes has exactly ``ceil(size / block_size)`` blocks (none when empty).
The manifest's canonical form (sorted keys, no spaces) hashed with SHA-256 is the revision's
digest, ``sha256:<hex>``: two sources serving the same bytes name the same revision, and a
manifest cannot change without changing its name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from warmpool.contract.files import MANIFEST_FILENAME

#: A revision manifest's format tag and its file name beside the model's files at a source.
MANIFEST_FORMAT = "warmpool.manifest/v1"
#: The block size revisions are split into (and hashed by) unless a manifest says otherwise.
DEFAULT_BLOCK_SIZE = 4 * 1024 * 1024


_HEX64 = re.compile(r"[0-9a-f]{64}")


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the manifest and what is wrong."""


@dataclass(frozen=True)
class ManifestFile:
    path: str  # relative POSIX path under the revision's root
    size: int
    blocks: tuple[str, ...]  # SHA-256 hex of each block, in file order


@dataclass(frozen=True)
class BlockRef:
    """One block of one file: where its bytes lie in the file and what they hash to."""

    path: str
    index: int
    offset: int
    length: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    block_size: int
    files: tuple[ManifestFile, ...]

    def to_text(self) -> str:
        """The canonical JSON text (the digest is taken over exactly these bytes)."""
        body = {
            "format": MANIFEST_FORMAT,
            "block_size": self.block_size,
            "files": [{"path": f.path, "size": f.size, "blocks": list(f.blocks)} for f in self.files],
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.to_text().encode()).hexdigest()

    @property
    def digest_hex(self) -> str:
        return self.digest.removeprefix("sha256:")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def block_refs(self) -> Iterator[BlockRef]:
        """Every block of every file, files in manifest order."""
        for f in self.files:
            for index, sha in enumerate(f.blocks):
                offset = index * self.block_size
                yield BlockRef(f.path, index, offset, min(self.block_size, f.size - offset), sha)

    def unique_blocks(self) -> set[str]:
        return {sha for f in self.files for sha in f.blocks}


def _block_count(size: int, block_size: int) -> int:
    return -(-size // block_size)


def _check_path(path: object, where: str) -> str:
    """A relative POSIX path that stays under the revision's root, or a ManifestError."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{where}: path must be a non-empty string, got {path!r}")
    if "\\" in path or "\x00" in path:
        raise ManifestError(f"{where}: path {path!r} holds a backslash or NUL")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        raise ManifestError(f"{where}: path {path!r} is absolute; it must be relative to the revision")
    parts = path.split("/")
    if ".." in parts:
        raise ManifestError(f"{where}: path {path!r} has a '..' component and would escape the revision")
    if any(part in ("", ".") for part in parts):
        raise ManifestError(f"{where}: path {path!r} has an empty or '.' component; write it normalised")
    if path == MANIFEST_FILENAME:
        raise ManifestError(f"{where}: path {path!r} is the manifest's own name")
    return path


def parse_manifest(text: str | bytes, source: str = "<manifest>", max_block_size: int | None = None) -> Manifest:
    """Load and validate a manifest; every inconsistency is a ManifestError naming `source`.

    ``max_block_size``: the largest ``block_size`` accepted (a reader holds whole blocks).  Until
    the text is known to be a manifest, the errors quote nothing of it: whatever a URL answered
    (an internal endpoint's JSON, say) stays out of the message and so out of any status."""
    try:
        body = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise ManifestError(f"{source}: not JSON") from None
    if not isinstance(body, dict):
        raise ManifestError(f"{source}: must be a JSON object, got {type(body).__name__}")
    if body.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{source}: format is not the expected {MANIFEST_FORMAT!r}")
    block_size = body.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ManifestError(f"{source}: block_size must be a positive integer")
    if max_block_size is not None and block_size > max_block_size:
        raise ManifestError(f"{source}: block_size {block_size} is above the {max_block_size}-byte limit "
                            "this reader holds a block in")
    raw_files = body.get("files")
    if not isinstance(raw_files, list):
        raise ManifestError(f"{source}: files must be a list, got {type(raw_files).__name__}")
    files: list[ManifestFile] = []
    seen: set[str] = set()
    for i, entry in enumerate(raw_files):
        where = f"{source}: files[{i}]"
        if not isinstance(entry, dict):
            raise ManifestError(f"{where}: must be an object")
        path = _check_path(entry.get("path"), where)
        where = f"{source}: file {path!r}"
        if path in seen:
            raise ManifestError(f"{where}: listed twice")
        seen.add(path)
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"{where}: size must be an integer >= 0, got {size!r}")
        blocks = entry.get("blocks")
        if not isinstance(blocks, list):
            raise ManifestError(f"{where}: blocks must be a list")
        want = _block_count(size, block_size)
        if len(blocks) != want:
            raise ManifestError(
                f"{where}: size {size} at block_size {block_size} needs {want} blocks, the manifest lists {len(blocks)}"
            )
        for j, sha in enumerate(blocks):
            if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
                raise ManifestError(f"{where}: block {j} hash {sha!r} is not 64 lowercase hex digits (SHA-256)")
        files.append(ManifestFile(path, size, tuple(blocks)))
    # A file may not also be a directory of another file ("a" and "a/b").
    for path in seen:
        for parent in PurePosixPath(path).parents:
            if str(parent) in seen:
                raise ManifestError(f"{source}: {str(parent)!r} is a file and also the directory of {path!r}")
    return Manifest(block_size, tuple(sorted(files, key=lambda f: f.path)))


def build_manifest(directory: Path, block_size: int = DEFAULT_BLOCK_SIZE) -> Manifest:
    """The manifest of every regular file under `directory` (symlinks followed; the manifest file itself skipped)."""
    if block_size <= 0:
        raise ManifestError(f"block_size must be positive, got {block_size}")
    if not directory.is_dir():
        raise ManifestError(f"{directory}: not a directory")
    files: list[ManifestFile] = []
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=True):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            relative = full.relative_to(directory).as_posix()
            if relative == MANIFEST_FILENAME or not full.is_file():
                continue
            hashes: list[str] = []
            size = 0
            with open(full, "rb") as fh:
                while chunk := fh.read(block_size):
                    hashes.append(hashlib.sha256(chunk).hexdigest())
                    size += len(chunk)
            files.append(ManifestFile(_check_path(relative, str(directory)), size, tuple(hashes)))
    return Manifest(block_size, tuple(sorted(files, key=lambda f: f.path)))


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    """Write `manifest` beside the files it describes, as a source serves it (atomically)."""
    final = directory / MANIFEST_FILENAME
    tmp = directory / f".{MANIFEST_FILENAME}.tmp-{os.getpid()}"
    tmp.write_text(manifest.to_text())
    os.rename(tmp, final)
    return final
