"""Whether a live child still holds what its builder asks for (pure): the comparison that decides
whether the operator writes a child again."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _empty(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == "" or value == [] or value == {}


#: Maps whose every key matters: an extra key in a selector selects other pods.
EXACT_MAPS = frozenset({"selector", "matchLabels", "nodeSelector"})


def covers(live: Any, desired: Any, exact: bool = False) -> bool:
    """Whether the live object holds everything ``desired`` says (pure).

    Maps: every desired key, recursively (keys the API server defaults, such as a port's
    protocol, may be extra), except selectors (:data:`EXACT_MAPS`), whose keys must be the same;
    lists: the same length, item by item (an extra port, container or argument is drift);
    scalars: equal, where a zero value the server omits (``omitempty``) equals a missing one.
    """
    if isinstance(desired, Mapping):
        if live is None:
            return all(_empty(v) for v in desired.values())
        if not isinstance(live, Mapping):
            return False
        if exact and set(live) != set(desired):
            return False
        return all(covers(live.get(k), v, exact=k in EXACT_MAPS) for k, v in desired.items())
    if isinstance(desired, list):
        if live is None:
            return not desired
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(covers(have, want) for have, want in zip(live, desired, strict=True))
        )
    if live is None:
        return _empty(desired)
    return bool(live == desired)


def child_drifted(live: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether a child differs from its desired form in content, labels or annotations.

    Owner references are checked apart (:func:`owned_by`); status and server-set metadata
    are not compared.
    """
    want_meta = desired.get("metadata") or {}
    have_meta = live.get("metadata") or {}
    for key in ("labels", "annotations"):
        if not covers(have_meta.get(key) or {}, want_meta.get(key) or {}):
            return True
    return any(not covers(live.get(k), v) for k, v in desired.items() if k not in ("metadata", "status"))
