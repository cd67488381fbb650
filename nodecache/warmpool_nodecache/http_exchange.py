"""One bounded HTTP exchange with a model source: the checked address, no redirects, a size cap
and a total deadline.

Both sources read through :func:`exchange` (the HTTP source directly, the S3 source under
boto3's signing), so every read from a source a WarmModel names gets the same four bounds:

* the host is resolved once, every address is checked by the :class:`AddressPolicy`, and the
  connection goes to a checked address (a second DNS answer is never asked for);
* a redirect is answered to the caller as what it is (a 3xx); nothing follows it;
* a body larger than ``cap`` is refused as soon as it is known to be (its Content-Length, or
  the byte past the cap), so memory stays at the cap;
* the whole exchange -- connect, TLS, headers, body -- ends by ``deadline``: a watchdog shuts
  the socket down then, so a server that trickles (one header byte a second, or a body that
  never ends) cannot hold a reader, whatever the per-read socket timeout lets through.

Error messages name the URL and what was wrong, never the size or the bytes of what came back.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Container, Mapping
from dataclasses import dataclass

from warmpool.contract.numerals import ascii_int_or_none
from warmpool_nodecache.netguard import AddressPolicy, resolve
from warmpool_nodecache.source_errors import SourceError, SourceLimitError

MIB = 1024 * 1024
#: Bytes of an error answer read, then dropped (its text never reaches a status).
ERROR_BODY_BYTES = 64 * 1024
_CHUNK = 256 * 1024
#: The largest Content-Length believed (a signed 64-bit byte count); the caps apply below it.
MAX_CONTENT_LENGTH = 2**63 - 1


class SourceUnreachableError(SourceError):
    """No connection, or the connection broke: worth another attempt."""


@dataclass(frozen=True)
class ReadLimits:
    """What one read from a source may cost (``--max-manifest-bytes``, ``--max-block-bytes``,
    ``--source-deadline``)."""

    #: A manifest lists 32 bytes of hash per block: 32 MiB covers ~1M blocks (4 TB at 4 MiB).
    max_manifest_bytes: int = 32 * MIB
    #: The largest ``block_size`` a manifest may ask for (each fetch worker holds one block).
    max_block_bytes: int = 64 * MIB
    #: Seconds one read may take in all, every attempt included (a socket operation waits at
    #: most the source's own timeout inside it).
    deadline_s: float = 120.0

    def check(self) -> None:
        """ValueError naming the bound that is out of range."""
        if self.max_manifest_bytes < 1024:
            raise ValueError(f"the manifest size limit must be at least 1024 bytes, got {self.max_manifest_bytes}")
        if self.max_block_bytes < 4096:
            raise ValueError(f"the block size limit must be at least 4096 bytes, got {self.max_block_bytes}")
        if self.deadline_s <= 0:
            raise ValueError(f"the read deadline must be positive, got {self.deadline_s}s")


@dataclass(frozen=True)
class Endpoint:
    """A parsed http(s) URL: where to connect and what to ask for."""

    scheme: str
    host: str  # without brackets for an IPv6 literal
    port: int
    path: str  # path and query, at least "/"

    @property
    def origin(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_url(url: str) -> Endpoint:
    """The URL's parts; SourceError saying what is wrong when it does not parse as http(s)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise SourceError(f"source url {url!r} does not parse ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SourceError(f"source url {url!r} is not an http(s) URL with a host")
    if parts.username is not None or parts.password is not None:
        raise SourceError(f"source url {url!r} carries credentials; a model source URL may not")
    if not (url.isascii() and url.isprintable()) or any(c.isspace() for c in url):
        raise SourceError(f"source url {url!r} holds whitespace, control or non-ASCII characters "
                          "(percent-encode them)")
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return Endpoint(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), path)


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes  # a 2xx body whole (within the cap); of an error answer at most ERROR_BODY_BYTES


class _Watchdog:
    """Shuts the watched socket down at the deadline, so a blocked read or handshake returns at
    once.  It holds the socket itself: http.client hands a connection that will close over to
    its response and forgets the socket, while the response goes on reading from it."""

    def __init__(self, seconds: float) -> None:
        self.fired = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, seconds), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.fired:
                self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            self._shut()

    def cancel(self) -> None:
        self._timer.cancel()


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to a checked address; the Host header still names the URL's host."""

    def __init__(self, endpoint: Endpoint, address: str, timeout: float, watchdog: _Watchdog) -> None:
        super().__init__(endpoint.host, endpoint.port, timeout=timeout)
        self.address, self.watchdog = address, watchdog

    def _open(self) -> socket.socket:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = sock
        self.watchdog.watch(sock)  # before any handshake
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def connect(self) -> None:
        self._open()


