"""The HTTP source against real loopback servers: transient failures retried (bounded), a 404 or a
server without Range support refused at once with the URL named."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from warmpool_nodecache.source import HttpSource, HttpSourceConfig, SourceError, SourceMissingError

pytestmark = pytest.mark.unit


@contextmanager
def _server(statuses: list[int], body: bytes = b"0123456789") -> Iterator[tuple[str, list[str]]]:
    """Answers each request with the next status in `statuses` (the last one repeats)."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return

        def do_GET(self) -> None:
            seen.append(self.headers.get("Range") or "")
            status = statuses[min(len(seen) - 1, len(statuses) - 1)]
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def _source(url: str) -> HttpSource:
    return HttpSource(HttpSourceConfig(url, timeout_s=5, attempts=3, backoff_s=0.01))


def test_transient_errors_are_retried_a_bounded_number_of_times() -> None:
    with _server([503, 503, 200]) as (url, seen):
        assert _source(url).fetch_manifest() == b"0123456789" and len(seen) == 3
    with _server([503]) as (url, seen), pytest.raises(SourceError, match="failed after 3 attempts: HTTP 503"):
        _source(url).fetch_manifest()
    assert len(seen) == 3


def test_a_missing_object_and_a_server_without_range_support_fail_at_once() -> None:
    with _server([404]) as (url, seen), pytest.raises(SourceMissingError, match=r"w\.bin: not found"):
        _source(url).fetch_range("w.bin", 0, 4)
    assert len(seen) == 1
    with _server([200]) as (url, seen), pytest.raises(SourceError, match="no Range support"):
        _source(url).fetch_range("w.bin", 4, 2)
    assert seen == ["bytes=4-5"]


def test_an_unreachable_source_is_an_error_after_its_attempts() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(SourceError, match="failed after 3 attempts"):
            _source(f"http://127.0.0.1:{port}").fetch_manifest()
    with pytest.raises(SourceError, match="not an http"):
        HttpSource(HttpSourceConfig("ftp://127.0.0.1/x"))
