"""Model sources against a hostile loopback server: no redirect is followed, no internal address
is reached (the canary on 127.0.0.2 stands for one), a DNS answer cannot change between the
check and the connection, bodies are capped and every read ends by its deadline, and no error
carries the size or digest of what came back."""

from __future__ import annotations

import hashlib
import ipaddress
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from warmpool_nodecache.agent import open_source
from warmpool_nodecache.blocks import BlockCorruptError
from warmpool_nodecache.fill import fill_revision
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import ManifestError, build_manifest, write_manifest
from warmpool_nodecache.netguard import AddressPolicy, AddressRefusedError
from warmpool_nodecache.s3 import S3Credentials, S3Source, S3SourceConfig
from warmpool_nodecache.source import HttpSource, HttpSourceConfig, ReadLimits, SourceError, SourceLimitError

from tests.support.hostile_server import (
    SECRET,
    Behaviour,
    HostileServer,
    endless,
    fixed,
    hostile_server,
    redirect,
    trickle,
)
from warmpool.contract.files import MANIFEST_FILENAME

pytestmark = pytest.mark.unit

#: The hostile servers listen on 127.0.0.1, which the tests allow; everything else on loopback
#: (the canary's 127.0.0.2) stays refused, as an internal address is.
POLICY = AddressPolicy.from_flags(cluster=[], allowed=["127.0.0.1/32"])
LIMITS = ReadLimits(max_manifest_bytes=1024 * 1024, max_block_bytes=64 * 1024, deadline_s=1.5)
BLOCK = 16 * 1024


@pytest.fixture()
def canary() -> Iterator[HostileServer]:
    with hostile_server("127.0.0.2") as server:
        yield server


@pytest.fixture()
def hostile() -> Iterator[HostileServer]:
    with hostile_server("127.0.0.1") as server:
        yield server


def _http(url: str, policy: AddressPolicy | None = POLICY, limits: ReadLimits = LIMITS) -> HttpSource:
    return HttpSource(HttpSourceConfig(url, timeout_s=5, attempts=2, backoff_s=0.01, policy=policy, limits=limits))


