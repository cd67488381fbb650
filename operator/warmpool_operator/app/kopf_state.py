"""Where kopf keeps its per-WarmModel state, so that a handler that succeeds at once writes none.

kopf's stock storages write onto the object: the essence it last handled (an annotation, to tell
a spec change from a status write), and a marker annotation naming our prefix as kopf's (written
with the first progress it stores, even for a handler that succeeded at once and left no progress).
At 1,000 WarmModels those were two writes each on top of the pass's own, and a second copy of every
spec in every watch event and in every copy the operator holds.

* :class:`MemoryDiffBaseStorage`: the essence in memory, compactly (a JSON string per WarmModel,
  by uid).  After a restart nothing is remembered, so kopf sees every WarmModel as new and calls its
  creation handler: the same handler as resume (app/handlers.py's ``reconcile``), so a restart does
  what it did.  The annotation an older operator left is not read: the watch cache drops it
  (io/watch_cache.py).
* :class:`QuietProgressStorage`: progress in annotations, as before, and the marker only when
  progress is really written (a handler retried).
"""

from __future__ import annotations

import json
from typing import Any, cast

import kopf

#: kopf's marker annotation name under a storage's prefix (kopf's StorageKeyMarkingConvention).
KOPF_MARKER = "kopf-managed"


class MemoryDiffBaseStorage(kopf.DiffBaseStorage):
    def __init__(self) -> None:
        super().__init__()
        self._essences: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._essences)

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        encoded = self._essences.get(str(body.metadata.uid))
        return None if encoded is None else cast(kopf.BodyEssence, json.loads(encoded))

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        self._essences[str(body.metadata.uid)] = json.dumps(essence, separators=(",", ":"))

    def forget(self, uid: str) -> None:
        """The WarmModel is gone: its essence goes with it."""
        self._essences.pop(uid, None)


class QuietProgressStorage(kopf.AnnotationsProgressStorage):
    def purge(self, *, key: kopf.HandlerId, body: kopf.Body, patch: kopf.Patch) -> None:
        """kopf's purge, then the marker dropped from the patch when no progress of ours is in it."""
        super().purge(key=key, body=body, patch=patch)
        meta: dict[str, Any] = patch.get("metadata") or {}
        annotations: dict[str, Any] = meta.get("annotations") or {}
        marker = f"{self.prefix}/{KOPF_MARKER}"
        if marker not in annotations:
            return
        ours = [k for k, v in annotations.items() if k.startswith(f"{self.prefix}/") and k != marker and v is not None]
        if ours:
            return
        del annotations[marker]
        if not annotations:
            meta.pop("annotations", None)
        if not meta:
            patch.pop("metadata", None)
