"""What a WarmModel's status says of a model source that failed: one text, whatever the source did
-- an address the agent refused, no connection, a 404, a 403, a 500, a redirect -- so a URL
pointed at an internal address does not tell its author what answers there (a port scan run by
the node agent).  The error itself, which the agent logs, still says which it was.

Every case reads the same URL on loopback: refused by the default policy, or allowed and then
answered (or not) by a real server on that port."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest
from warmpool_nodecache import agent
from warmpool_nodecache.agent_loop import said_of
from warmpool_nodecache.manifest import ManifestError
from warmpool_nodecache.netguard import AddressPolicy
from warmpool_nodecache.s3 import S3Credentials, S3Source, S3SourceConfig
from warmpool_nodecache.source import HttpSource, HttpSourceConfig, ReadLimits, Source
from warmpool_nodecache.source_errors import SOURCE_UNAVAILABLE, unavailable_text

from tests.support.hostile_server import HostileServer, fixed, hostile_server, redirect
from warmpool.contract.files import MANIFEST_FILENAME

pytestmark = pytest.mark.unit

ALLOWED = AddressPolicy.from_flags(cluster=[], allowed=["127.0.0.1/32"])
REFUSED = AddressPolicy()  # loopback, as any internal address, is refused by default
LIMITS = ReadLimits(deadline_s=5.0)


@pytest.fixture()
def server() -> Iterator[HostileServer]:
    with hostile_server("127.0.0.1") as started:
        yield started


def _http(url: str, policy: AddressPolicy) -> HttpSource:
    return HttpSource(HttpSourceConfig(url, timeout_s=2, attempts=2, backoff_s=0.01, policy=policy, limits=LIMITS))


def _s3(endpoint: str, policy: AddressPolicy) -> S3Source:
    return S3Source(S3SourceConfig(endpoint, "models", "m", credentials=S3Credentials("AKID", "not-a-secret"),
                                   attempts=1, connect_timeout_s=2, read_timeout_s=2, policy=policy, limits=LIMITS))


def _said(source: Source, read: Callable[[Source], object]) -> tuple[str, str, str]:
    """(where the source is, the status's text, the log's text) of ``read`` failing on ``source``."""
    with pytest.raises(Exception) as raised:
        read(source)
    return source.describe(), said_of(raised.value, source), agent.failure_text(raised.value)


def _closed_port() -> int:
    with socket.socket() as probe:  # a port just released: nothing listens there
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_refused_missing_forbidden_failing_and_silent_sources_read_the_same(server: HostileServer, kind: str) -> None:
    make = _http if kind == "http" else _s3
    url = f"{server.url}/m" if kind == "http" else server.url
    manifest = f"/m/{MANIFEST_FILENAME}" if kind == "http" else f"/models/m/{MANIFEST_FILENAME}"
    bucket = "/models" if kind == "s3" else "/none"  # S3 asks for the bucket after a 404

    def fetch(source: Source) -> object:
        return source.fetch_manifest()

    texts: dict[str, tuple[str, str, str]] = {}
    server.state.routes[manifest] = fixed(b"{}")  # what an internal endpoint would answer
    texts["refused"] = _said(make(url, REFUSED), fetch)
    assert server.state.count() == 0  # refused before any connection
    for case, status in (("missing", 404), ("forbidden", 403), ("failing", 500)):
        server.state.routes[manifest] = server.state.routes[bucket] = fixed(b"<Error/>", status=status)
        texts[case] = _said(make(url, ALLOWED), fetch)
    server.state.routes[manifest] = redirect("http://127.0.0.2/latest/meta-data/")
    texts["redirect"] = _said(make(url, ALLOWED), fetch)
    closed = f"http://127.0.0.1:{_closed_port()}"
    texts["silent"] = _said(make(f"{closed}/m" if kind == "http" else closed, ALLOWED), fetch)

    # The status says the source (as its author wrote it) and nothing of what happened there.
    assert all(status == unavailable_text(where) for where, status, _ in texts.values()), texts
    same_url = {status for case, (_, status, _) in texts.items() if case != "silent"}
    assert same_url == {unavailable_text(url if kind == "http" else "s3://models/m")}, same_url
    # The agent's log still tells them apart, for whoever runs the node.
    logged = {case: log for case, (_, _, log) in texts.items()}
    assert len(set(logged.values())) == len(logged), logged
    assert "in a loopback" in logged["refused"], logged


def test_a_source_that_answered_wrong_bytes_still_says_so() -> None:
    """Bytes that came back and do not match what the source's own manifest says are no oracle
    of what answers where: that failure keeps its words (the author's to fix)."""
    source = _http("http://127.0.0.1:9/m", ALLOWED)
    error = ManifestError("http://127.0.0.1:9/m: the manifest says 'a.bin' has 4 bytes, the source has another size")
    assert said_of(error, source) == str(error)
    assert not said_of(error, source).startswith(SOURCE_UNAVAILABLE)
