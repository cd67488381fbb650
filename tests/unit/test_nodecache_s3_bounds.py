"""The S3 source against loopback servers that misbehave: one that accepts and never answers, one that
answers 503 every time. Each request loop is bounded (timeouts and attempts), and the error names the
endpoint; the request counts show the bound."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from warmpool_nodecache.s3 import S3Credentials, S3Source, S3SourceConfig
from warmpool_nodecache.source import SourceError

pytestmark = pytest.mark.unit

CREDS = S3Credentials("AKIDEXAMPLE", "not-printed-secret")


@contextmanager
def _silent_server() -> Iterator[tuple[str, list[socket.socket]]]:
    """Accepts connections and never sends a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in accepted:
            conn.close()
        listener.close()


@contextmanager
def _unavailable_server() -> Iterator[tuple[str, list[str]]]:
    """Answers every request with 503 Slow Down (a transient error: retried, bounded)."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return

        def do_GET(self) -> None:
            seen.append(self.path)
            body = b"<Error><Code>SlowDown</Code><Message>busy</Message></Error>"
            self.send_response(503)
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


def test_a_store_that_never_answers_fails_after_bounded_attempts_naming_the_endpoint() -> None:
    with _silent_server() as (endpoint, accepted):
        source = S3Source(S3SourceConfig(endpoint, "models", "m/r1", credentials=CREDS, attempts=2,
                                         connect_timeout_s=1.0, read_timeout_s=0.5))
        with pytest.raises(SourceError, match=endpoint.replace(".", r"\.")) as raised:
            source.fetch_range("model.safetensors", 0, 16)
        assert "not-printed-secret" not in str(raised.value)
        assert 1 <= len(accepted) <= 2  # botocore's two attempts, no more


def test_a_store_answering_503_is_retried_a_bounded_number_of_times() -> None:
    with _unavailable_server() as (endpoint, seen):
        source = S3Source(S3SourceConfig(endpoint, "models", "m/r1", credentials=CREDS, attempts=3))
        with pytest.raises(SourceError, match=r"SlowDown|503"):
            source.fetch_manifest()
        assert len(seen) == 3
        assert all(path == "/models/m/r1/warmpool-manifest.json" for path in seen)
