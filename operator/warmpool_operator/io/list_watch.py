"""List, then watch, one kind of object through the shared Kubernetes client (warmpool/kube.py).

For small, label-filtered views of the cluster that need nothing of kopf's handler machinery (the
activator's three, the operator's view of the activator's own addresses, which live outside the
namespaces kopf watches): :func:`list_watch` lists, hands every object to ``on_event``, says once that
it is in sync, then follows the watch from the list's resourceVersion.  A watch the API server
ends (its ``timeoutSeconds``) is started again where it left off; one whose place is gone (410)
lists again.  Every request stays inside the client's time bound: the server is asked to end
each watch well before it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from warmpool.kube import KubeClient, KubeError

log = logging.getLogger("warmpool")

#: Seconds the API server keeps one watch open (below the client's 30 s bound on a request).
WATCH_SECONDS = 20
#: Seconds between tries after a failed list or watch.
RETRY_SECONDS = 2.0

OnEvent = Callable[[str, Mapping[str, Any]], None]


async def _watch_once(client: KubeClient, path: str, query: dict[str, str], on_event: OnEvent) -> str | None:
    """Follow one watch; the resourceVersion to go on from, None when it must list again."""
    response = await client.api_client.call_api(
        path, "GET", query_params=list({**query, "watch": "true", "timeoutSeconds": str(WATCH_SECONDS),
                                         "allowWatchBookmarks": "true"}.items()),
        header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
        _preload_content=False, _request_timeout=aiohttp.ClientTimeout(total=WATCH_SECONDS + 10, connect=5.0))
    version: str | None = query.get("resourceVersion")
    try:
        if int(response.status) != 200:
            text = (await response.read()).decode(errors="replace")[:300]
            raise KubeError(int(response.status), "", text)
        async for raw in response.content:
            if not raw.strip():
                continue
            event = json.loads(raw)
            kind, obj = str(event.get("type")), event.get("object") or {}
            if kind == "ERROR":
                if int(obj.get("code") or 0) == 410:
                    return None
                raise KubeError(int(obj.get("code") or 500), str(obj.get("reason") or ""), str(obj.get("message")))
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind != "BOOKMARK":
                on_event(kind, obj)
    finally:
        response.release()
    return version


async def list_watch(client: KubeClient, path: str, selector: str | None, on_event: OnEvent,
                     on_list: Callable[[], None], synced: asyncio.Event) -> None:
    """Keep ``on_event`` fed with every change of the objects at ``path`` (a collection, e.g.
    /api/v1/services) matching ``selector``; runs until cancelled.  ``on_list`` is called before
    each full list (the view starts over), ``synced`` is set after the first."""
    query = {"labelSelector": selector} if selector else {}
    version: str | None = None
    while True:
        try:
            if version is None:
                listed = await client.request("GET", path, query=query or None)
                on_list()
                for item in listed.get("items") or []:
                    on_event("ADDED", item)
                version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
                synced.set()
            version = await _watch_once(client, path, {**query, "resourceVersion": version}, on_event)
        except asyncio.CancelledError:
            raise
        except (KubeError, aiohttp.ClientError, TimeoutError, ValueError, OSError) as error:
            log.warning("watch of %s failed (%s: %s): again in %gs", path, type(error).__name__, error,
                        RETRY_SECONDS)
            version = None
            await asyncio.sleep(RETRY_SECONDS)
