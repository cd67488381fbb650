"""Names the node agent and the operator derive alike from a revision or a source.

The constants they are made of live in :mod:`warmpool.contract`; these two functions are the
one place that turns a digest or a source block into them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from warmpool.contract.nodecache import CACHE_NODE_LABEL_HEX, CACHE_NODE_LABEL_PREFIX


def cache_node_label(digest: str) -> str:
    """The node label key saying a node holds revision ``sha256:<hex>`` (or bare hex)."""
    hex_ = digest.removeprefix("sha256:")
    if len(hex_) != 64 or any(c not in "0123456789abcdef" for c in hex_):
        raise ValueError(f"{digest!r} is not a sha256 digest")
    return f"{CACHE_NODE_LABEL_PREFIX}/sha256-{hex_[:CACHE_NODE_LABEL_HEX]}"


def source_fingerprint(source: Mapping[str, object]) -> str:
    """A short stable name of an object-store source block ({"http": {...}} or {"s3": {...}},
    camelCase): the node agents' status entries carry it, so the operator never uses a digest
    read from an older source after the spec changed."""
    canonical = json.dumps(source, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
