"""A ``coordination.k8s.io`` Lease held by one process: the one implementation behind the
operator's leader election and the node agent's fill and read Leases.

The rules are client-go's:

* every write is made at the resourceVersion just read, so two contenders racing get one success
  and one 409 (or 422), never two holders;
* a contender judges expiry by its own monotonic clock (:class:`Observed`): someone else's Lease
  is free once this process has seen the same record (holder, renewTime, resourceVersion)
  unchanged for its ``leaseDurationSeconds`` -- never by comparing the holder's wall-clock
  ``renewTime`` with its own clock, which may differ by more than a lease;
* a released Lease (no holder) is free at once;
* ``spec.leaseTransitions`` counts the changes of holder, so it only ever grows: a holder's
  :attr:`Lease.version` (one above the transitions it took the Lease at) fences what it publishes.

A holder must stop acting before anyone may take over: :meth:`Lease.renew` refuses with
:class:`LeaseLostError` once ``deadline_s`` (the lease duration unless given shorter) has passed
since its last successful write began.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from warmpool.kube import KubeClient, KubeError, Obj, micro_time

LEASES = "/apis/coordination.k8s.io/v1"


class LeaseLostError(RuntimeError):
    """This holder no longer holds the Lease (past its deadline, taken over, or deleted)."""


@dataclass
class Observed:
    """What a contender last saw of someone else's Lease, and when by its own monotonic clock."""

    record: tuple[str, str, str] | None = None
    at: float = 0.0

    def expired(self, lease: Obj, now: float) -> bool:
        """True once the record has stood unchanged for its leaseDurationSeconds since this process
        first saw it (a released Lease, with no holder, at once)."""
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        if not holder:
            return True
        record = (holder, str(spec.get("renewTime") or spec.get("acquireTime") or ""),
                  str((lease.get("metadata") or {}).get("resourceVersion") or ""))
        if record != self.record:
            self.record, self.at = record, now
            return False
        return now - self.at > float(spec.get("leaseDurationSeconds") or 0)


class Lease:
    """One identity's hold on the Lease ``namespace/name``.

    ``observed`` is what this process saw of the Lease while another held it; pass the same one
    to every attempt (a new :class:`Observed` starts the wait for expiry again).
    """

    def __init__(self, kube: KubeClient, namespace: str, name: str, identity: str, duration_s: float, *,
                 field_manager: str | None = None, observed: Observed | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.duration_s = float(duration_s)
        self.observed = observed if observed is not None else Observed()
        self._query = {"fieldManager": field_manager} if field_manager else {}
        self._clock = clock
        #: one above the Lease's leaseTransitions when this identity took it; None while not held
        self.version: int | None = None
        #: the monotonic time the last successful write began
        self.renewed_at = 0.0
        self._body: Obj | None = None
        # A renewer task and a fence may both renew: one write at a time, or the second would
        # carry a stale resourceVersion and read its own 409 as a take-over.
        self._writing = asyncio.Lock()

    @property
    def path(self) -> str:
        return f"{LEASES}/namespaces/{self.namespace}/leases/{self.name}"

    async def read(self) -> Obj | None:
        try:
            return await self.kube.request("GET", self.path)
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def try_acquire(self) -> bool:
        """One attempt: create the Lease, renew it when this identity holds it, or take it over
        when it is released or expired by :attr:`observed`.  True when this identity holds it."""
        async with self._writing:
            began = self._clock()
            lease = await self.read()
            now = micro_time(datetime.now(UTC))
            spec: dict[str, Any] = {"holderIdentity": self.identity, "renewTime": now,
                                    "leaseDurationSeconds": max(1, round(self.duration_s))}
            try:
                if lease is None:
                    body: Obj = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                 "metadata": {"name": self.name, "namespace": self.namespace},
                                 "spec": {**spec, "acquireTime": now, "leaseTransitions": 0}}
                    self._body = await self.kube.request("POST", self.path.rsplit("/", 1)[0], body=body,
                                                         query=self._query)
                else:
                    old = dict(lease.get("spec") or {})
                    if old.get("holderIdentity") != self.identity:
                        if not self.observed.expired(lease, self._clock()):
                            return False
                        spec["acquireTime"] = now
                        spec["leaseTransitions"] = int(old.get("leaseTransitions") or 0) + 1
                    self._body = await self.kube.request("PUT", self.path, body={**lease, "spec": {**old, **spec}},
                                                         query=self._query)
            except KubeError as error:
                if error.status in (409, 422):
                    return False  # another contender wrote first
                raise
            self.version = int(self._body["spec"].get("leaseTransitions") or 0) + 1
            self.renewed_at = began
            return True

    async def renew(self, deadline_s: float | None = None) -> None:
        """Renew at the version held; :class:`LeaseLostError` once ``deadline_s`` (default: the
        lease duration) has passed since the last successful write began, or when the Lease was
        taken over or deleted."""
        async with self._writing:
            if self.version is None or self._body is None:
                raise LeaseLostError(f"Lease {self.namespace}/{self.name}: not held")
            began = self._clock()
            late = began - self.renewed_at - (self.duration_s if deadline_s is None else deadline_s)
            if late > 0:
                self.version = None
                raise LeaseLostError(f"Lease {self.namespace}/{self.name}: not renewed in time ({late:.1f}s late)")
            body = {**self._body, "spec": {**self._body["spec"], "renewTime": micro_time(datetime.now(UTC))}}
            try:
                self._body = await self.kube.request("PUT", self.path, body=body, query=self._query)
            except KubeError as error:
                if error.status in (404, 409):
                    self.version = None
                    raise LeaseLostError(f"Lease {self.namespace}/{self.name}: taken over ({error})") from None
                raise
            self.renewed_at = began

    async def release(self) -> bool:
        """Give the Lease up when this identity holds it (no holder: a contender takes it at once),
        at the resourceVersion read, so a Lease someone took meanwhile is left alone.  The
        transitions stay recorded.  True when released."""
        async with self._writing:
            self.version, self._body = None, None
            lease = await self.read()
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return False
            spec = {**(lease.get("spec") or {}), "holderIdentity": "", "leaseDurationSeconds": 1,
                    "renewTime": micro_time(datetime.now(UTC))}
            try:
                await self.kube.request("PUT", self.path, body={**lease, "spec": spec}, query=self._query)
            except KubeError as error:
                if error.status in (404, 409):
                    return False
                raise
            return True