class _PinnedHTTPS(_PinnedHTTP):
    """HTTPS to a checked address; the certificate is verified for the URL's host name (SNI too)."""

    def __init__(self, endpoint: Endpoint, address: str, timeout: float, watchdog: _Watchdog,
                 context: ssl.SSLContext) -> None:
        super().__init__(endpoint, address, timeout, watchdog)
        self.context = context
        self.default_port = 443

    def connect(self) -> None:
        self.sock = self.context.wrap_socket(self._open(), server_hostname=self.host)
        self.watchdog.watch(self.sock)  # the TLS socket owns the descriptor now


def content_length(header: str | None) -> int | None:
    """A Content-Length in ASCII digits, else None (unknown).  A server's header is a stranger's
    text: "\u00b2" passes str.isdigit() and then int() raises, and int() takes " 12" and "+12"."""
    return ascii_int_or_none(header, MAX_CONTENT_LENGTH)


def _read_body(response: http.client.HTTPResponse, cap: int, wanted: bool, what: str) -> bytes:
    """A wanted answer's body, refused past ``cap`` bytes; any other's cut at ERROR_BODY_BYTES."""
    limit = cap if wanted else ERROR_BODY_BYTES
    length = response.getheader("Content-Length")
    known = content_length(length)
    if wanted and known is not None and known > cap:
        raise SourceLimitError(f"{what}: the answer is larger than the {cap}-byte limit; not read")
    if wanted and known is not None:
        # One read into one bytes object (http.client stops at the Content-Length): a block is
        # copied once from the socket, not gathered in chunks and joined (a second copy of every
        # byte, half the CPU a fill spent on the network).  A short body is the caller's to judge.
        return response.read(known)
    chunks: list[bytes] = []
    total = 0
    while total <= limit:
        chunk = response.read1(_CHUNK)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > limit and wanted:
        raise SourceLimitError(f"{what}: the answer is larger than the {cap}-byte limit; not read")
    return b"".join(chunks)[:limit]


def _connect(endpoint: Endpoint, policy: AddressPolicy | None, deadline: float, socket_timeout_s: float,
             context: ssl.SSLContext | None, watchdog: _Watchdog, what: str) -> http.client.HTTPConnection:
    """A connection to the first checked address that answers (each tried within the deadline)."""
    addresses = resolve(endpoint.host, endpoint.port)
    if policy is not None:
        policy.check(endpoint.host, addresses)
    last: str = ""
    for address in addresses:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or watchdog.fired:
            break
        timeout = min(socket_timeout_s, remaining)
        connection: http.client.HTTPConnection
        if endpoint.scheme == "https":
            connection = _PinnedHTTPS(endpoint, address, timeout, watchdog, context or ssl.create_default_context())
        else:
            connection = _PinnedHTTP(endpoint, address, timeout, watchdog)
        try:
            connection.connect()
            return connection
        except ssl.SSLError as exc:
            connection.close()
            if watchdog.fired:
                break
            raise SourceError(f"{what}: TLS with {endpoint.host} failed ({exc.reason or exc})") from None
        except OSError as exc:
            connection.close()
            last = f"{address}: {exc.strerror or type(exc).__name__}"
    if watchdog.fired or deadline - time.monotonic() <= 0:
        raise SourceLimitError(f"{what}: no answer within the read deadline")
    raise SourceUnreachableError(f"{what}: no connection ({last})")


def exchange(url: str, method: str, headers: Mapping[str, str], *, policy: AddressPolicy | None, cap: int,
             deadline: float, socket_timeout_s: float = 30.0, context: ssl.SSLContext | None = None,
             wanted: Container[int] | None = None) -> Reply:
    """One request and its answer within the bounds of the module docstring (``deadline``: a
    ``time.monotonic()`` instant).  The body of a ``wanted`` status (default: any 2xx) is read
    under ``cap``; any other answer -- a 3xx, 4xx, 5xx -- is a Reply with at most
    ERROR_BODY_BYTES of its body, and the caller decides."""
    endpoint = parse_url(url)
    what = f"{method} {url}"
    if deadline - time.monotonic() <= 0:
        raise SourceLimitError(f"{what}: the read deadline had passed before the request")
    watchdog = _Watchdog(deadline - time.monotonic())
    try:
        connection = _connect(endpoint, policy, deadline, socket_timeout_s, context, watchdog, what)
        try:
            connection.request(method, endpoint.path, headers=dict(headers))
            response = connection.getresponse()
            is_wanted = response.status in wanted if wanted is not None else 200 <= response.status < 300
            # A HEAD answer has no body: its Content-Length is the object's size, not a body to cap.
            body = b"" if method == "HEAD" else _read_body(response, cap, is_wanted, what)
            if watchdog.fired:  # a body cut by the shutdown is not a body that ended
                raise SourceLimitError(f"{what}: the answer did not end within the read deadline")
            return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, body)
        except (http.client.HTTPException, OSError) as exc:
            if watchdog.fired:
                raise SourceLimitError(f"{what}: the answer did not end within the read deadline") from None
            raise SourceUnreachableError(f"{what}: the connection failed ({type(exc).__name__})") from None
        finally:
            connection.close()
    finally:
        watchdog.cancel()
