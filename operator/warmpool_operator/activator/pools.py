"""What the activator knows of the pools: which WarmModel a request is for, how long it may be
held, and where the pool's awake warm pods are.

Three watches feed it (activator/app.py): the WarmModels (their uid, worker port and
``spec.pool.scaleToZero``), the operator's Services (ClusterIP and name, to find the WarmModel a
request names) and the operator's pod EndpointSlices (the awake warm pods the Service routes to
once there are any).  Each pool has an ``asyncio.Event`` set while it has pods, which held
requests wait on.

Ownership, never labels or names alone (anyone may label a Service or make a slice ending in
``-pods``): a Service counts only if it is named as the operator names the pool's Service and an
owner reference names the WarmModel's uid; a pool's pods come only from the slice named as the
operator names it, owned by that same uid.  What the request names is only a choice among pools:
whether the caller may have that pool is activator/callers.py's decision.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from warmpool.contract.http import DEFAULT_WORKER_PORT, WORKER_PORT_NAME
from warmpool.contract.pods import LABEL_MODEL
from warmpool_operator.activator.reach import Target
from warmpool_operator.api.types import (
    DEFAULT_ZERO_HOLD_TIMEOUT_SECONDS,
    DEFAULT_ZERO_MAX_HELD_REQUESTS,
    InvalidWarmModel,
)
from warmpool_operator.rules.builders import pod_labels, service_name
from warmpool_operator.rules.zero import pods_slice_name, scale_to_zero_of

log = logging.getLogger("warmpool.activator")

PoolKey = tuple[str, str]  # (namespace, WarmModel name)

#: What every refused resolution answers, whatever the reason (no such pool, not at zero, not
#: owned, or not reachable by this caller): a different text per reason would tell a stranger
#: which pools exist in which namespaces.
NOT_A_POOL = ("the request's Host names no scale-to-zero WarmModel Service this client can reach: send "
              "the Service's ClusterIP, <name> (in the client's own namespace) or <name>.<namespace>")


@dataclass(frozen=True)
class HoldPolicy:
    hold_timeout_s: float = DEFAULT_ZERO_HOLD_TIMEOUT_SECONDS
    max_held: int = DEFAULT_ZERO_MAX_HELD_REQUESTS


class Misdirected(Exception):
    """A request that names no pool this activator serves for its caller (the message is always
    :data:`NOT_A_POOL`; the reason is logged, never answered)."""

    def __init__(self, reason: str) -> None:
        super().__init__(NOT_A_POOL)
        self.reason = reason


@dataclass
class Pool:
    policy: HoldPolicy = field(default_factory=HoldPolicy)
    #: the WarmModel's uid (None until its watch brought it): what owns its Service and slices
    uid: str | None = None
    scale_to_zero: bool = False
    port: int = DEFAULT_WORKER_PORT
    #: base URLs of the awake warm pods ("http://10.1.0.7:8000")
    pods: list[str] = field(default_factory=list)
    has_pods: asyncio.Event = field(default_factory=asyncio.Event)
    turn: int = 0

    def next_pod(self) -> str | None:
        if not self.pods:
            return None
        self.turn = (self.turn + 1) % len(self.pods)
        return self.pods[self.turn]


@dataclass(frozen=True)
class _Seen:
    """A Service or an EndpointSlice as the watch brought it: its owners' uids and what it says."""

    owners: frozenset[str]
    model: str = ""
    ips: tuple[str, ...] = ()
    urls: tuple[str, ...] = ()


def _policy(body: Mapping[str, Any]) -> HoldPolicy | None:
    """The pool's hold policy; None when it has no scaleToZero, or one the API's model refuses
    (the API server's schema refuses it too: the activator holds nothing for it)."""
    try:
        spec = scale_to_zero_of(body)
    except InvalidWarmModel as error:
        namespace, name = _where(body)
        log.warning("WarmModel %s/%s: scaleToZero not held for: %s", namespace, name, error)
        return None
    if spec is None:
        return None
    return HoldPolicy(hold_timeout_s=float(spec.hold_timeout_seconds), max_held=spec.max_held_requests)


def _meta(body: Mapping[str, Any]) -> Mapping[str, Any]:
    return body.get("metadata") or {}


def _where(body: Mapping[str, Any]) -> tuple[str, str]:
    return str(_meta(body).get("namespace") or ""), str(_meta(body).get("name") or "")


def _owners(body: Mapping[str, Any]) -> frozenset[str]:
    return frozenset(str(ref.get("uid")) for ref in _meta(body).get("ownerReferences") or []
                     if isinstance(ref, Mapping) and ref.get("uid"))


def _pod_urls(body: Mapping[str, Any]) -> tuple[str, ...]:
    ports = body.get("ports") or []
    if not ports or not ports[0].get("port"):
        return ()
    port = int(ports[0]["port"])
    urls = []
    for endpoint in body.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        urls += [f"http://{ip}:{port}" for ip in endpoint.get("addresses") or [] if _is_ip(str(ip))]
    return tuple(sorted(urls))