def _within(seconds: float, call: Callable[[], Any]) -> BaseException | None:
    """Run ``call`` in a thread; the exception it raised (None if it returned).  Fails the test
    when it is still running after ``seconds`` (a reader held by a trickle)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert outcome, f"the read was still running after {seconds}s"
    return outcome[0]


def test_a_redirect_is_not_followed(hostile: HostileServer, canary: HostileServer) -> None:
    hostile.state.routes[f"/m/{MANIFEST_FILENAME}"] = redirect(f"{canary.url}/latest/meta-data/")
    hostile.state.routes["/m/w.bin"] = redirect(f"{canary.url}/secret", status=307)
    for policy in (POLICY, None):  # with no address policy (an operator's own URL) as well
        source = _http(f"{hostile.url}/m", policy)
        with pytest.raises(SourceError, match="redirect") as raised:
            source.fetch_manifest()
        assert canary.url not in str(raised.value)
        with pytest.raises(SourceError, match="redirect"):
            source.fetch_range("w.bin", 0, 16)
    assert canary.state.count() == 0


def test_internal_addresses_are_refused_before_a_connection(canary: HostileServer) -> None:
    # A spec's source is guarded by default: loopback, link-local and the like are refused.
    source = open_source({"http": {"url": f"{canary.url}/m"}}, None)
    with pytest.raises(AddressRefusedError, match=r"127\.0\.0\.2, in a loopback"):
        source.fetch_manifest()
    with pytest.raises(AddressRefusedError):
        _http(f"http://localhost:{canary.port}/m", AddressPolicy()).fetch_manifest()  # a name for loopback
    s3 = open_source({"s3": {"endpoint": canary.url, "bucket": "models"}}, None)
    with pytest.raises(AddressRefusedError):
        s3.fetch_manifest()
    assert canary.state.count() == 0


def test_the_policy_refuses_cluster_ranges_and_mapped_addresses_unless_allowed() -> None:
    policy = AddressPolicy.from_flags(cluster=["10.96.0.0/12", "fd00:10::/64"], allowed=["10.96.0.10/32"])
    refused = {a: policy.refusal(ipaddress.ip_address(a)) for a in (
        "10.96.0.1", "fd00:10::5", "169.254.169.254", "::ffff:127.0.0.1", "::ffff:10.100.0.1", "0.0.0.0",
        "fe80::1", "10.96.0.10", "192.0.2.7")}
    assert all(refused[a] for a in ("169.254.169.254", "::ffff:127.0.0.1", "0.0.0.0", "fe80::1")), refused
    assert "cluster" in str(refused["10.96.0.1"]) and "cluster" in str(refused["fd00:10::5"])
    assert "cluster" in str(refused["::ffff:10.100.0.1"])
    assert refused["10.96.0.10"] is None and refused["192.0.2.7"] is None  # allowed; outside every range
    with pytest.raises(ValueError, match=r"--cluster-network '10\.0\.0\.0/33' is not a CIDR"):
        AddressPolicy.from_flags(cluster=["10.0.0.0/33"], allowed=[])


def test_the_address_checked_is_the_address_connected_to(
    hostile: HostileServer, canary: HostileServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name whose answers alternate between 127.0.0.1 and 127.0.0.2 (DNS rebinding) reaches
    127.0.0.2 never: each read resolves the name once, checks what it got and connects to that
    (resolving again to connect would have drawn 127.0.0.2)."""
    hostile.state.routes[f"/m/{MANIFEST_FILENAME}"] = fixed(b"{}")
    real = socket.getaddrinfo
    asked: list[str] = []

    def rebinding(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "models.rebind.test":
            return real(host, port, *args, **kwargs)
        asked.append(host)
        address = "127.0.0.1" if len(asked) % 2 else "127.0.0.2"
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    url = f"http://models.rebind.test:{hostile.port}/m"
    assert _http(url).fetch_manifest() == b"{}"
    with pytest.raises(AddressRefusedError, match=r"resolves to 127\.0\.0\.2"):
        _http(url).fetch_manifest()  # the next read asks again, and what it gets is checked again
    assert len(asked) == 2
    assert canary.state.count() == 0 and hostile.state.count() == 1


def test_a_huge_body_is_refused_at_the_cap(hostile: HostileServer) -> None:
    chunked, declared = "/huge/" + MANIFEST_FILENAME, "/declared/" + MANIFEST_FILENAME
    hostile.state.routes[chunked] = endless(hostile.state, chunked)
    hostile.state.routes[declared] = endless(hostile.state, declared, declare=True)
    with pytest.raises(SourceLimitError, match="larger than the 1048576-byte limit"):
        _http(f"{hostile.url}/huge").fetch_manifest()
    with pytest.raises(SourceLimitError, match="larger than the 1048576-byte limit; not read"):
        _http(f"{hostile.url}/declared").fetch_manifest()
    # The reader hung up near the cap: of 256 MiB offered, little more than socket buffers went out.
    assert hostile.state.sent[chunked] < 32 * 1024 * 1024, hostile.state.sent
    assert hostile.state.sent[declared] < 32 * 1024 * 1024, hostile.state.sent
    # A range longer than asked, and a block size past the limit, are refused too.
    hostile.state.routes["/m/w.bin"] = fixed(b"y" * 4096, overlong=True)
    with pytest.raises(SourceLimitError, match="larger than the 16-byte limit"):
        _http(f"{hostile.url}/m").fetch_range("w.bin", 0, 16)
    with pytest.raises(SourceLimitError, match="block limit"):
        _http(f"{hostile.url}/m").fetch_range("w.bin", 0, 1024 * 1024)


@pytest.mark.parametrize("in_headers", [False, True], ids=["body", "headers"])
def test_a_trickled_answer_ends_by_the_deadline(hostile: HostileServer, in_headers: bool) -> None:
    path = f"/slow/{MANIFEST_FILENAME}"
    hostile.state.routes[path] = trickle(hostile.state, path, interval_s=0.05, max_s=60, in_headers=in_headers)
    started = time.monotonic()
    error = _within(15, _http(f"{hostile.url}/slow").fetch_manifest)
    assert isinstance(error, SourceLimitError) and "deadline" in str(error), error
    assert time.monotonic() - started < LIMITS.deadline_s + 3


def test_an_s3_store_that_redirects_or_trickles_is_bounded(hostile: HostileServer, canary: HostileServer) -> None:
    creds = S3Credentials("AKIDEXAMPLE", "not-printed-secret")
    config = S3SourceConfig(hostile.url, "models", "m", credentials=creds, attempts=2, policy=POLICY, limits=LIMITS)
    hostile.state.routes[f"/models/m/{MANIFEST_FILENAME}"] = redirect(f"{canary.url}/models/m", status=307)
    with pytest.raises(SourceError):
        S3Source(config).fetch_manifest()
    slow = "/models/m/w.bin"
    hostile.state.routes[slow] = trickle(hostile.state, slow, interval_s=0.05, max_s=60)
    error = _within(15, lambda: S3Source(config).fetch_range("w.bin", 0, 4096))
    assert isinstance(error, SourceLimitError) and "deadline" in str(error), error
    assert canary.state.count() == 0
    assert "not-printed-secret" not in str(error)


def _served_model(tmp_path: Path) -> tuple[Path, Any]:
    from warmpool_dev.testing_models import make_tiny_llama

    root = make_tiny_llama(tmp_path / "m", layers=2, seed=5)
    manifest = build_manifest(root, block_size=BLOCK)
    write_manifest(root, manifest)
    return root, manifest


def test_wrong_sizes_and_bytes_leave_no_size_or_digest_in_the_error(tmp_path: Path) -> None:
    """The source's sizes and the digests of what it sent stay out of every error: they would
    otherwise read an endpoint back through a status, a number or a hash at a time."""
    root, manifest = _served_model(tmp_path)
    first = manifest.files[0]
    with hostile_server("127.0.0.1", directory=root) as server:
        server.state.routes["/" + first.path] = fixed((root / first.path).read_bytes(), head_length=777_777)
        with pytest.raises(ManifestError, match="the source has another size") as sized:
            fill_revision(CacheLayout(tmp_path / "c1"), _http(server.url))
        assert "777777" not in str(sized.value)
        # The bytes a block's range returns are someone else's (the secret): a hash mismatch.
        weights = next(f for f in manifest.files if f.path.endswith(".safetensors") and len(f.blocks) > 1)
        lying = SECRET * (weights.size // len(SECRET) + 1)
        server.state.routes["/" + first.path] = fixed((root / first.path).read_bytes())
        server.state.routes["/" + weights.path] = fixed(lying[: weights.size])
        with pytest.raises(BlockCorruptError, match="never matched the manifest's SHA-256") as hashed:
            fill_revision(CacheLayout(tmp_path / "c2"), _http(server.url))
        text = str(hashed.value)
        sent = {lying[i * BLOCK: (i + 1) * BLOCK] for i in range(len(weights.blocks))}
        assert not any(hashlib.sha256(block).hexdigest() in text for block in sent), text
        # A range that comes back short says so, not how short.
        server.state.routes["/" + weights.path] = fixed(b"z" * 100, head_length=weights.size)
        with pytest.raises(SourceError, match="came back short") as short:
            fill_revision(CacheLayout(tmp_path / "c3"), _http(server.url))
        assert " 100 " not in str(short.value) and "100 bytes" not in str(short.value)


def test_urls_that_do_not_parse_are_source_errors() -> None:
    with pytest.raises(SourceError, match="does not parse"):
        open_source({"http": {"url": "http://h:abc/m"}}, None)
    with pytest.raises(SourceError, match="not a valid S3 endpoint"):
        open_source({"s3": {"endpoint": "http://bad_host:1", "bucket": "models"}}, None)
    with pytest.raises(SourceError, match="carries credentials"):
        HttpSource(HttpSourceConfig("http://user:pw@models.example/m"))
    with pytest.raises(SourceError, match="control or non-ASCII"):
        HttpSource(HttpSourceConfig("http://models.example/m\x00/\u00e9"))


def test_the_limits_are_checked(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="at least 1024 bytes"):
        _http("http://127.0.0.1:1/m", limits=ReadLimits(max_manifest_bytes=10))
    root, _ = _served_model(tmp_path)
    shutil.copytree(root, tmp_path / "big")
    big = build_manifest(tmp_path / "big", block_size=128 * 1024)
    write_manifest(tmp_path / "big", big)
    with hostile_server("127.0.0.1", directory=tmp_path / "big") as server:
        import asyncio

        from warmpool_nodecache.agent_reads import read_manifest

        with pytest.raises(ManifestError, match="block_size 131072 is above the 65536-byte limit"):
            asyncio.run(read_manifest(_http(server.url), LIMITS))


def _declaring(length: str, body: bytes) -> Behaviour:
    """A 200 declaring the Content-Length ``length`` (sent as is), then ``body`` and the end of the connection."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", length)
        handler.send_header("Connection", "close")
        handler.end_headers()
        if handler.command == "GET":
            handler.wfile.write(body)

    return answer


# A header arrives as Latin-1, its spaces trimmed: of the other scripts' digits, only these reach the reader.
@pytest.mark.parametrize("length", ["\u00b2", "1\u00b3", "+12", "1_2", "0x10", "9" * 5000])
def test_a_content_length_not_in_ascii_digits_is_no_length(hostile: HostileServer, length: str) -> None:
    """A "\u00b2" passes str.isdigit() and then int() raised out of the reader; int() took the rest."""
    hostile.state.routes["/m/w.bin"] = _declaring(length, b"")
    with pytest.raises(SourceError, match="HEAD gave no Content-Length in ASCII digits"):
        _http(f"{hostile.url}/m").size("w.bin")


def test_a_body_under_a_content_length_of_other_digits_is_read_to_its_end_under_the_cap(hostile: HostileServer) -> None:
    hostile.state.routes[f"/m/{MANIFEST_FILENAME}"] = _declaring("\u00b2", b"{}")
    assert _http(f"{hostile.url}/m").fetch_manifest() == b"{}"
