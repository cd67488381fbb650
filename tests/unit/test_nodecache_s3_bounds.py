"""The S3 source against loopback servers that misbehave: one that accepts and never answers, one that
answers 503 every time. Each request loop is bounded (timeouts and attempts), and the error names the
endpoint; the request counts show the bound.  And its block reads' fast path (a presigned URL per
object, no botocore per request) against a server that tells the two kinds of request apart."""

from __future__ import annotations

import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from warmpool_nodecache.s3 import S3Credentials, S3Source, S3SourceConfig, SourceAuthError
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
        # The block's fast path (one presigned GET), then botocore's two attempts, no more.
        assert 1 <= len(accepted) <= 3


def test_a_store_answering_503_is_retried_a_bounded_number_of_times() -> None:
    with _unavailable_server() as (endpoint, seen):
        source = S3Source(S3SourceConfig(endpoint, "models", "m/r1", credentials=CREDS, attempts=3))
        with pytest.raises(SourceError, match=r"SlowDown|503"):
            source.fetch_manifest()
        assert len(seen) == 3
        assert all(path == "/models/m/r1/warmpool-manifest.json" for path in seen)


OBJECT = bytes(range(256)) * 64  # every object of the store below: 16 KiB


@dataclass
class _Seen:
    presigned: list[tuple[str, str]] = field(default_factory=list)  # (path, X-Amz-Date it was signed at)
    header_signed: list[str] = field(default_factory=list)


@contextmanager
def _store(presigned_answer: Callable[[BaseHTTPRequestHandler, int, int], None] | None = None,
           ) -> Iterator[tuple[str, _Seen]]:
    """Serves OBJECT for every key with Range; tells a presigned GET (signature in the query, no
    Authorization header) from a header-signed one.  ``presigned_answer`` replaces the answer to
    presigned GETs (a refusal, a short body)."""
    seen = _Seen()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return

        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            params = urllib.parse.parse_qs(query)
            first, last = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
            if "X-Amz-Signature" in params and "Authorization" not in self.headers:
                seen.presigned.append((path, params["X-Amz-Date"][0]))
                if presigned_answer is not None:
                    presigned_answer(self, first, last)
                    return
            else:
                assert "Authorization" in self.headers
                seen.header_signed.append(path)
            body = OBJECT[first:last + 1]
            self.send_response(206)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Range", f"bytes {first}-{last}/{len(OBJECT)}")
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


def test_block_reads_go_through_one_presigned_url_per_object_not_botocore_per_request() -> None:
    with _store() as (endpoint, seen):
        source = S3Source(S3SourceConfig(endpoint, "models", "m/r1", credentials=CREDS))
        assert source.fetch_range("a.bin", 0, 4096) == OBJECT[:4096]
        assert source.fetch_range("a.bin", 4096, 4096) == OBJECT[4096:8192]
        assert source.fetch_range("b.bin", 100, 50) == OBJECT[100:150]
    assert seen.header_signed == []
    assert [path for path, _ in seen.presigned] == ["/models/m/r1/a.bin", "/models/m/r1/a.bin", "/models/m/r1/b.bin"]
    assert seen.presigned[0][1] == seen.presigned[1][1]  # the object's URL, signed once and used again


def _refuse(handler: BaseHTTPRequestHandler, first: int, last: int) -> None:
    body = b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
    handler.send_response(403)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _short(handler: BaseHTTPRequestHandler, first: int, last: int) -> None:
    body = OBJECT[first:last]  # one byte short
    handler.send_response(206)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def test_a_presigned_read_that_is_refused_or_short_is_read_again_through_botocore() -> None:
    for answer in (_refuse, _short):
        with _store(answer) as (endpoint, seen):
            source = S3Source(S3SourceConfig(endpoint, "models", "m/r1", credentials=CREDS))
            assert source.fetch_range("a.bin", 10, 1000) == OBJECT[10:1010]
        assert len(seen.presigned) == 1 and seen.header_signed == ["/models/m/r1/a.bin"]


def test_an_error_after_the_fast_path_names_the_key_id_never_the_presigned_url() -> None:
    class Refusing(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return

        def do_GET(self) -> None:
            _refuse(self, 0, 0)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        source = S3Source(S3SourceConfig(f"http://127.0.0.1:{server.server_address[1]}", "models", "m/r1",
                                         credentials=CREDS))
        with pytest.raises(SourceAuthError, match="AKIDEXAMPLE") as raised:
            source.fetch_range("a.bin", 0, 16)
    finally:
        server.shutdown()
        server.server_close()
    assert "X-Amz-Signature" not in str(raised.value) and "not-printed-secret" not in str(raised.value)

