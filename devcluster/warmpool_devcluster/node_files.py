"""Files the real node's pods read from hostPath: models put where a non-root container can read them.

Worker pods run as UID 65532, and a developer's caches usually live under a home directory that
other users cannot enter (``/root`` is 0700), so a model fetched or generated there is published
into the node's data directory first: every folder on the way 0755, every file 0644, hard links
where the filesystem allows (no copy of gigabytes), a copy elsewhere.  The directory is the dev
cluster's own, never the node agent's cache root (which tenants must not be able to mount).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: Overrides where the dev cluster's node keeps the files its pods mount.
ENV_NODE_DATA = "WARMPOOL_NODE_DATA"
DEFAULT_NODE_DATA = Path("/var/lib/warmpool-dev")


def node_data_root() -> Path:
    return Path(os.environ.get(ENV_NODE_DATA) or DEFAULT_NODE_DATA)


def node_models_root() -> Path:
    """Where models for the node's pods live (created readable by every user)."""
    root = node_data_root() / "models"
    _readable_dirs(root)
    return root


def _readable_dirs(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for folder in (path, *path.parents):
        if folder == folder.parent:
            break
        if folder.stat().st_mode & 0o005 != 0o005:
            if folder == node_data_root() or node_data_root() in folder.parents:
                folder.chmod(0o755)
            else:
                break  # not ours to open up; the caller's choice of root is then at fault


def publish(source: Path, name: str) -> Path:
    """``source`` (a model directory) as ``<node models root>/<name>``, readable by the pods' UID.

    Idempotent: files already published with the same size and mtime are kept.  Returns the path.
    """
    if not source.is_dir():
        raise FileNotFoundError(f"no model directory at {source}")
    dest = node_models_root() / name
    for folder, _, files in os.walk(source):
        relative = Path(folder).relative_to(source)
        target_dir = dest / relative
        target_dir.mkdir(parents=True, exist_ok=True)
        target_dir.chmod(0o755)
        for file in files:
            src, dst = Path(folder) / file, target_dir / file
            if dst.exists() and dst.stat().st_size == src.stat().st_size and dst.stat().st_mtime == src.stat().st_mtime:
                continue
            dst.unlink(missing_ok=True)
            try:
                os.link(src, dst)
            except OSError:  # another filesystem: a copy
                shutil.copy2(src, dst)
            if dst.stat().st_mode & 0o044 != 0o044:
                dst.chmod(0o644)
    return dest
