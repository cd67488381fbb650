"""A loopback TLS front for a plain-HTTP server, which keeps the request heads it relays.

It terminates TLS with a certificate the test made (``warmpool_devcluster.certs``), so a client
must trust the test's CA to get through, and it sees each request in clear: what a client really
signed and sent (an ``Authorization`` header's credential scope, ``X-Amz-Security-Token``) can be
checked on the wire.  Bytes are relayed unchanged both ways.  Loopback only, bounded: a connection
idle past ``idle_s`` is closed, and at most ``MAX_RECORDED_BYTES`` of requests are kept.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
from pathlib import Path

#: Bytes of client requests kept across all connections (heads only matter; bodies are small here).
MAX_RECORDED_BYTES = 4 * 1024 * 1024


class TlsRecordingProxy:
    def __init__(self, upstream: tuple[str, int], cert: Path, key: Path, idle_s: float = 30.0) -> None:
        if not upstream[0].startswith("127."):
            raise ValueError(f"the recording proxy relays to loopback only, not {upstream[0]}")
        self.upstream = upstream
        self.idle_s = idle_s
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(str(cert), str(key))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._recorded = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, name="tls-recording-proxy", daemon=True)
        self._accepter.start()

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def request_heads(self) -> list[dict[str, str]]:
        """Each relayed request's head: ``:request`` (its request line) and its headers, lower-cased."""
        with self._lock:
            data = bytes(self._recorded)
        heads = []
        for block in data.split(b"\r\n\r\n"):
            lines = block.decode("latin-1").split("\r\n")
            if not lines or " HTTP/1." not in lines[0]:
                continue
            head = {":request": lines[0]}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                head[name.strip().lower()] = value.strip()
            heads.append(head)
        return heads

    def close(self) -> None:
        self._stop.set()
        self._accepter.join(timeout=5)
        for thread in self._threads:
            thread.join(timeout=5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(raw,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, raw: socket.socket) -> None:
        raw.settimeout(self.idle_s)
        try:
            client = self._context.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):  # the client gave up (with TLS 1.3 a distrusting client says so later)
            raw.close()
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=self.idle_s)
        except OSError:
            client.close()
            return
        with client, upstream:
            self._relay(client, upstream)

    def _relay(self, client: ssl.SSLSocket, upstream: socket.socket) -> None:
        client.setblocking(False)
        upstream.setblocking(False)
        while not self._stop.is_set():
            # An SSL socket may hold decrypted bytes select() cannot see: read those first.
            ready = [client] if client.pending() else select.select([client, upstream], [], [], self.idle_s)[0]
            if not ready:
                return  # idle past the bound
            for sock in ready:
                try:
                    data = sock.recv(65536)
                except (ssl.SSLWantReadError, BlockingIOError):
                    continue
                except OSError:
                    return
                if not data:
                    return
                if sock is client:
                    with self._lock:
                        if len(self._recorded) + len(data) <= MAX_RECORDED_BYTES:
                            self._recorded += data
                    target: socket.socket = upstream
                else:
                    target = client
                try:
                    self._send_all(target, data)
                except OSError:
                    return

    def _send_all(self, sock: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = sock.send(view)
            except (ssl.SSLWantWriteError, BlockingIOError):
                if not select.select([], [sock], [], self.idle_s)[1]:
                    raise OSError("the peer took nothing within the idle bound") from None
                continue
            view = view[sent:]
