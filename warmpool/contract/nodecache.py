"""The node cache, as the node agent, the operator and worker pods agree on it: mount paths,
the cache's directories, node labels, field managers, Lease and container names.

Part of the contract: names both sides must agree on, each defined once (see warmpool/contract/__init__.py)."""

from __future__ import annotations

from warmpool.contract.api import API_GROUP

# --- The node agent and the operator, about object-store model sources ----------------
#: The cache root's subdirectory of published revisions (warmpool_nodecache.layout names it too).
CACHE_REVISIONS_DIR = "revisions"
#: The cache root's subdirectory of trust domains (one a namespace): ``<this>/<domain>/`` holds what
#: that domain may use -- its links to revisions and partial views, and the blocks it verified.
CACHE_DOMAINS_DIR = "domains"
#: A domain's links to the published revisions it verified itself: ``<domains>/<domain>/<this>/<hex>``.
CACHE_GRANTED_DIR = "revisions"
#: A domain's links to partial views: ``<domains>/<domain>/<this>/<digest hex>`` names a fill's view
#: while it fills, then the published revision (spec.model.startOnPartialCache).
CACHE_PARTIAL_DIR = "partial"
#: Where the init container of an object-store pod sees the whole node cache (read-only, the
#: operator's own image only); the worker container mounts only its revision (a ``subPath`` of
#: its domain's link), never this.
CACHE_ROOT_MOUNT_PATH = "/warmpool/node-cache"
#: Node label saying the node's cache holds a published revision: key ``<prefix>/sha256-<56 hex>``
#: (a label name is at most 63 characters; 56 hex digits = 224 bits still name one revision).
CACHE_NODE_LABEL_PREFIX = f"cache.{API_GROUP}"
CACHE_NODE_LABEL_HEX = 56
CACHE_NODE_LABEL_VALUE = "published"
#: Name of the init container that holds a worker pod until its revision is published on the node.
CACHE_WAIT_CONTAINER = "wait-cache"
#: A fill's partial view of a revision (its files while blocks land, hottest first; see
#: warmpool.fill_progress): the progress record's format tag, and the record's name inside the
#: view's directory (inside, so a pod that mounts only the view sees it; a manifest may not name it).
FILL_PROGRESS_FORMAT = "warmpool.fill-progress/v1"
FILL_PROGRESS_NAME = ".warmpool-fill-progress"
