"""Leader election through a ``coordination.k8s.io`` Lease: exactly one replica acts.

A replica that starts waits until it holds the Lease, and only then runs kopf (so a standby
has no watch, writes nothing and scrapes nothing).  The holder renews every
``retry_period``.  Two rules keep two replicas from ever acting at once, as client-go's do:

* a standby judges expiry by its own clock (``warmpool.lease``, the Lease implementation the
  node agent shares): the Lease is free once the standby has seen the same record unchanged
  for ``lease_duration``, never by comparing the holder's wall-clock ``renewTime`` with its own;
* the holder stops acting before that can happen: once ``renew_deadline`` (shorter than
  ``lease_duration``) has passed since its last successful renewal began, it exits at once
  (the kubelet restarts it as a standby).

A holder told to stop (SIGTERM: a drain, a rollout) releases the Lease once kopf has stopped,
so a standby takes over at its next attempt instead of after ``lease_duration``.

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
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from warmpool.kube import KubeClient, KubeError
from warmpool.lease import Lease
from warmpool_operator.io.kube import Kube

log = logging.getLogger("warmpool.operator")


@dataclass(frozen=True)
class LeaderConfig:
    namespace: str
    name: str
    identity: str
    lease_duration: float = 8.0
    #: the holder exits this long after its last successful renewal began; shorter than
    #: lease_duration, so it has stopped before any standby may take over
    renew_deadline: float = 6.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(f"leader election needs 0 < retry period ({self.retry_period:g}s) < renew deadline "
                             f"({self.renew_deadline:g}s) < lease duration ({self.lease_duration:g}s)")


def default_identity() -> str:
    """The pod's name in a pod (its hostname), the pid and a random suffix: unique per process (in
    a container the pid is 1 each time, so a restarted process would otherwise pass for the one
    that died and take its Lease back as if it had never been lost)."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def leader_lease(kube: KubeClient, cfg: LeaderConfig) -> Lease:
    """This replica's hold on the leader Lease (the shared implementation, ``warmpool.lease``)."""
    return Lease(kube, cfg.namespace, cfg.name, cfg.identity, cfg.lease_duration)


async def acquire(cfg: LeaderConfig) -> float:
    """Block until this process holds the Lease; when (monotonic) the winning attempt began."""
    kube = await Kube.connect()
    lease = leader_lease(kube, cfg)
    try:
        log.info("leader: %s waiting for the Lease %s/%s", cfg.identity, cfg.namespace, cfg.name)
        while True:
            try:
                if await lease.try_acquire():
                    log.info("leader: %s holds the Lease %s/%s: acting (version %s)", cfg.identity, cfg.namespace,
                             cfg.name, lease.version)
                    return lease.renewed_at
            except (KubeError, OSError, TimeoutError) as error:
                log.warning("leader: Lease not read (%s): trying again", error)
            await asyncio.sleep(cfg.retry_period)
    finally:
        await kube.close()


def time_left(cfg: LeaderConfig, renewed: float, now: float) -> float:
    """Seconds the holder may still act after a renewal that began at ``renewed`` (<= 0: none)."""
    return cfg.renew_deadline - (now - renewed)


class Renewal:
    """The holder's renewal, from a thread of its own with its own event loop and API client: the
    process exits once the renew deadline since the last successful renewal (begun at monotonic
    ``renewed``) has passed, or another holds the Lease.  :meth:`release` ends it when this
    process stops acting of its own accord (SIGTERM), handing the Lease on at once."""

    def __init__(self, cfg: LeaderConfig, renewed: float) -> None:
        self.cfg = cfg
        self.renewed = renewed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._renew_forever()), name="lease renewal",
                                        daemon=True)
        self._thread.start()

    def _lose(self, reason: str) -> None:
        cfg = self.cfg
        log.error("leader: %s lost the Lease %s/%s (%s): exiting so that one replica acts",
                  cfg.identity, cfg.namespace, cfg.name, reason)
        logging.shutdown()
        os._exit(75)  # no clean-up: another replica may act soon

    async def _renew_forever(self) -> None:
        cfg = self.cfg
        kube = await Kube.connect()
        lease = leader_lease(kube, cfg)
        reason = "no renewal yet"
        try:
            while not self._stop.is_set():
                # Never sleep past the deadline: the check below must run before it.
                await asyncio.sleep(max(0.0, min(cfg.retry_period, time_left(cfg, self.renewed, time.monotonic()))))
                if self._stop.is_set():
                    return
                left = time_left(cfg, self.renewed, time.monotonic())
                if left <= 0:
                    self._lose(f"no renewal within the {cfg.renew_deadline:g}s renew deadline: {reason}")
                try:
                    # An attempt, not a renewal at the version held: this thread's client read
                    # nothing yet, and a holder that finds its own record renews it all the same.
                    if await asyncio.wait_for(lease.try_acquire(), timeout=left):
                        self.renewed = lease.renewed_at
                        continue
                    self._lose("another replica holds the Lease")
                except (KubeError, OSError, TimeoutError) as error:
                    reason = f"renewal failed: {str(error) or type(error).__name__}"  # a timeout has no text
                    log.warning("leader: %s", reason)
        finally:
            await kube.close()

    def release(self) -> None:
        """Stop renewing, then give the Lease up (best effort: a failure leaves it to expire)."""
        self._stop.set()
        self._thread.join(timeout=self.cfg.retry_period + self.cfg.renew_deadline)
        try:
            released = asyncio.run(release(self.cfg))
        except (KubeError, OSError, TimeoutError) as error:
            log.warning("leader: the Lease was not released (%s): it expires in %gs", error, self.cfg.lease_duration)
            return
        if released:
            log.info("leader: %s released the Lease %s/%s", self.cfg.identity, self.cfg.namespace, self.cfg.name)


async def release(cfg: LeaderConfig) -> bool:
    """Give the Lease up when this process holds it (see :meth:`warmpool.lease.Lease.release`)."""
    kube = await Kube.connect()
    try:
        return await leader_lease(kube, cfg).release()
    finally:
        await kube.close()


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
