"""Where a revision's bytes come from: a Protocol, and a plain HTTP layout that implements it.

HTTP layout (``spec.model.http: {url}``): ``<url>/<file path>`` serves each file (with
``Range`` support) and ``<url>/warmpool-manifest.json`` the revision's manifest.  Every request
has a bounded timeout; transient failures (connection errors, 5xx, 429) are retried a bounded
number of times with backoff; a 404 or other 4xx is an error at once (retrying does not fix it).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Protocol

from warmpool.contract import MANIFEST_FILENAME


class SourceError(RuntimeError):
    """A source that cannot deliver what was asked; the message names the URL and why."""


class SourceMissingError(SourceError):
    """The source says the object does not exist (HTTP 404)."""


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
    timeout_s: float = 30.0
    attempts: int = 4
    backoff_s: float = 0.2


class HttpSource:
    def __init__(self, config: HttpSourceConfig) -> None:
        parsed = urllib.parse.urlsplit(config.url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise SourceError(f"source url {config.url!r} is not an http(s) URL")
        if config.attempts < 1 or config.timeout_s <= 0:
            raise SourceError(f"source {config.url!r}: attempts must be >= 1 and timeout_s > 0")
        self.config = config
        self._base = config.url.rstrip("/")

    def describe(self) -> str:
        return self._base

    def _url(self, path: str) -> str:
        return f"{self._base}/{urllib.parse.quote(path)}"

    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        url = self._url(path)
        last: str = ""
        for attempt in range(self.config.attempts):
            if attempt:
                time.sleep(self.config.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(url, method=method, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                    return response.status, dict(response.headers.items()), response.read()
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    raise SourceMissingError(f"{url}: not found at the source (HTTP 404)") from None
                if exc.code < 500 and exc.code != 429:
                    raise SourceError(f"{url}: HTTP {exc.code} {exc.reason}") from None
                last = f"HTTP {exc.code} {exc.reason}"
            except (urllib.error.URLError, OSError) as exc:
                last = str(getattr(exc, "reason", exc))
        raise SourceError(f"{url}: {method} failed after {self.config.attempts} attempts: {last}")

    def fetch_manifest(self) -> bytes:
        return self._request("GET", MANIFEST_FILENAME, {})[2]

    def size(self, path: str) -> int:
        _, headers, _ = self._request("HEAD", path, {})
        length = {k.lower(): v for k, v in headers.items()}.get("content-length")
        if length is None or not length.isdigit():
            raise SourceError(f"{self._url(path)}: HEAD gave no Content-Length")
        return int(length)

    def fetch_range(self, path: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        status, _, body = self._request("GET", path, {"Range": f"bytes={offset}-{offset + length - 1}"})
        if status == 200 and offset == 0 and len(body) == length:
            return body  # a server without Range support, asked for the whole file
        if status != 206:
            raise SourceError(f"{self._url(path)}: asked for a byte range, got HTTP {status} (no Range support?)")
        if len(body) != length:
            raise SourceError(
                f"{self._url(path)}: bytes {offset}+{length} came back {len(body)} bytes long "
                "(is the file shorter than the manifest says?)"
            )
        return body