class Pools:
    """The activator's view (one per process); every method runs on the event loop."""

    def __init__(self) -> None:
        self.pools: dict[PoolKey, Pool] = {}
        self._services: dict[tuple[str, str], _Seen] = {}
        self._slices: dict[tuple[str, str], _Seen] = {}
        #: ClusterIP -> (namespace, Service name)
        self.by_ip: dict[str, tuple[str, str]] = {}

    def pool(self, key: PoolKey) -> Pool:
        return self.pools.setdefault(key, Pool())

    def target(self, key: PoolKey) -> Target:
        """The pool's pods as a NetworkPolicy sees them (for the caller check)."""
        return Target(key[0], pod_labels(key[1]), self.pool(key).port, WORKER_PORT_NAME)

    # ---------------------------------------------------------------- watch events

    def warmmodel(self, event: str, body: Mapping[str, Any]) -> None:
        key = _where(body)
        pool = self.pool(key)
        if event == "DELETED":
            pool.policy, pool.uid, pool.scale_to_zero = HoldPolicy(), None, False
        else:
            spec = body.get("spec") or {}
            policy = _policy(body)
            pool.policy = policy or HoldPolicy()
            pool.uid = str(_meta(body).get("uid") or "") or None
            pool.scale_to_zero = policy is not None
            pool.port = int((spec.get("pod") or {}).get("port") or DEFAULT_WORKER_PORT)
        self._refresh_pods(key)

    def service(self, event: str, body: Mapping[str, Any]) -> None:
        where = _where(body)
        old = self._services.pop(where, None)
        for ip in old.ips if old else ():
            if self.by_ip.get(ip) == where:
                del self.by_ip[ip]
        if event == "DELETED":
            return
        spec = body.get("spec") or {}
        ips = tuple(str(ip) for ip in (spec.get("clusterIPs") or [spec.get("clusterIP")]) if ip and ip != "None")
        model = str((_meta(body).get("labels") or {}).get(LABEL_MODEL) or "")
        self._services[where] = _Seen(_owners(body), model=model, ips=ips)
        for ip in ips:
            self.by_ip[ip] = where

    def endpoint_slice(self, event: str, body: Mapping[str, Any]) -> None:
        where = _where(body)
        if event == "DELETED":
            self._slices.pop(where, None)
        else:
            self._slices[where] = _Seen(_owners(body), urls=_pod_urls(body))
        for key in list(self.pools):
            if key[0] == where[0] and pods_slice_name(key[1]) == where[1]:
                self._refresh_pods(key)

    def relisted_endpoint_slices(self, namespace: str | None = None) -> None:
        """A full list of ``namespace``'s slices follows (None: every namespace's): forget those
        pools' pods (the list brings back those that remain), and no other namespace's."""
        self._slices = {where: seen for where, seen in self._slices.items()
                        if namespace is not None and where[0] != namespace}
        for key in self.pools:
            if namespace is None or key[0] == namespace:
                self._refresh_pods(key)

    def _refresh_pods(self, key: PoolKey) -> None:
        """The pool's pods: those of the slice named as the operator names it, owned by its WarmModel."""
        pool = self.pool(key)
        seen = self._slices.get((key[0], pods_slice_name(key[1])))
        owned = seen is not None and pool.uid is not None and pool.uid in seen.owners
        pool.pods = list(seen.urls) if owned and seen is not None else []
        if pool.pods:
            pool.has_pods.set()
        else:
            pool.has_pods.clear()

    # ---------------------------------------------------------------- requests

    def resolve(self, host: str, caller_namespace: str | None) -> PoolKey:
        """The scale-to-zero WarmModel a request's Host header names: its Service's ClusterIP, or
        its DNS name (``<name>`` in the caller's own namespace, ``<name>.<namespace>``,
        ``<name>.<namespace>.svc[.<cluster domain>]``)."""
        name = _strip_port(host.strip().lower())
        if not name:
            raise Misdirected("no Host header")
        if _is_ip(name):
            found = self.by_ip.get(name)
            if found is None:
                raise Misdirected(f"Host {name} is no known Service's ClusterIP")
            namespace, service = found
        else:
            labels = name.split(".")
            if len(labels) >= 2:
                namespace, service = labels[1], labels[0]
            elif caller_namespace is not None:
                namespace, service = caller_namespace, labels[0]
            else:
                raise Misdirected(f"Host {name!r} has no namespace and the caller is no pod we know")
        seen = self._services.get((namespace, service))
        if seen is None or not seen.model:
            raise Misdirected(f"no Service {namespace}/{service} of a WarmModel")
        key = (namespace, seen.model)
        pool = self.pools.get(key)
        if pool is None or pool.uid is None or service != service_name(seen.model):
            raise Misdirected(f"Service {namespace}/{service} names WarmModel {seen.model!r}, which is not known")
        if pool.uid not in seen.owners:
            raise Misdirected(f"Service {namespace}/{service} is not owned by WarmModel {key[0]}/{key[1]}")
        if not pool.scale_to_zero:
            raise Misdirected(f"WarmModel {key[0]}/{key[1]} does not scale to zero")
        return key


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
