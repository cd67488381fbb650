"""boto3's requests of an S3 source sent through ``http_exchange``: the same address check, caps
and deadline as the HTTP source, with boto3 still building and signing every request.

botocore emits ``before-send`` with the signed request just before it would send it; a handler
that returns a response is used instead of botocore's own HTTP pool.  :class:`BoundedTransport`
is that handler: it reads the answer whole (a source's answers are bounded: a manifest, a block,
an error document), hands botocore a response over those bytes, and turns a connection failure
into botocore's own error so its bounded retries still apply.  The cap and deadline of the read
under way are set per thread by :meth:`BoundedTransport.bounds` (the fill reads from several
threads at once); a request outside one (a bucket check) gets the limits' manifest cap.
"""

from __future__ import annotations

import contextlib
import io
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from warmpool_nodecache.http_exchange import ReadLimits, SourceUnreachableError, exchange
from warmpool_nodecache.netguard import AddressPolicy


class _Body(io.BytesIO):
    """An answer's bytes as botocore reads a raw body (``read`` and ``stream``)."""

    def stream(self, **_: Any) -> Iterator[bytes]:
        data = self.read()
        if data:
            yield data


@dataclass
class _Bounds:
    cap: int
    deadline: float


class BoundedTransport:
    """The ``before-send`` handler of one S3 client (see the module docstring)."""

    def __init__(self, policy: AddressPolicy | None, limits: ReadLimits, socket_timeout_s: float,
                 tls: ssl.SSLContext | None = None) -> None:
        self.policy = policy
        self.tls = tls  # None: the system's trust store (an https endpoint's own CA bundle otherwise)
        self.limits = limits
        self.socket_timeout_s = socket_timeout_s
        self._local = threading.local()

    @contextlib.contextmanager
    def bounds(self, cap: int, deadline: float | None = None) -> Iterator[None]:
        """Every request this thread sends inside the block: answers under ``cap`` bytes, all of
        them (retries included) ended by one deadline, ``limits.deadline_s`` from now unless given
        (a ``time.monotonic()`` instant: a read that already spent some of it)."""
        self._local.bounds = _Bounds(cap, time.monotonic() + self.limits.deadline_s if deadline is None else deadline)
        try:
            yield
        finally:
            self._local.bounds = None

    def __call__(self, request: Any, **_: Any) -> Any:
        from botocore.awsrequest import AWSResponse
        from botocore.exceptions import EndpointConnectionError

        bounds: _Bounds | None = getattr(self._local, "bounds", None)
        if bounds is None:
            bounds = _Bounds(self.limits.max_manifest_bytes, time.monotonic() + self.limits.deadline_s)
        if request.body:  # a source only reads; an upload would need its body streamed, not this
            raise ValueError("the bounded S3 transport sends no request bodies")
        headers = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in request.headers.items()}
        try:
            reply = exchange(request.url, request.method, headers, policy=self.policy, cap=bounds.cap,
                             deadline=bounds.deadline, socket_timeout_s=self.socket_timeout_s, context=self.tls)
        except SourceUnreachableError as error:
            raise EndpointConnectionError(endpoint_url=request.url, error=str(error)) from None
        return AWSResponse(request.url, reply.status, reply.headers, _Body(reply.body))
