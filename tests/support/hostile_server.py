"""A loopback HTTP server that answers as a hostile model source would: redirects, bodies that
never end or trickle, sizes that lie, bytes from somewhere else -- and a canary to stand for an
internal endpoint, counting every request that reaches it.

Each path can be given a behaviour (``routes``); any other path is served from ``directory``
with Range support, or is a 404.  Every loop a behaviour runs is bounded in bytes and seconds,
and stops as soon as the client goes away.
"""

from __future__ import annotations

import collections
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

Behaviour = Callable[[BaseHTTPRequestHandler], None]
#: What the canary answers: the bytes an internal endpoint would leak.
SECRET = b"internal-credentials: do-not-leak-0123456789abcdef"

#: How often serve_forever looks for shutdown(): its default 0.5 s was half a second of every test's
#: teardown (shutdown() waits for the loop to notice).
SHUTDOWN_POLL_S = 0.02



@dataclass
class HostileState:
    directory: Path | None = None
    routes: dict[str, Behaviour] = field(default_factory=dict)
    #: (method, path) of every request answered, in order
    requests: list[tuple[str, str]] = field(default_factory=list)
    #: body bytes written per path (what a reader was offered before it hung up)
    sent: collections.Counter[str] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, prefix: str = "/") -> int:
        with self.lock:
            return sum(1 for _, path in self.requests if path.startswith(prefix))


@dataclass(frozen=True)
class HostileServer:
    url: str
    host: str
    port: int
    state: HostileState


def _write(handler: BaseHTTPRequestHandler, state: HostileState, path: str, data: bytes) -> bool:
    """Write ``data``; False once the client has gone."""
    try:
        handler.wfile.write(data)
        handler.wfile.flush()
    except OSError:
        return False
    with state.lock:
        state.sent[path] += len(data)
    return True


def redirect(location: str, status: int = 302) -> Behaviour:
    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return answer


def endless(state: HostileState, path: str, max_bytes: int = 256 * 1024 * 1024, declare: bool = False) -> Behaviour:
    """A 200 whose body goes on (chunked, or under a Content-Length of ``max_bytes``) until the
    client hangs up or ``max_bytes`` were sent."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        if declare:
            handler.send_header("Content-Length", str(max_bytes))
        else:
            handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        chunk = b"x" * 65536
        framed = chunk if declare else b"%x\r\n%s\r\n" % (len(chunk), chunk)
        for _ in range(max_bytes // len(chunk)):
            if not _write(handler, state, path, framed):
                return

    return answer


def trickle(state: HostileState, path: str, interval_s: float = 0.05, max_s: float = 60.0,
            in_headers: bool = False) -> Behaviour:
    """One byte every ``interval_s`` for at most ``max_s``: of the body (which ends when the
    connection does: no length is declared), or -- ``in_headers`` -- of a header line that never ends."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        if in_headers:
            handler.flush_headers()
            if not _write(handler, state, path, b"X-Slow: "):
                return
        else:
            handler.send_header("Connection", "close")
            handler.end_headers()
        ends = time.monotonic() + max_s
        while time.monotonic() < ends:
            if not _write(handler, state, path, b"a"):
                return
            time.sleep(interval_s)

    return answer


def fixed(data: bytes, status: int = 200, head_length: int | None = None, overlong: bool = False) -> Behaviour:
    """``data`` for a GET (a Range answered with 206 and those bytes -- or, ``overlong``, with all
    of ``data``), and for a HEAD a Content-Length of ``head_length`` (default: the data's)."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        body = data
        header = handler.headers.get("Range")
        code = status
        if header is not None and handler.command == "GET":
            first, _, last = header.removeprefix("bytes=").partition("-")
            body, code = (data if overlong else data[int(first): int(last) + 1]), 206
        handler.send_response(code)
        length = head_length if handler.command == "HEAD" and head_length is not None else len(body)
        handler.send_header("Content-Length", str(length))
        handler.end_headers()
        if handler.command == "GET":
            handler.wfile.write(body)

    return answer


def _serve_file(handler: BaseHTTPRequestHandler, directory: Path, relative: str) -> None:
    path = (directory / relative).resolve()
    if not path.is_relative_to(directory.resolve()) or not path.is_file():
        handler.send_error(404)
        return
    fixed(path.read_bytes())(handler)


def _handler(state: HostileState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            return

        def _answer(self) -> None:
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            with state.lock:
                state.requests.append((self.command, path))
            self.close_connection = True
            behaviour = state.routes.get(path)
            if behaviour is not None:
                behaviour(self)
            elif state.directory is not None:
                _serve_file(self, state.directory, path.lstrip("/"))
            else:
                fixed(SECRET)(self)

        do_GET = _answer
        do_HEAD = _answer

    return Handler


@contextmanager
def hostile_server(host: str = "127.0.0.1", directory: Path | None = None) -> Iterator[HostileServer]:
    """A HostileServer on ``host`` (an ephemeral port) until the context closes.  Without routes
    or a directory it is a canary: every request gets :data:`SECRET` and is counted."""
    state = HostileState(directory)
    server = ThreadingHTTPServer((host, 0), _handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                              name=f"hostile-{host}", daemon=True)
    thread.start()
    port = int(server.server_address[1])
    try:
        yield HostileServer(f"http://{host}:{port}", host, port, state)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
