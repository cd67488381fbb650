"""Where a revision's bytes come from: a Protocol, and a plain HTTP layout that implements it.

HTTP layout (``spec.model.http: {url}``): ``<url>/<file path>`` serves each file (with
``Range`` support) and ``<url>/warmpool-manifest.json`` the revision's manifest.  Every read
goes through ``http_exchange.exchange``: the host's addresses checked by the source's
``AddressPolicy`` (when it has one: a source a WarmModel names always does), no redirects
followed, the answer capped (the manifest at ``max_manifest_bytes``, a range at the bytes
asked for) and the whole read -- every attempt -- ended by ``ReadLimits.deadline_s``.
Transient failures (connection errors, 5xx, 429) are retried a bounded number of times with
backoff; a 404, a redirect or another 4xx is an error at once (retrying does not fix it).
Errors name the URL and what was wrong, never the size or digest of what came back.
"""

from __future__ import annotations

import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Protocol

from warmpool.contract.files import MANIFEST_FILENAME
from warmpool_nodecache.http_exchange import (
    ReadLimits,
    Reply,
    SourceUnreachableError,
    content_length,
    exchange,
    parse_url,
)
from warmpool_nodecache.netguard import AddressPolicy
from warmpool_nodecache.source_errors import SourceError, SourceLimitError, SourceMissingError

__all__ = ["HttpSource", "HttpSourceConfig", "ReadLimits", "Source", "SourceError", "SourceLimitError",
           "SourceMissingError"]


class Source(Protocol):
    def describe(self) -> str: ...

    def fetch_manifest(self) -> bytes: ...

    def size(self, path: str) -> int:
        """The object's size in bytes (SourceMissingError if absent)."""
        ...

    def fetch_range(self, path: str, offset: int, length: int) -> bytes:
        """Exactly `length` bytes of `path` from `offset`."""
        ...


@dataclass(frozen=True)
class HttpSourceConfig:
    url: str
    timeout_s: float = 30.0  # one socket operation; ReadLimits.deadline_s bounds a whole read
    attempts: int = 4
    backoff_s: float = 0.2
    #: None: the caller vouches for the URL (an operator's own command line); a WarmModel's
    #: source always gets the node agent's policy.
    policy: AddressPolicy | None = None
    limits: ReadLimits = field(default_factory=ReadLimits)


class HttpSource:
    def __init__(self, config: HttpSourceConfig) -> None:
        parse_url(config.url)  # a URL that does not parse is refused here, naming what is wrong
        if config.attempts < 1 or config.timeout_s <= 0:
            raise SourceError(f"source {config.url!r}: attempts must be >= 1 and timeout_s > 0")
        try:
            config.limits.check()
        except ValueError as error:
            raise SourceError(f"source {config.url!r}: {error}") from None
        self.config = config
        self._base = config.url.rstrip("/")

    def describe(self) -> str:
        return self._base

    def _url(self, path: str) -> str:
        return f"{self._base}/{urllib.parse.quote(path)}"

    def _request(self, method: str, path: str, headers: dict[str, str], cap: int,
                 wanted: frozenset[int] | None = None) -> Reply:
        url = self._url(path)
        deadline = time.monotonic() + self.config.limits.deadline_s
        last: str = ""
        for attempt in range(self.config.attempts):
            if attempt:
                pause = self.config.backoff_s * 2 ** (attempt - 1)
                if time.monotonic() + pause >= deadline:
                    break
                time.sleep(pause)
            try:
                reply = exchange(url, method, headers, policy=self.config.policy, cap=cap, deadline=deadline,
                                 socket_timeout_s=self.config.timeout_s, wanted=wanted)
            except SourceUnreachableError as error:
                last = str(error).removeprefix(f"{method} {url}: ")
                continue
            if reply.status < 300:
                return reply
            if 300 <= reply.status < 400:
                raise SourceError(f"{url}: answered HTTP {reply.status}, a redirect; model sources are read "
                                  "where the URL says, redirects are not followed")
            if reply.status == 404:
                raise SourceMissingError(f"{url}: not found at the source (HTTP 404)")
            if reply.status < 500 and reply.status != 429:
                raise SourceError(f"{url}: HTTP {reply.status}")
            last = f"HTTP {reply.status}"
        if time.monotonic() >= deadline:
            raise SourceLimitError(f"{url}: {method} did not succeed within the "
                                   f"{self.config.limits.deadline_s:g}s read deadline ({last or 'no answer'})")
        raise SourceError(f"{url}: {method} failed after {self.config.attempts} attempts: {last}")

    def fetch_manifest(self) -> bytes:
        return self._request("GET", MANIFEST_FILENAME, {}, self.config.limits.max_manifest_bytes).body

    def size(self, path: str) -> int:
        length = content_length(self._request("HEAD", path, {}, 0).headers.get("content-length"))
        if length is None:
            raise SourceError(f"{self._url(path)}: HEAD gave no Content-Length in ASCII digits")
        return length

    def fetch_range(self, path: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        if length > self.config.limits.max_block_bytes:
            raise SourceLimitError(f"{self._url(path)}: a range of {length} bytes is past the "
                                   f"{self.config.limits.max_block_bytes}-byte block limit")
        # Only a 206 (or, from the start of the file, a 200 of the whole file) is read, under a cap
        # of the bytes asked for: a longer answer is refused as it arrives, not held.
        wanted = frozenset({200, 206}) if offset == 0 else frozenset({206})
        reply = self._request("GET", path, {"Range": f"bytes={offset}-{offset + length - 1}"}, length, wanted)
        body = reply.body
        if reply.status == 200 and offset == 0 and len(body) == length:
            return body  # a server without Range support, asked for the whole file
        if reply.status != 206:
            raise SourceError(f"{self._url(path)}: asked for a byte range, got HTTP {reply.status} (no Range support?)")
        if len(body) != length:
            raise SourceError(
                f"{self._url(path)}: bytes {offset}+{length} came back short "
                "(is the file shorter than the manifest says?)"
            )
        return body
