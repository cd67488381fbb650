"""A real loopback HTTP server for the node cache's tests: serves a directory with Range support,
counts the requests it answers, and can be told to misbehave (serve a block corrupted once,
answer slowly) so the tests see what a filler does with a bad source."""

from __future__ import annotations

import collections
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

#: How often serve_forever looks for shutdown(): its default 0.5 s was half a second of every test's
#: teardown (shutdown() waits for the loop to notice).
SHUTDOWN_POLL_S = 0.02


@dataclass
class ServerState:
    directory: Path
    #: (path, start) of ranged GETs answered, and how many times each
    ranges: collections.Counter[tuple[str, int]] = field(default_factory=collections.Counter)
    #: plain GETs / HEADs answered, by path
    gets: collections.Counter[str] = field(default_factory=collections.Counter)
    heads: collections.Counter[str] = field(default_factory=collections.Counter)
    #: (path, start) ranges to serve with a flipped byte, once each
    corrupt_once: set[tuple[str, int]] = field(default_factory=set)
    range_delay_s: float = 0.0
    #: (path, start) ranges held back until `release` is set (bounded); then served, or answered
    #: with `held_status` when that is set (a source that went wrong mid-fill)
    held: set[tuple[str, int]] = field(default_factory=set)
    release: threading.Event = field(default_factory=threading.Event)
    held_status: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def block_requests(self) -> int:
        with self.lock:
            return sum(self.ranges.values())


@dataclass(frozen=True)
class RangeServer:
    url: str
    state: ServerState


def _handler(state: ServerState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # quiet
            return

        def _file(self) -> Path | None:
            relative = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
            path = (state.directory / relative).resolve()
            if not path.is_relative_to(state.directory.resolve()) or not path.is_file():
                self.send_error(404)
                return None
            return path

        def do_HEAD(self) -> None:
            path = self._file()
            if path is None:
                return
            with state.lock:
                state.heads[path.name] += 1
            self.send_response(200)
            self.send_header("Content-Length", str(path.stat().st_size))
            self.end_headers()

        def do_GET(self) -> None:
            path = self._file()
            if path is None:
                return
            data = path.read_bytes()
            relative = path.relative_to(state.directory.resolve()).as_posix()
            header = self.headers.get("Range")
            if header is None:
                with state.lock:
                    state.gets[relative] += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            first, _, last = header.removeprefix("bytes=").partition("-")
            start, end = int(first), min(int(last), len(data) - 1)
            if (relative, start) in state.held:
                state.release.wait(timeout=120)
                if state.held_status:
                    self.send_error(state.held_status)
                    return
            body = bytearray(data[start:end + 1])
            with state.lock:
                state.ranges[(relative, start)] += 1
                if (relative, start) in state.corrupt_once and body:
                    state.corrupt_once.discard((relative, start))
                    body[0] ^= 0xFF
            if state.range_delay_s:
                time.sleep(state.range_delay_s)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(bytes(body))

    return Handler


@contextmanager
def serve_directory(directory: Path) -> Iterator[RangeServer]:
    """Serve `directory` on 127.0.0.1 (an ephemeral port) until the context closes."""
    state = ServerState(directory)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                              name="range-server", daemon=True)
    thread.start()
    try:
        yield RangeServer(f"http://127.0.0.1:{server.server_address[1]}", state)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
