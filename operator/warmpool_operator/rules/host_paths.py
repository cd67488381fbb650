"""Which node directories a WarmModel may mount (pure).

A hostPath volume hands a worker pod a directory of the node.  Anyone who may create a
WarmModel could otherwise have the operator mount ``/etc`` or ``/var/lib/kubelet`` (the
node's credentials) into a pod they control, so the operator mounts only directories
under the prefixes it was given (``--allowed-host-path``, repeatable) and refuses the
WarmModel otherwise (``Degraded``, reason ``HostPathNotAllowed``; no child is made).

Paths and prefixes are compared after normalisation (``..`` and ``.`` resolved, repeated
and trailing slashes dropped) and by whole path segments: ``/models`` allows
``/models/llama`` but not ``/modelsX`` nor ``/models/../etc``.  Symbolic links on the node
cannot be seen from here; for the node cache the agents report the real path of each revision
directory (links resolved on the node), and those are checked too, so a link in the cache's
path cannot lead a mount out of the prefixes.  A hostPath source's own links stay unseen: an
allowed prefix must not hold links that lead out of it.

The node's block cache (``--block-cache-root``) holds every WarmModel's models, whoever made
them, so a WarmModel's own hostPath or nodeCache directory may never be it, lie inside it or
hold it, whatever the prefixes allow: only the operator mounts the cache, for http and s3
sources, each pod its own revision.

A hostPath among ``spec.pod.extraVolumes`` is held to the same prefixes and the same cache rule
(and the chart's admission policy refuses it at the API server already: admission-policies.yaml).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from warmpool.contract.files import DEFAULT_BLOCK_CACHE_ROOT
from warmpool_operator.api.types import WarmModelSpec

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


def mounted_host_paths(spec: WarmModelSpec, cache_root: str = DEFAULT_BLOCK_CACHE_ROOT) -> tuple[str, ...]:
    """Every node directory the worker pods of ``spec`` would mount (as the builders write it)."""
    model = spec.model
    if model.object_store() is not None:  # the node cache (rules/object_store_pods.py): the volume is its root
        return (cache_root.rstrip("/"), *spec.pod.extra_host_paths())
    return own_host_paths(spec)


def _overlaps(path: str, root: str) -> bool:
    """``path`` is ``root``, lies inside it, or holds it (segment-wise, after normalising)."""
    a, b = normalise(path), normalise(root)
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def own_host_paths(spec: WarmModelSpec) -> tuple[str, ...]:
    """The node directories the WarmModel names itself (hostPath, nodeCache, spec.pod.extraVolumes),
    not the cache's."""
    model = spec.model
    extra = spec.pod.extra_host_paths()
    if model.host_path is not None:
        return (model.host_path.path, *extra)
    if model.node_cache is not None:
        return (f"{model.node_cache.root.rstrip('/')}/{model.node_cache.key}", *extra)
    return extra


def refusal(
    spec: WarmModelSpec, prefixes: tuple[str, ...], cache_root: str = DEFAULT_BLOCK_CACHE_ROOT,
    reported: Iterable[tuple[str, str]] = (),
) -> str | None:
    """None when every hostPath of ``spec`` lies under ``prefixes``, and every real path the node
    agents ``reported`` ((node, path)) too, and none of its own is the block cache's; else why not
    (for the status)."""
    into_cache = [path for path in own_host_paths(spec) if _overlaps(path, cache_root)]
    if into_cache:
        return (
            f"hostPath {', '.join(into_cache)} would mount the node's block cache ({normalise(cache_root)}), "
            "which holds every WarmModel's models: name the model by an http or s3 source to use the cache; "
            "no pod is created"
        )
    refused = [path for path in mounted_host_paths(spec, cache_root) if not is_allowed(path, prefixes)]
    refused += [f"{path} (the real path on node {node})" for node, path in reported
                if path.startswith("/") and not is_allowed(path, prefixes)]
    if not refused:
        return None
    allowed = ", ".join(prefixes) or "(none)"
    return (
        f"hostPath {', '.join(refused)} is outside the directories this operator may mount "
        f"({allowed}; set by --allowed-host-path / the chart's operator.allowedHostPaths): "
        "no pod is created"
    )
