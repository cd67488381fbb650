"""What the activator knows of the cluster: which WarmModel a request is for, how long it may be
held, and where the pool's awake warm pods are.

Three watches feed it (activator/app.py): the WarmModels (their ``spec.pool.scaleToZero``), the
operator's Services (ClusterIP and name, to find a request's WarmModel by its Host header) and the
operator's pod EndpointSlices (the awake warm pods the Service routes to once there are any).
Each pool has an ``asyncio.Event`` set while it has pods, which held requests wait on.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from warmpool.contract.pods import LABEL_MODEL
from warmpool.contract.zero import LABEL_SERVICE_NAME, PODS_SLICE_SUFFIX
from warmpool_operator.api.types import DEFAULT_ZERO_HOLD_TIMEOUT_SECONDS, DEFAULT_ZERO_MAX_HELD_REQUESTS

PoolKey = tuple[str, str]  # (namespace, WarmModel name)


@dataclass(frozen=True)
class HoldPolicy:
    hold_timeout_s: float = DEFAULT_ZERO_HOLD_TIMEOUT_SECONDS
    max_held: int = DEFAULT_ZERO_MAX_HELD_REQUESTS


class Misdirected(Exception):
    """A request whose Host names no WarmModel this activator serves (or more than one)."""


@dataclass
class Pool:
    policy: HoldPolicy = field(default_factory=HoldPolicy)
    #: base URLs of the awake warm pods ("http://10.1.0.7:8000")
    pods: list[str] = field(default_factory=list)
    has_pods: asyncio.Event = field(default_factory=asyncio.Event)
    turn: int = 0

    def next_pod(self) -> str | None:
        if not self.pods:
            return None
        self.turn = (self.turn + 1) % len(self.pods)
        return self.pods[self.turn]


def _policy(body: Mapping[str, Any]) -> HoldPolicy:
    zero = ((body.get("spec") or {}).get("pool") or {}).get("scaleToZero") or {}
    return HoldPolicy(
        hold_timeout_s=float(zero.get("holdTimeoutSeconds") or DEFAULT_ZERO_HOLD_TIMEOUT_SECONDS),
        max_held=int(zero.get("maxHeldRequests") or DEFAULT_ZERO_MAX_HELD_REQUESTS),
    )


def _key(body: Mapping[str, Any]) -> PoolKey:
    meta = body.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def _pod_urls(body: Mapping[str, Any]) -> list[str]:
    ports = body.get("ports") or []
    if not ports or not ports[0].get("port"):
        return []
    port = int(ports[0]["port"])
    urls = []
    for endpoint in body.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        urls += [f"http://{ip}:{port}" for ip in endpoint.get("addresses") or []]
    return sorted(urls)


class Pools:
    """The activator's view (one per process); every method runs on the event loop."""

    def __init__(self) -> None:
        self.pools: dict[PoolKey, Pool] = {}
        #: ClusterIP -> pool, and Service name -> the namespaces that have one by that name
        self.by_ip: dict[str, PoolKey] = {}
        self.by_name: dict[str, set[str]] = {}
        self._service_ips: dict[PoolKey, list[str]] = {}

    def pool(self, key: PoolKey) -> Pool:
        return self.pools.setdefault(key, Pool())

    # ---------------------------------------------------------------- watch events

    def warmmodel(self, event: str, body: Mapping[str, Any]) -> None:
        key = _key(body)
        if event == "DELETED":
            self.pool(key).policy = HoldPolicy()
            return
        self.pool(key).policy = _policy(body)

    def service(self, event: str, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        model = (meta.get("labels") or {}).get(LABEL_MODEL)
        if not model:
            return
        key = (str(meta.get("namespace")), str(model))
        for ip in self._service_ips.pop(key, []):
            self.by_ip.pop(ip, None)
        if event == "DELETED":
            self.by_name.get(key[1], set()).discard(key[0])
            return
        spec = body.get("spec") or {}
        ips = [str(ip) for ip in (spec.get("clusterIPs") or [spec.get("clusterIP")]) if ip and ip != "None"]
        self._service_ips[key] = ips
        for ip in ips:
            self.by_ip[ip] = key
        self.by_name.setdefault(str(meta.get("name")), set()).add(key[0])

    def endpoint_slice(self, event: str, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        name = str(meta.get("name") or "")
        service = (meta.get("labels") or {}).get(LABEL_SERVICE_NAME)
        if not service or not name.endswith(PODS_SLICE_SUFFIX):
            return
        pool = self.pool((str(meta.get("namespace")), str(service)))
        pool.pods = [] if event == "DELETED" else _pod_urls(body)
        if pool.pods:
            pool.has_pods.set()
        else:
            pool.has_pods.clear()

    def relisted_endpoint_slices(self) -> None:
        """A full list follows: forget every pool's pods (the list brings back those that remain)."""
        for pool in self.pools.values():
            pool.pods = []
            pool.has_pods.clear()

    # ---------------------------------------------------------------- requests

    def resolve(self, host: str) -> PoolKey:
        """The WarmModel a request's Host header names: the Service's ClusterIP, or its DNS name
        (``<name>``, ``<name>.<namespace>``, ``<name>.<namespace>.svc[.<cluster domain>]``)."""
        name = _strip_port(host.strip().lower())
        if not name:
            raise Misdirected("the request has no Host header: send the WarmModel Service's name or ClusterIP")
        if _is_ip(name):
            key = self.by_ip.get(name)
            if key is None:
                raise Misdirected(f"Host {host!r} is no scale-to-zero WarmModel Service's ClusterIP")
            return key
        labels = name.split(".")
        if len(labels) >= 2:
            if labels[1] not in self.by_name.get(labels[0], set()):
                raise Misdirected(f"no WarmModel Service {labels[0]!r} in namespace {labels[1]!r}")
            return labels[1], labels[0]
        namespaces = sorted(self.by_name.get(labels[0], set()))
        if len(namespaces) != 1:
            where = f"in namespaces {', '.join(namespaces)}" if namespaces else "anywhere"
            raise Misdirected(f"Host {host!r} names WarmModel Service {labels[0]!r} {where}: send "
                              f"<name>.<namespace> or the ClusterIP")
        return namespaces[0], labels[0]


def _strip_port(host: str) -> str:
    if host.startswith("["):  # [v6]:port
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
