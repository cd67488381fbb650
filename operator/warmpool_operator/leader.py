"""Leader election through a ``coordination.k8s.io`` Lease: exactly one replica acts.

A replica that starts waits until it holds the Lease, and only then runs kopf (so a standby
has no watch, writes nothing and scrapes nothing).  The holder renews every
``retry_period``; a standby takes the Lease once its ``renewTime`` is older than
``lease_duration``.  A holder that cannot renew within ``lease_duration`` exits at once
(the kubelet restarts it as a standby) rather than risk two replicas acting.

Renewal runs in a thread with its own event loop and API client, so a busy operator loop
never delays it.  Who holds the Lease: ``kubectl get lease <name> -n <ns>`` (HOLDER column).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from warmpool_operator.kube import LEASES, Kube, KubeError

log = logging.getLogger("warmpool.operator")


@dataclass(frozen=True)
class LeaderConfig:
    namespace: str
    name: str
    identity: str
    lease_duration: float = 8.0
    retry_period: float = 2.0


def default_identity() -> str:
    """The pod's name in a pod (its hostname), plus the pid: unique per process."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}-{os.getpid()}"


def _micro(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text: str | None) -> datetime | None:
    if not text:
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None


def expired(lease: dict[str, Any], now: datetime) -> bool:
    spec = lease.get("spec") or {}
    renewed = _parse(spec.get("renewTime")) or _parse(spec.get("acquireTime"))
    duration = float(spec.get("leaseDurationSeconds") or 0)
    return renewed is None or now - renewed > timedelta(seconds=duration)


async def try_acquire(kube: Kube, cfg: LeaderConfig) -> bool:
    """One attempt: True when this process holds the Lease afterwards."""
    now = datetime.now(UTC)
    lease = await kube.get(LEASES, cfg.namespace, cfg.name)
    spec = {"holderIdentity": cfg.identity, "leaseDurationSeconds": max(1, round(cfg.lease_duration)),
            "renewTime": _micro(now)}
    try:
        if lease is None:
            await kube.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                               "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                               "spec": {**spec, "acquireTime": _micro(now), "leaseTransitions": 0}})
            return True
        held = (lease.get("spec") or {}).get("holderIdentity")
        if held != cfg.identity and not expired(lease, now):
            return False
        body = dict(lease)
        old = dict(lease.get("spec") or {})
        if held != cfg.identity:
            spec["acquireTime"] = _micro(now)
            spec["leaseTransitions"] = int(old.get("leaseTransitions") or 0) + 1
            log.info("leader: taking the Lease %s/%s over from %s", cfg.namespace, cfg.name, held)
        body["spec"] = {**old, **spec}
        await kube.replace(body)  # at the read resourceVersion: a race is a 409, never two holders
        return True
    except KubeError as error:
        if error.status in (409, 422):
            return False
        raise


async def acquire(cfg: LeaderConfig) -> None:
    """Block until this process holds the Lease."""
    kube = await Kube.connect()
    try:
        log.info("leader: %s waiting for the Lease %s/%s", cfg.identity, cfg.namespace, cfg.name)
        while True:
            try:
                if await try_acquire(kube, cfg):
                    log.info("leader: %s holds the Lease %s/%s: acting", cfg.identity, cfg.namespace, cfg.name)
                    return
            except (KubeError, OSError, TimeoutError) as error:
                log.warning("leader: Lease not read (%s): trying again", error)
            await asyncio.sleep(cfg.retry_period)
    finally:
        await kube.close()


def keep_renewing(cfg: LeaderConfig) -> threading.Thread:
    """Renew the Lease from a thread of its own; exit the process once the Lease may be lost."""

    async def renew_forever() -> None:
        kube = await Kube.connect()
        last = time.monotonic()
        while True:
            await asyncio.sleep(cfg.retry_period)
            try:
                if await asyncio.wait_for(try_acquire(kube, cfg), timeout=cfg.retry_period * 2):
                    last = time.monotonic()
                    continue
                reason = "another replica holds the Lease"
            except (KubeError, OSError, TimeoutError) as error:
                reason = f"renewal failed: {error}"
            if time.monotonic() - last > cfg.lease_duration or reason.startswith("another"):
                log.error("leader: %s lost the Lease %s/%s (%s): exiting so that one replica acts",
                          cfg.identity, cfg.namespace, cfg.name, reason)
                logging.shutdown()
                os._exit(75)  # no clean-up: another replica may act already

    thread = threading.Thread(target=lambda: asyncio.run(renew_forever()), name="lease renewal", daemon=True)
    thread.start()
    return thread


class _StandbyHealth(BaseHTTPRequestHandler):
    """/healthz of a replica that waits for the Lease: alive, just not acting."""

    def do_GET(self) -> None:
        body = b"standby: waiting for the leader Lease\n"
        self.send_response(200 if self.path == "/healthz" else 404)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not logged
        return


def serve_standby_health(bind: str, port: int) -> ThreadingHTTPServer:
    """Answer the liveness and readiness probes while waiting (kopf's endpoint starts only once
    this replica acts, on the same port, after :func:`stop_standby_health`)."""
    server = ThreadingHTTPServer((bind, port), _StandbyHealth)
    threading.Thread(target=server.serve_forever, name="standby health", daemon=True).start()
    return server


def stop_standby_health(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()
