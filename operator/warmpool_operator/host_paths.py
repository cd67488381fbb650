"""Which node directories a WarmModel may mount (pure).

A hostPath volume hands a worker pod a directory of the node.  Anyone who may create a
WarmModel could otherwise have the operator mount ``/etc`` or ``/var/lib/kubelet`` (the
node's credentials) into a pod they control, so the operator mounts only directories
under the prefixes it was given (``--allowed-host-path``, repeatable) and refuses the
WarmModel otherwise (``Degraded``, reason ``HostPathNotAllowed``; no child is made).

Paths and prefixes are compared after normalisation (``..`` and ``.`` resolved, repeated
and trailing slashes dropped) and by whole path segments: ``/models`` allows
``/models/llama`` but not ``/modelsX`` nor ``/models/../etc``.  Symbolic links on the node
cannot be seen from here: an allowed prefix must not hold links that lead out of it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from warmpool import contract
from warmpool_operator.api import WarmModelSpec

#: The default prefixes: the node-local model cache root and a conventional models mount.
DEFAULT_ALLOWED_HOST_PATHS: tuple[str, ...] = ("/var/lib/warmpool", "/models")


class BadHostPathPrefix(ValueError):
    """An ``--allowed-host-path`` that is not an absolute path."""


def normalise(path: str) -> str:
    """``path`` with ``.``/``..`` resolved and repeated or trailing slashes dropped.

    Absolute paths only (ValueError otherwise).  ``..`` above the root stays at the root,
    as the kernel resolves it.  POSIX keeps a leading ``//``; we do not.
    """
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not an absolute path")
    return posixpath.normpath("/" + path.lstrip("/"))


def normalise_prefixes(prefixes: Iterable[str]) -> tuple[str, ...]:
    """The prefixes normalised, duplicates dropped, order kept; BadHostPathPrefix on a relative one."""
    out: list[str] = []
    for prefix in prefixes:
        try:
            clean = normalise(prefix.strip())
        except ValueError as error:
            raise BadHostPathPrefix(f"--allowed-host-path {error}") from None
        if clean not in out:
            out.append(clean)
    return tuple(out)


def is_allowed(path: str, prefixes: Iterable[str]) -> bool:
    """Whether ``path`` is one of the (normalised) prefixes or lies below one, segment-wise."""
    clean = normalise(path)
    return any(prefix == "/" or clean == prefix or clean.startswith(prefix + "/") for prefix in prefixes)


def mounted_host_paths(spec: WarmModelSpec, cache_root: str = contract.DEFAULT_BLOCK_CACHE_ROOT) -> tuple[str, ...]:
    """Every node directory the worker pods of ``spec`` would mount (as the builders write it)."""
    model = spec.model
    if model.object_store() is not None:  # the node cache (cache_source.py): its revisions, or all of it
        if model.start_on_partial_cache:
            return (cache_root.rstrip("/"),)
        return (f"{cache_root.rstrip('/')}/{contract.CACHE_REVISIONS_DIR}",)
    if model.host_path is not None:
        return (model.host_path.path,)
    if model.node_cache is not None:
        return (f"{model.node_cache.root.rstrip('/')}/{model.node_cache.key}",)
    return ()


def refusal(
    spec: WarmModelSpec, prefixes: tuple[str, ...], cache_root: str = contract.DEFAULT_BLOCK_CACHE_ROOT
) -> str | None:
    """None when every hostPath of ``spec`` lies under ``prefixes``; else why not (for the status)."""
    refused = [path for path in mounted_host_paths(spec, cache_root) if not is_allowed(path, prefixes)]
    if not refused:
        return None
    allowed = ", ".join(prefixes) or "(none)"
    return (
        f"hostPath {', '.join(refused)} is outside the directories this operator may mount "
        f"({allowed}; set by --allowed-host-path / the chart's operator.allowedHostPaths): "
        "no pod is created"
    )
