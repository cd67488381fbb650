"""Container probes the way a kubelet runs them: the settings, the threshold state machine, the checks.

Only loopback is ever dialled: an httpGet/tcpSocket probe whose host is not a loopback
address fails with a message instead of sending traffic anywhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

Obj = Mapping[str, Any]
ProbeKind = Literal["startup", "readiness", "liveness"]

#: Kubelet sends this User-Agent on httpGet probes; apps sometimes special-case it.
USER_AGENT = "kube-probe/1.34 (warmpool-local)"


@dataclass(frozen=True)
class ProbeSpec:
    """A probe's handler and timing, with the API's defaults applied."""

    handler: str  # "httpGet", "tcpSocket", "exec" or "grpc"
    action: Obj
    initial_delay: float
    period: float
    timeout: float
    success_threshold: int
    failure_threshold: int

    @classmethod
    def from_k8s(cls, probe: Obj, kind: ProbeKind) -> ProbeSpec:
        handler = next((h for h in ("httpGet", "tcpSocket", "exec", "grpc") if h in probe), "none")
        success = int(probe.get("successThreshold") or 1)
        if kind != "readiness":
            # The API forces 1 for liveness and startup probes.
            success = 1
        return cls(
            handler=handler,
            action=probe.get(handler) or {},
            initial_delay=float(probe.get("initialDelaySeconds") or 0),
            period=float(max(1, int(probe.get("periodSeconds") or 10))),
            timeout=float(max(1, int(probe.get("timeoutSeconds") or 1))),
            success_threshold=max(1, success),
            failure_threshold=max(1, int(probe.get("failureThreshold") or 3)),
        )


class ProbeTracker:
    """Consecutive-result thresholds: the result flips only after N successes / M failures in a row.

    Initial results follow the kubelet: readiness starts failed (a pod is not ready until a
    probe passes), liveness starts passed, startup starts unknown (None).
    """

    def __init__(self, spec: ProbeSpec, kind: ProbeKind) -> None:
        self.spec = spec
        self.kind = kind
        self.result: bool | None = {"readiness": False, "liveness": True, "startup": None}[kind]
        self.successes = 0
        self.failures = 0

    def observe(self, ok: bool) -> bool | None:
        """Record one probe outcome; return the (possibly new) result."""
        if ok:
            self.successes += 1
            self.failures = 0
            if self.successes >= self.spec.success_threshold:
                self.result = True
        else:
            self.failures += 1
            self.successes = 0
            if self.failures >= self.spec.failure_threshold:
                self.result = False
        return self.result


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_port(port: Any, container: Obj) -> int:
    """A numeric port, or a named one looked up in the container's ports."""
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for spec in container.get("ports") or []:
        if spec.get("name") == port:
            return int(spec["containerPort"])
    raise ValueError(f"no container port named {port!r}")


@dataclass(frozen=True)
class ProbeContext:
    """What a probe needs to know about its container."""

    pod_ip: str
    container: Obj
    env: Mapping[str, str]  # the full process environment, for exec probes
    cwd: str | None
    session: aiohttp.ClientSession


async def run_probe(
    spec: ProbeSpec, ctx: ProbeContext, exec_argv: list[str] | None = None
) -> tuple[bool, str]:
    """Run one probe attempt, bounded by its timeout; return (passed, message)."""
    try:
        if spec.handler == "httpGet":
            return await _http_probe(spec, ctx)
        if spec.handler == "tcpSocket":
            return await _tcp_probe(spec, ctx)
        if spec.handler == "exec":
            return await _exec_probe(spec, ctx, exec_argv or [])
    except ValueError as error:
        return False, str(error)
    return False, f"{spec.handler} probes are not supported by the local kubelet"


async def _http_probe(spec: ProbeSpec, ctx: ProbeContext) -> tuple[bool, str]:
    action = spec.action
    host = str(action.get("host") or ctx.pod_ip)
    if not _is_loopback(host):
        return False, f"refusing to probe non-loopback host {host}"
    port = resolve_port(action.get("port"), ctx.container)
    scheme = str(action.get("scheme") or "HTTP").lower()
    path = str(action.get("path") or "/")
    if not path.startswith("/"):
        path = "/" + path
    url_host = f"[{host}]" if ":" in host else host
    headers = {"User-Agent": USER_AGENT, "Accept": "*/*"}
    for header in action.get("httpHeaders") or []:
        headers[str(header["name"])] = str(header.get("value", ""))
    try:
        async with ctx.session.get(
            f"{scheme}://{url_host}:{port}{path}",
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=spec.timeout),
            allow_redirects=False,
            ssl=False,  # kubelet does not verify probe certificates either
        ) as response:
            await response.read()
            ok = 200 <= response.status < 400
            return ok, f"HTTP probe returned {response.status}"
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        return False, f"HTTP probe failed: {type(error).__name__}: {error}"


async def _tcp_probe(spec: ProbeSpec, ctx: ProbeContext) -> tuple[bool, str]:
    host = str(spec.action.get("host") or ctx.pod_ip)
    if not _is_loopback(host):
        return False, f"refusing to probe non-loopback host {host}"
    port = resolve_port(spec.action.get("port"), ctx.container)
    try:
        async with asyncio.timeout(spec.timeout):
            _reader, writer = await asyncio.open_connection(host, port)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True, "TCP connect succeeded"
    except (TimeoutError, OSError) as error:
        return False, f"TCP probe failed: {type(error).__name__}: {error}"


async def _exec_probe(spec: ProbeSpec, ctx: ProbeContext, argv: list[str]) -> tuple[bool, str]:
    if not argv:
        return False, "exec probe has no command"
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=dict(ctx.env), cwd=ctx.cwd, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )
    except OSError as error:
        return False, f"exec probe could not start: {error}"
    try:
        async with asyncio.timeout(spec.timeout):
            output, _ = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return False, f"exec probe timed out after {spec.timeout:.0f}s"
    text = output.decode(errors="replace").strip()[-200:]
    return proc.returncode == 0, f"exec probe exited {proc.returncode}: {text}"
