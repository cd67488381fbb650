"""A loopback TCP relay whose open connections can be frozen: a stalled network path, made on purpose.

`freeze()` stops relaying on every connection open at that moment, in both directions, without
closing anything: the bytes (the API server's watch events, even its end of the watch) simply
stop arriving, as with a dropped NAT entry or a hung middlebox.  Connections opened afterwards
are relayed as usual, so a client that gives a stalled connection up and dials again recovers --
unless the freeze takes new connections too (``freeze(new_too=True)``: a path cut off entirely,
where a dial still connects but nothing passes) until :meth:`cut` ends the stall.
TLS passes through untouched (the relay never looks at the bytes).  Loopback only.
"""

from __future__ import annotations

import select
import socket
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.support.procs import HOST


@dataclass
class _Link:
    client: socket.socket
    upstream: socket.socket
    frozen: threading.Event = field(default_factory=threading.Event)


def _local(host: str) -> bool:
    """Loopback, or this machine's address on a real-node cluster's bridge (its API server's)."""
    from warmpool_devcluster.node_network import host_address_on_a_node_bridge

    return host.startswith("127.") or host in ("localhost", "::1") or host_address_on_a_node_bridge(host)


class StallProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        if not _local(upstream_host):
            raise ValueError(f"the stall proxy relays to this machine only (loopback, the node's bridge), "
                             f"not {upstream_host}")
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server((HOST, 0))
        self.port: int = self._listener.getsockname()[1]
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        #: connections accepted after the last freeze (a client that dialled again)
        self.accepted_since_freeze = 0
        self.frozen_links = 0
        #: new connections are frozen as they open (freeze(new_too=True)), until cut()
        self._freeze_new = False
        threading.Thread(target=self._accept, name="stall-proxy-accept", daemon=True).start()

    def freeze(self, new_too: bool = False) -> int:
        """Stall every connection open now (and, ``new_too``, every one opened until :meth:`cut`);
        returns how many were open."""
        with self._lock:
            self._freeze_new = new_too
            for link in self._links:
                link.frozen.set()
            self.frozen_links = len(self._links)
            self.accepted_since_freeze = 0
            return self.frozen_links

    def cut(self) -> int:
        """End every frozen connection at once (both sockets closed): its client learns only now
        that the connection is gone, whatever happened upstream meanwhile; connections opened from
        now on are relayed.  Returns how many."""
        with self._lock:
            self._freeze_new = False
            frozen = [link for link in self._links if link.frozen.is_set()]
            for link in frozen:
                for sock in (link.client, link.upstream):
                    sock.close()
            self._links = [link for link in self._links if link not in frozen]
            return len(frozen)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for link in self._links:
                for sock in (link.client, link.upstream):
                    sock.close()
            self._links.clear()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            link = _Link(client, upstream)
            with self._lock:
                if self._freeze_new:
                    link.frozen.set()
                self._links.append(link)
                self.accepted_since_freeze += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(link, src, dst), name="stall-proxy-pump",
                                 daemon=True).start()

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                if link.frozen.is_set():
                    # Stalled: read nothing, send nothing, close nothing -- until the proxy closes.
                    self._closed.wait(1.0)
                    continue
                readable, _, _ = select.select([src], [], [], 0.2)
                if not readable or link.frozen.is_set():
                    # Frozen while select waited: what arrived since is stalled too, else a quick
                    # client's first bytes after the freeze (a watch event) would slip through.
                    continue
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except (OSError, ValueError):
            pass  # the other direction (or close()) closed a socket under this one: a closed fd is -1
        if not link.frozen.is_set():
            for sock in (link.client, link.upstream):
                sock.close()


def relay_to_api_server(kubeconfig: Path, out: Path) -> StallProxy | None:
    """A relay to the kubeconfig's API server, and at ``out`` a copy of the kubeconfig whose every
    cluster's server is the relay (on 127.0.0.1); None when the API server is not on this machine."""
    config = yaml.safe_load(kubeconfig.read_text())
    url = urllib.parse.urlsplit(config["clusters"][0]["cluster"]["server"])
    if url.hostname is None or not _local(url.hostname) or url.port is None:
        return None
    proxy = StallProxy(url.hostname, url.port)
    for entry in config["clusters"]:
        entry_url = urllib.parse.urlsplit(entry["cluster"]["server"])
        # The serving certificate names 127.0.0.1, the relay's address.
        entry["cluster"]["server"] = f"{entry_url.scheme}://{HOST}:{proxy.port}"
    out.write_text(yaml.safe_dump(config))
    return proxy
