"""Worker pods of an object-store source (spec.model.http / .s3): the node cache's side (pure).

The node agent (``warmpool node-agent``, one per node) fills the revision into the node's
block cache and publishes it as ``<cache root>/revisions/<digest hex>`` by an atomic rename;
it reports the revision's digest (SHA-256 of its manifest), and per node the bytes cached,
in ``status.cacheNodes``.  The operator cannot know the digest before an agent has read the
manifest, so it waits for one (:func:`resolved_revision`), then builds pods that

* name the cache root as their volume, but mount only the WarmModel's namespace's link to the
  revision, ``domains/<namespace>/revisions/<digest hex>``: an init container waits until the
  link leads to a directory -- the agent makes it once the revision is published, so complete,
  and that namespace's own source sent every block of it (warmpool_nodecache.trust: a digest is
  not a capability) -- and only then does the worker container start, with that directory as its
  ``/warmpool/model`` (a ``subPath``, which the kubelet resolves and binds when it creates the
  worker container, after the init container has seen it whole: the worker never sees a
  half-filled revision, nor another revision, nor another namespace's).  The init container,
  which sees the whole cache, runs the operator's own worker image, never the WarmModel's
  ``spec.pod.image``;
* prefer (never require) nodes whose label says they hold the revision, so a pod lands where
  it downloads nothing, and still runs elsewhere, waiting on the fill there.

With ``spec.model.startOnPartialCache`` the pods start before the publish: the worker mounts
``domains/<namespace>/partial/<digest hex>`` (the agent's link to its fill's partial view, then to
the published revision; the kubelet binds the view's directory, which the publish renames with
the same inode, so the mount stays valid), the init container waits only for that link, and the
worker runs with ``--partial-cache``, waiting for each tensor's bytes before it touches them (the
fill's progress record lies inside the view, so inside the same mount).  Either way the
WarmModel's image sees its own revision's bytes and nothing else of the cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from warmpool import cachekeys
from warmpool.contract.files import MODEL_MOUNT_PATH
from warmpool.contract.nodecache import CACHE_WAIT_CONTAINER
from warmpool_operator.api.types import WarmModelSpec
from warmpool_operator.model import CacheRevision, Obj

#: Seconds the init container waits for the revision before it fails (the kubelet restarts it).
CACHE_WAIT_SECONDS = 3600
#: Weight of the preferred affinity for nodes holding the revision (the most a term may have).
AFFINITY_WEIGHT = 100


def resolved_revision(spec: WarmModelSpec, status: Mapping[str, Any] | None) -> str | None:
    """The digest the node agents report for the spec's current source, or None (not yet read).

    Entries for an older source (another fingerprint) are ignored.  Agents that read the same
    manifest agree; should two disagree (the source changed its bytes under the same URL), a
    digest already published somewhere wins, then the one most nodes report, then the smaller.
    """
    source = spec.model.object_store()
    if source is None:
        return None
    fingerprint = cachekeys.source_fingerprint(source)
    votes: dict[str, tuple[int, int]] = {}
    for entry in (status or {}).get("cacheNodes") or []:
        if not isinstance(entry, Mapping) or entry.get("source") != fingerprint:
            continue
        digest = entry.get("revision")
        if not isinstance(digest, str) or not digest.startswith("sha256:"):
            continue
        published, count = votes.get(digest, (0, 0))
        votes[digest] = (published + (1 if entry.get("published") is True else 0), count + 1)
    if not votes:
        return None
    return min(votes, key=lambda d: (-votes[d][0], -votes[d][1], d))


def reported_paths(spec: WarmModelSpec, status: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """(node, path) of every real path the node agents report for the current source's revision
    directories: what a hostPath mount there resolves to (links included)."""
    source = spec.model.object_store()
    if source is None:
        return []
    fingerprint = cachekeys.source_fingerprint(source)
    return [(str(entry.get("node")), entry["path"]) for entry in (status or {}).get("cacheNodes") or []
            if isinstance(entry, Mapping) and entry.get("source") == fingerprint and isinstance(entry.get("path"), str)]


def model_volume(cache: CacheRevision) -> tuple[Obj, Obj]:
    """The model volume (the cache root) and the worker's mount of it: the namespace's link to the
    revision (or to its partial view) alone, never the root."""
    volume: Obj = {"name": "model", "hostPath": {"path": cache.host_dir, "type": "DirectoryOrCreate"}}
    mount: Obj = {"name": "model", "mountPath": MODEL_MOUNT_PATH, "readOnly": True, "subPath": cache.link}
    return volume, mount


def wait_container(cache: CacheRevision, image: str, security: Mapping[str, Any]) -> Obj:
    """The init container that holds the pod until the revision is published on its node (for a
    partial start: until its partial view exists there; the worker waits for the bytes itself)."""
    what = "a partial view of revision" if cache.partial else "revision"
    script = (
        'n=0; until [ -d "$0" ]; do n=$((n+1)); '
        f'if [ "$n" -gt {CACHE_WAIT_SECONDS} ]; then '
        f'echo "{what} $0 not on this node within the wait: is the node agent running?" >&2; '
        "exit 1; fi; sleep 1; done"
    )
    return {
        "name": CACHE_WAIT_CONTAINER,
        "image": image,
        "command": ["sh", "-c", script, cache.waited_path],
        "volumeMounts": [{"name": "model", "mountPath": cache.wait_mount, "readOnly": True}],
        "securityContext": dict(security),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def preferred_affinity(cache: CacheRevision) -> Obj:
    """Prefer nodes whose agent labelled them as holding the revision."""
    return {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": AFFINITY_WEIGHT,
                    "preference": {
                        "matchExpressions": [
                            {"key": cachekeys.cache_node_label(cache.digest), "operator": "Exists"}
                        ]
                    },
                }
            ]
        }
    }
