"""Status, the pass's last step: the WarmModel's status subresource written when it changed, and
an Event when its Ready condition turned."""

from __future__ import annotations

import asyncio

import kopf

from warmpool.kube import KubeError
from warmpool_operator.io.kube import WARMMODELS, Kube
from warmpool_operator.model import Obj
from warmpool_operator.rules.status import ready_transitions

#: Optional status blocks of features that may be turned off, or of pods that may all go: then
#: their figures go (a merge patch leaves a key it does not name).
OPTIONAL_BLOCKS = ("forecast", "learnedBuckets", "pods", "podsNotListed")


async def write_status(kube: Kube, body: Obj, status: Obj, *, announce: bool = False) -> None:
    """Merge-patch the status subresource when it differs from ``body``'s (the conditions list is
    written whole: every pass computes all of them).  A 409 is retried a few times; what was
    written becomes ``body``'s status, so the next pass sees it before the watch's echo.
    ``announce``: post an Event for each Ready transition written (rules/status.py says which)."""
    old = body.get("status") or {}
    await _patch(kube, body, status)
    if announce:
        for event in ready_transitions(old, body.get("status") or {}):
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)  # type: ignore[arg-type]


async def _patch(kube: Kube, body: Obj, status: Obj) -> None:
    old = body.get("status") or {}
    for optional in OPTIONAL_BLOCKS:  # a feature turned off, or no pods: its figures go (merge patch)
        if optional not in status and old.get(optional) is not None:
            status[optional] = None
    if all(old.get(k) == v for k, v in status.items()):
        return
    meta = body["metadata"]
    for attempt in range(3):
        try:
            written = await kube.patch(WARMMODELS, meta["namespace"], meta["name"], {"status": status},
                                       subresource="status")
            if written.get("metadata", {}).get("uid") == meta["uid"]:
                body["status"] = written.get("status") or status
            return
        except KubeError as error:
            if error.status == 404:
                return  # deleted meanwhile
            if error.status != 409 or attempt == 2:
                raise
            await asyncio.sleep(0.2 * (attempt + 1))
