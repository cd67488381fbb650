"""JSON access to the Kubernetes API server, by path, with plain dicts: the one client the operator
(``warmpool_operator.io.kube``) and the node agent (``warmpool_nodecache.agent_kube``) both build
on, with one error type and one format of a Lease's times.

Every request is bounded in time.  ``kubernetes_asyncio`` (configuration, authentication, TLS) is
imported only when a client connects: the worker image ships this package and has no need of it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import aiohttp

Obj = dict[str, Any]

#: Every API call is bounded in time (connect, read) seconds.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=30.0, connect=5.0)
#: Requests one client has in flight at once; the others wait their turn before their time bound
#: starts.  Unbounded, 1,000 WarmModels created at once put thousands of requests in the
#: connection pool's queue, where their 30 s ran out (the whole burst then retried); a server on
#: 2 cores took the same objects fastest at 4-16 in flight (`warmpool bench scale`'s floor sweep).
DEFAULT_MAX_IN_FLIGHT = 16
MERGE_PATCH = "application/merge-patch+json"
#: RFC 6902: its "test" operations make a write conditional on what the object holds.
JSON_PATCH = "application/json-patch+json"
#: Server-side apply: JSON is YAML, so the body is sent as JSON under this content type.
APPLY_PATCH = "application/apply-patch+yaml"
#: The format of a Lease's acquireTime and renewTime (MicroTime).
MICRO_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"


class KubeError(Exception):
    """The API server answered with an error status; ``reason`` is its Status reason ("Conflict")."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


async def client_from_environment() -> Any:
    """A ``kubernetes_asyncio`` ApiClient: the in-cluster configuration in a pod, else the
    kubeconfig ($KUBECONFIG honoured)."""
    from kubernetes_asyncio import client, config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
        return client.ApiClient()
    except config.ConfigException:
        return await config.new_client_from_config()


class KubeClient:
    """The API by path: ``request`` returns the decoded JSON answer or raises :class:`KubeError`."""

    def __init__(self, api_client: Any, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.api_client = api_client
        self.max_in_flight = max_in_flight
        self._gate = asyncio.Semaphore(max_in_flight)

    async def close(self) -> None:
        await self.api_client.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        async with self._gate:
            response = await self.api_client.call_api(
                path,
                method,
                query_params=list((query or {}).items()),
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            )
            raw = await response.read()
        status = int(response.status)
        try:
            data = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            data = {"message": raw.decode(errors="replace")[:500]}
        if status >= 300:
            raise KubeError(status, str(data.get("reason", "")), str(data.get("message", ""))[:2000])
        result: Obj = data
        return result


def micro_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime(MICRO_TIME)
